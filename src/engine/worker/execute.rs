//! Executing a response: fusion, scaling and output allocation happen here once, for every
//! collective; the algorithms in [`crate::collective`] see only contiguous byte buffers.

use crate::collective::{self, reduce, split_rows};
use crate::comm::Communicator;
use crate::copy::copy;
use crate::error::{Error, Result};
use crate::types::{DType, OpKind, ReduceOp, Reduction};

use crate::control::message::{DeviceKind, Item, Response};
use crate::engine::entry::Entry;
use crate::engine::handle::Output;
use crate::engine::tensor::TensorBuf;
use crate::engine::TensorSpec;
use crate::timeline::{json_string, transfer_activity, Timeline};

use super::Worker;

impl Worker {
    /// Runs one response and completes the handles of its entries.
    pub(super) fn execute(&mut self, resp: Response) {
        if resp.kind == OpKind::Join {
            if let Some(h) = self.join.take() {
                h.complete(match &resp.error {
                    Some((code, msg)) => Err(Error::from_code(*code, msg, "join")),
                    None => Ok(Output {
                        last_joined: Some(resp.last_joined),
                        ..Output::default()
                    }),
                });
            }
            return;
        }
        for item in &resp.items {
            if let Some(id) = item.cache_id {
                self.remember(&item.request, id);
            }
        }
        let mut entries: Vec<Option<Entry>> = resp
            .items
            .iter()
            .map(|i| {
                self.pending
                    .remove(&(i.request.set_id, i.request.name.clone()))
            })
            .collect();
        for (item, entry) in resp.items.iter().zip(&entries) {
            if entry.is_some() {
                self.next_under_base(&item.request);
            }
        }
        if let Some((code, msg)) = &resp.error {
            if let Some(t) = &self.timeline {
                let args = format!("{{\"error\":{}}}", json_string(msg));
                resp.items
                    .iter()
                    .for_each(|i| t.end(&i.request.name, Some(args.clone())));
            }
            let err = Error::from_code(*code, msg, &resp.items[0].request.name);
            for e in entries.into_iter().flatten() {
                e.handle.complete(Err(err.clone()));
            }
            return;
        }
        let joined_here = resp.joined.contains(&self.rank);
        if entries.iter().any(Option::is_none) && !(joined_here && resp.kind == OpKind::Allreduce) {
            let err = Error::Io(format!(
                "internal error: rank {} got a {} response for a tensor it never submitted",
                self.rank,
                resp.kind.name()
            ));
            self.fail(err);
            return;
        }
        let Some(members) = self.sets.get(&resp.set_id).cloned() else {
            let err = Error::InvalidArgument(format!("process set {} was removed", resp.set_id));
            for e in entries.into_iter().flatten() {
                e.handle.complete(Err(err.clone()));
            }
            return;
        };
        let trace = Trace {
            timeline: self.timeline.as_ref(),
            names: resp.items.iter().map(|i| i.request.name.as_str()).collect(),
        };
        trace.end(); // negotiation
        trace.begin(resp.kind.name());
        let on_device = resp.items[0].request.device == DeviceKind::Cuda;
        let mut staging = None;
        if on_device
            || entries
                .iter()
                .flatten()
                .any(|e| e.request.device != DeviceKind::Host)
        {
            // Only CUDA ops fail on the device path's errors: the host path is unharmed.
            let staged = if on_device {
                self.device.stage(self.rank, &members, &resp, &mut entries)
            } else {
                Err(Error::Io(
                    "internal error: a host response for CUDA tensors".into(),
                ))
            };
            match staged {
                // A staged set's tensors now lie in host memory: the host collectives below
                // run them, and their results go back to the device before the handles
                // complete.
                Ok(Some(s)) => staging = Some(s),
                Ok(None) | Err(_) => {
                    trace.begin(device_activity(resp.kind));
                    let (transport, timeout) = (&mut *self.transport, self.timeout);
                    let tuning = &self.tuning;
                    // A layered set's step across hosts: the host collectives, flat.
                    let mut cross = |group: &[usize], buf: &mut [u8], red| {
                        let mut comm =
                            Communicator::new(&mut *transport, group, timeout, tuning.clone());
                        collective::allreduce(&mut comm, buf, red)
                    };
                    let result = staged.and_then(|_| {
                        self.device
                            .execute(self.rank, &members, &resp, &mut entries, &mut cross)
                    });
                    trace.end();
                    trace.end_op(&resp.items);
                    for e in entries.into_iter().flatten() {
                        e.handle
                            .complete(result.clone().map(|()| Output::default()));
                    }
                    return;
                }
            }
        }
        let mut comm = Communicator::new(
            &mut *self.transport,
            &members,
            self.timeout,
            self.tuning.clone(),
        )
        .with_hosts(&self.hosts);
        let transfer = transfer_activity(resp.kind);
        let result: Result<Vec<Output>> = match resp.kind {
            OpKind::Allreduce => allreduce(
                &mut comm,
                &mut self.fusion,
                &resp.items,
                &mut entries,
                &trace,
            )
            .map(|()| {
                entries
                    .iter_mut()
                    .map(|e| e.as_mut().map(owned_outputs).unwrap_or_default())
                    .collect()
            }),
            _ => {
                let entry = entries[0].as_mut().expect("checked above");
                let item = &resp.items[0];
                trace.begin(transfer);
                let out = match resp.kind {
                    OpKind::Allgather => allgather(&mut comm, item, entry),
                    OpKind::Broadcast => {
                        broadcast(&mut comm, &members, entry).map(|()| owned_outputs(entry))
                    }
                    OpKind::Alltoall => alltoall(&mut comm, item, entry),
                    OpKind::Reducescatter => reducescatter(&mut comm, entry),
                    OpKind::Barrier => collective::barrier(&mut comm).map(|()| Output::default()),
                    OpKind::Allreduce | OpKind::Join => unreachable!("handled above"),
                };
                trace.end();
                out.map(|o| vec![o])
            }
        };
        trace.end_op(&resp.items);
        drop(trace);
        let result = match staging {
            Some(s) => result.and_then(|outs| self.device.unstage(resp.set_id, s).map(|()| outs)),
            None => result,
        };
        match result {
            Ok(outputs) => {
                for (e, out) in entries.into_iter().zip(outputs) {
                    if let Some(e) = e {
                        e.handle.complete(Ok(out));
                    }
                }
            }
            Err(err) => {
                let err = self.diagnose(err);
                // The entries in flight were taken out of `pending`: fail them here, then
                // everything else.
                for e in entries.into_iter().flatten() {
                    e.handle.complete(Err(err.clone()));
                }
                self.fail(err);
            }
        }
    }
}

/// The timeline's name for a collective on the NCCL path (Horovod's).
fn device_activity(kind: OpKind) -> &'static str {
    match kind {
        OpKind::Allreduce => "NCCL_ALLREDUCE",
        OpKind::Broadcast => "NCCL_BCAST",
        OpKind::Reducescatter => "NCCL_REDUCESCATTER",
        OpKind::Allgather => "NCCL_ALLGATHER",
        OpKind::Alltoall => "NCCL_ALLTOALL",
        _ => "NCCL",
    }
}

/// Timeline events for every tensor of a response (a no-op without a timeline).
struct Trace<'a> {
    timeline: Option<&'a Timeline>,
    names: Vec<&'a str>,
}

impl Trace<'_> {
    fn begin(&self, activity: &'static str) {
        if let Some(t) = self.timeline {
            self.names.iter().for_each(|n| t.begin(n, activity));
        }
    }

    fn end(&self) {
        if let Some(t) = self.timeline {
            self.names.iter().for_each(|n| t.end(n, None));
        }
    }

    /// Ends the op's outer activity, recording each tensor's dtype and shape.
    fn end_op(&self, items: &[Item]) {
        if let Some(t) = self.timeline {
            for (n, item) in self.names.iter().zip(items) {
                let meta: Vec<String> = item
                    .request
                    .tensors
                    .iter()
                    .map(|m| format!("{} {:?}", m.dtype.name(), m.shape))
                    .collect();
                let args = format!("{{\"tensors\":{}}}", json_string(&meta.join("; ")));
                t.end(n, Some(args));
            }
        }
    }
}

/// Results written into engine-owned output buffers (callers without memory of their own,
/// such as Rust users and tests) are handed back through the `Output`.
fn owned_outputs(e: &mut Entry) -> Output {
    let mut out = Output::default();
    for t in e.spec.tensors.iter_mut() {
        if matches!(t.output, Some(TensorBuf::Owned(_) | TensorBuf::Pages(_))) {
            let buf = t.output.take().expect("matched above");
            out.tensors.push((buf, t.meta.shape.clone()));
        }
    }
    out
}

/// Fused allreduce: tensors of one dtype are packed into the fusion buffer (a single tensor is
/// reduced in place in its output), pre-scaled, reduced once, post-scaled and unpacked.
fn allreduce(
    comm: &mut Communicator<'_>,
    fusion: &mut Vec<u8>,
    items: &[Item],
    entries: &mut [Option<Entry>],
    trace: &Trace<'_>,
) -> Result<()> {
    let req0 = &items[0].request;
    let (op, pre, post) = (req0.op, req0.prescale, req0.postscale);
    let n = comm.size();
    // (item index, tensor index) grouped by dtype, in order of first appearance.
    let mut groups: Vec<(DType, Vec<(usize, usize)>)> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        for (t, meta) in item.request.tensors.iter().enumerate() {
            match groups.iter_mut().find(|(d, _)| *d == meta.dtype) {
                Some((_, v)) => v.push((i, t)),
                None => groups.push((meta.dtype, vec![(i, t)])),
            }
        }
    }
    for (dtype, members) in groups {
        // Large tensors are reduced where they lie: copying them through the fusion buffer
        // costs two passes over memory and buys nothing (fusion pays off for many small
        // tensors, whose per-collective latency it saves). The split depends on the request
        // alone, never on whether this rank has the tensor: a joined rank must run the same
        // collectives in the same order as the others, or their sums mix up tensors.
        // Adasum's dot products are per tensor: each is reduced alone, never in the buffer.
        let (mut solo, mut packed): (Vec<Slot>, Vec<Slot>) =
            members.into_iter().partition(|&(i, t)| {
                op == ReduceOp::Adasum || items[i].request.tensors[t].nbytes() >= FUSION_COPY_LIMIT
            });
        // A lone small tensor needs no fusion buffer either.
        if packed.len() == 1 {
            solo.append(&mut packed);
        }
        for (i, t) in solo {
            match entries[i].as_mut() {
                Some(entry) => {
                    let spec = &mut entry.spec.tensors[t];
                    let red = Reduction::over(dtype, op, post, n);
                    reduce_one(comm, spec, red, pre, trace)?;
                }
                // A joined rank contributes zeros (all-zero bytes are zero in every dtype).
                None => {
                    let mut zeros = TensorBuf::engine(items[i].request.tensors[t].nbytes())?;
                    zeros.as_mut_slice().fill(0);
                    trace.begin("TCP_ALLREDUCE");
                    let red = Reduction::new(dtype, op);
                    collective::allreduce(comm, zeros.as_mut_slice(), red)?;
                    trace.end();
                }
            }
        }
        if packed.is_empty() {
            continue;
        }
        if fusion.is_empty() {
            // Its full size at once, every page touched (a non-zero fill cannot become a lazy
            // calloc): a buffer that grew to the largest fusion seen so far kept growing, and
            // resident memory with it, for as long as a job ran.
            *fusion = vec![0xa5; FUSION_BUFFER_BYTES];
        }
        // Fused in chunks of at most the buffer's size, in the same order on every rank (each
        // packed tensor is smaller than FUSION_COPY_LIMIT, so smaller than the buffer).
        let mut rest = &packed[..];
        while !rest.is_empty() {
            let mut total = 0;
            let mut count = 0;
            for &(i, t) in rest {
                let len = items[i].request.tensors[t].nbytes();
                if total + len > fusion.len() {
                    break;
                }
                total += len;
                count += 1;
            }
            let (chunk, tail) = rest.split_at(count);
            rest = tail;
            let red = Reduction::over(dtype, op, post, n);
            fused_allreduce(
                comm,
                &mut fusion[..total],
                items,
                entries,
                chunk,
                (red, pre),
                trace,
            )?;
        }
    }
    Ok(())
}

/// Packs `chunk` into `buf` (exactly their size), reduces it once and unpacks the results.
fn fused_allreduce(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    items: &[Item],
    entries: &mut [Option<Entry>],
    chunk: &[Slot],
    (red, pre): (Reduction, f64),
    trace: &Trace<'_>,
) -> Result<()> {
    let len_of = |&(i, t): &Slot| items[i].request.tensors[t].nbytes();
    trace.begin("MEMCPY_IN_FUSION_BUFFER");
    let mut off = 0;
    for slot @ &(i, t) in chunk {
        let len = len_of(slot);
        let dst = &mut buf[off..off + len];
        match entries[i].as_ref() {
            Some(e) => copy(dst, e.spec.tensors[t].input.as_slice()),
            // A joined rank contributes zeros (all-zero bytes are zero in every dtype).
            None => dst.fill(0),
        }
        off += len;
    }
    reduce::scale(red.dtype, buf, pre)?;
    trace.end();
    trace.begin("TCP_ALLREDUCE");
    collective::allreduce(comm, buf, red)?;
    trace.end();
    trace.begin("MEMCPY_OUT_FUSION_BUFFER");
    let mut off = 0;
    for slot @ &(i, t) in chunk {
        let len = len_of(slot);
        if let Some(e) = entries[i].as_mut() {
            let out = e.spec.tensors[t]
                .output
                .as_mut()
                .expect("allreduce outputs are preallocated");
            copy(out.as_mut_slice(), &buf[off..off + len]);
        }
        off += len;
    }
    trace.end();
    Ok(())
}

/// A caller's output of the wrong size is refused before any byte moves. The sizes follow
/// from the negotiated request, so every rank whose caller computed them the same way agrees.
fn check_output_len(name: &str, kind: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "{kind} '{name}': the output given holds {got} bytes, the result needs {want}"
    )))
}

/// An output that shares memory with its input anywhere but where the in-place form puts
/// it: the ring would read bytes it has already overwritten.
fn misplaced(name: &str, kind: &str) -> Error {
    Error::InvalidArgument(format!(
        "{kind} '{name}': the output overlaps the input other than as this rank's block of it"
    ))
}

/// (item index, tensor index) of one tensor of a response.
type Slot = (usize, usize);

/// Size of the fusion buffer: fused tensors beyond it go in further chunks. A few times
/// [`FUSION_COPY_LIMIT`], so that a chunk carries several tensors, and small enough to keep
/// resident for good.
const FUSION_BUFFER_BYTES: usize = 4 * FUSION_COPY_LIMIT;

/// Tensors at least this large skip the fusion buffer.
const FUSION_COPY_LIMIT: usize = 1 << 20;

// Every packed tensor fits the buffer, so each chunk holds at least one.
const _: () = assert!(FUSION_COPY_LIMIT <= FUSION_BUFFER_BYTES);

/// Allreduce of one tensor into its own output memory, the input multiplied by `pre` first.
/// Not in place, the input is read where it lies (a prescale needs a copy of it first).
fn reduce_one(
    comm: &mut Communicator<'_>,
    spec: &mut TensorSpec,
    red: Reduction,
    pre: f64,
    trace: &Trace<'_>,
) -> Result<()> {
    let out = spec
        .output
        .as_mut()
        .expect("allreduce outputs are preallocated");
    trace.begin("TCP_ALLREDUCE");
    let in_place = out.same_memory(&spec.input);
    if !in_place && pre == 1.0 {
        let input = spec.input.as_slice();
        collective::allreduce_into(comm, input, out.as_mut_slice(), red)?;
    } else {
        let buf = out.as_mut_slice();
        if !in_place {
            // The prescale must not touch the caller's input: it is applied to the copy.
            copy(buf, spec.input.as_slice());
        }
        reduce::scale(red.dtype, buf, pre)?;
        collective::allreduce(comm, buf, red)?;
    }
    trace.end();
    Ok(())
}

fn allgather(comm: &mut Communicator<'_>, item: &Item, entry: &mut Entry) -> Result<Output> {
    let me = comm.rank();
    let mut out = Output::default();
    for (t, spec) in entry.spec.tensors.iter_mut().enumerate() {
        let meta = &spec.meta;
        let row_bytes = meta.row_elems() * meta.dtype.size();
        let dims = &item.first_dims[t];
        let counts: Vec<usize> = dims.iter().map(|d| d * row_bytes).collect();
        if let Some(result) = spec.output.as_mut() {
            // The caller's memory for the whole result: in place when the input is already
            // this rank's block of it.
            let total: usize = counts.iter().sum();
            check_output_len(&entry.request.name, "allgather", result.len(), total)?;
            let own = counts[..me].iter().sum::<usize>();
            if result.contains_at(&spec.input, own) {
                collective::allgatherv_in_place(comm, result.as_mut_slice(), &counts)?;
            } else if result.overlaps(&spec.input) {
                return Err(misplaced(&entry.request.name, "allgather"));
            } else {
                collective::allgatherv(
                    comm,
                    spec.input.as_slice(),
                    result.as_mut_slice(),
                    &counts,
                )?;
            }
            continue;
        }
        let mut result = TensorBuf::engine(counts.iter().sum())?;
        collective::allgatherv(comm, spec.input.as_slice(), result.as_mut_slice(), &counts)?;
        let mut shape = meta.shape.clone();
        shape[0] = dims.iter().sum();
        out.tensors.push((result, shape));
    }
    Ok(out)
}

fn broadcast(comm: &mut Communicator<'_>, members: &[usize], entry: &mut Entry) -> Result<()> {
    let root = members.binary_search(&entry.request.root).map_err(|_| {
        Error::InvalidArgument(format!("root {} is not in the set", entry.request.root))
    })?;
    for spec in entry.spec.tensors.iter_mut() {
        let out = spec
            .output
            .as_mut()
            .expect("broadcast outputs are preallocated");
        if !out.same_memory(&spec.input) && comm.rank() == root {
            copy(out.as_mut_slice(), spec.input.as_slice());
        }
        collective::broadcast(comm, out.as_mut_slice(), root)?;
    }
    Ok(())
}

fn alltoall(comm: &mut Communicator<'_>, item: &Item, entry: &mut Entry) -> Result<Output> {
    let n = comm.size();
    let me = comm.rank();
    let spec = &entry.spec.tensors[0];
    let meta = &spec.meta;
    let row_bytes = meta.row_elems() * meta.dtype.size();
    let m = &item.split_matrix;
    let send: Vec<usize> = (0..n).map(|j| m[me * n + j] * row_bytes).collect();
    let recv_rows: Vec<usize> = (0..n).map(|j| m[j * n + me]).collect();
    let recv: Vec<usize> = recv_rows.iter().map(|r| r * row_bytes).collect();
    let mut shape = meta.shape.clone();
    shape[0] = recv_rows.iter().sum();
    let spec = &mut entry.spec.tensors[0];
    // The caller's memory for the result (a staged CUDA tensor's bounce room), else the
    // engine's, handed back.
    let mut owned = match &spec.output {
        Some(result) => {
            check_output_len(
                &entry.request.name,
                "alltoall",
                result.len(),
                recv.iter().sum(),
            )?;
            if result.overlaps(&spec.input) {
                return Err(misplaced(&entry.request.name, "alltoall"));
            }
            None
        }
        None => Some(TensorBuf::engine(recv.iter().sum())?),
    };
    let result = match owned.as_mut() {
        Some(buf) => buf,
        None => spec.output.as_mut().expect("checked above"),
    };
    collective::alltoallv(
        comm,
        spec.input.as_slice(),
        &send,
        result.as_mut_slice(),
        &recv,
    )?;
    let tensors = owned.map(|buf| vec![(buf, shape)]).unwrap_or_default();
    Ok(Output {
        tensors,
        received_splits: recv_rows,
        last_joined: None,
    })
}

fn reducescatter(comm: &mut Communicator<'_>, entry: &mut Entry) -> Result<Output> {
    let n = comm.size();
    let me = comm.rank();
    let req = &entry.request;
    let pre = req.prescale;
    let mut out = Output::default();
    for spec in entry.spec.tensors.iter_mut() {
        let meta = &spec.meta;
        let rows = meta.shape[0];
        let row_bytes = meta.row_elems() * meta.dtype.size();
        let red = Reduction::over(meta.dtype, req.op, req.postscale, n);
        let counts: Vec<usize> = (0..n)
            .map(|r| split_rows(rows, n, r).1 * row_bytes)
            .collect();
        if let Some(result) = spec.output.as_ref() {
            check_output_len(&req.name, "reducescatter", result.len(), counts[me])?;
            let own = counts[..me].iter().sum::<usize>();
            if spec.input.contains_at(result, own) {
                // In place: the caller gave its tensor up, so the ring reduces in it (partial
                // sums are left in the other ranks' rows) and its share lands where it lies.
                let buf = spec.input.as_mut_slice();
                reduce::scale(meta.dtype, buf, pre)?;
                collective::reducescatter_in_place(comm, buf, &counts, red)?;
                continue;
            }
            if result.overlaps(&spec.input) {
                return Err(misplaced(&req.name, "reducescatter"));
            }
        }
        // The ring reads the caller's tensor in place; only a pre-scale needs a copy of it,
        // and only more than two ranks need room for partial sums in transit.
        let scaled = if pre == 1.0 {
            None
        } else {
            let mut b = TensorBuf::engine(spec.input.len())?;
            copy(b.as_mut_slice(), spec.input.as_slice());
            reduce::scale(meta.dtype, b.as_mut_slice(), pre)?;
            Some(b)
        };
        let input = scaled
            .as_ref()
            .map_or(spec.input.as_slice(), |b| b.as_slice());
        let mut scratch = TensorBuf::engine(if n > 2 { input.len() } else { 0 })?;
        let mut owned = None;
        let result = match spec.output.as_mut() {
            Some(caller) => caller,
            None => owned.insert(TensorBuf::engine(counts[me])?),
        };
        collective::reducescatter(
            comm,
            input,
            scratch.as_mut_slice(),
            &counts,
            red,
            result.as_mut_slice(),
        )?;
        let Some(result) = owned else {
            continue;
        };
        let mut shape = meta.shape.clone();
        shape[0] = counts[me] / row_bytes.max(1);
        if row_bytes == 0 {
            shape[0] = rows / n + usize::from(me < rows % n);
        }
        out.tensors.push((result, shape));
    }
    Ok(out)
}
