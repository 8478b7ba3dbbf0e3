//! A response's NCCL calls: which tensors fuse into one call, the submitters' streams the
//! communicator's stream waits on first, and each collective's call (or the layered allreduce,
//! NCCL inside each host and the host transports across).

use super::layered::{self, Cross};
use crate::backend::nccl::DeviceComm;
use crate::control::message::Response;
use crate::engine::{Entry, TensorBuf};
use crate::error::{Error, Result};
use crate::gpu::cuda::{DeviceBuf, Stream};
use crate::types::{DType, OpKind, ReduceOp, Reduction};

/// A fused allreduce's tensors, for the device fusion buffer: their (input, output) pairs and
/// the reduction they share.
pub(super) struct Fused {
    pub(super) parts: Vec<(DeviceBuf, DeviceBuf)>,
    pub(super) dtype: DType,
    pub(super) op: ReduceOp,
    pub(super) prescale: f64,
    pub(super) postscale: f64,
}

/// `Some` when `resp` is an allreduce of two or more non-empty tensors that share one dtype,
/// op and scaling (what fusion puts together; anything else keeps one call per tensor), over
/// several ranks: on one rank NCCL moves nothing, so the copies would be all the work (a
/// 64-tensor group took 1.3 ms per call, fused 1.7 ms, on an H100).
pub(super) fn fusable(
    resp: &Response,
    members: &[usize],
    entries: &[Option<Entry>],
) -> Result<Option<Fused>> {
    if resp.kind != OpKind::Allreduce || members.len() < 2 {
        return Ok(None);
    }
    Ok(same_reduction(entries)?.filter(|f| f.parts.len() > 1))
}

/// The non-empty tensors of an allreduce response when they share one dtype, op and scaling.
pub(super) fn same_reduction(entries: &[Option<Entry>]) -> Result<Option<Fused>> {
    let mut fused: Option<Fused> = None;
    for e in entries.iter().flatten() {
        let req = &e.request;
        for t in &e.spec.tensors {
            if t.meta.numel() == 0 {
                continue;
            }
            let output = t.output.as_ref().map(device_buf).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "allreduce of CUDA tensor '{}' needs its output allocated by the caller",
                    req.name
                ))
            })?;
            let f = fused.get_or_insert_with(|| Fused {
                parts: Vec::new(),
                dtype: t.meta.dtype,
                op: req.op,
                prescale: req.prescale,
                postscale: req.postscale,
            });
            if f.dtype != t.meta.dtype
                || f.op != req.op
                || f.prescale != req.prescale
                || f.postscale != req.postscale
            {
                return Ok(None);
            }
            f.parts.push((device_buf(&t.input), output));
        }
    }
    Ok(fused)
}

/// Orders `comm`'s stream after each stream the submitters of `entries` named (recorded
/// now: the work they enqueued before the op), and returns it.
pub(super) fn after_submitters(comm: &mut DeviceComm, entries: &[Option<Entry>]) -> Result<Stream> {
    let stream = comm.stream()?;
    let mut waited: Vec<Stream> = Vec::new();
    for e in entries.iter().flatten() {
        for t in &e.spec.tensors {
            let (_, user) = t.input.device_parts().expect("checked by device_of");
            if !waited.contains(&user) {
                let ready = comm.record(user)?;
                comm.stream_wait(stream, &ready)?;
                waited.push(user);
            }
        }
    }
    Ok(stream)
}

/// A layered set's allreduce ([`layered`]) on its host communicator's stream; returns once
/// the results are in the callers' memory.
pub(super) fn layered_allreduce(
    local: &mut layered::Local,
    f: &Fused,
    members: &[usize],
    entries: &[Option<Entry>],
    cross: Cross<'_>,
) -> Result<()> {
    let stream = after_submitters(&mut local.comm, entries)?;
    // The host collectives' reduction (the cross-host step scales): the 1/n in the factor.
    let red = Reduction::over(f.dtype, f.op, f.postscale, members.len());
    let red = red.scaled(f.prescale * red.factor);
    local.allreduce(&f.parts, red, members, stream, cross)?;
    let done = local.comm.record(stream)?;
    local.comm.wait(&done)
}

/// Enqueues one call per tensor of the response on `stream` (inside the caller's group);
/// `me` is this rank's position in `members`.
pub(super) fn enqueue(
    comm: &mut DeviceComm,
    members: &[usize],
    me: usize,
    resp: &Response,
    entries: &[Option<Entry>],
    stream: Stream,
) -> Result<()> {
    let kind = resp.kind;
    for (item, e) in resp.items.iter().zip(entries) {
        let Some(e) = e else { continue };
        let req = &e.request;
        for (i, t) in e.spec.tensors.iter().enumerate() {
            let count = t.meta.numel();
            let input = device_buf(&t.input);
            let output = t.output.as_ref().map(device_buf).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "{} of CUDA tensor '{}' needs its output allocated by the caller",
                    kind.name(),
                    req.name
                ))
            })?;
            let dtype = t.meta.dtype;
            let row_elems = t.meta.row_elems();
            match kind {
                // Ranks contribute different numbers of rows: each decides from the
                // negotiated counts, the same everywhere.
                OpKind::Allgather => {
                    let dims = item.first_dims.get(i).ok_or_else(|| {
                        Error::Io(format!(
                            "internal error: no first dimensions for tensor {i} of '{}'",
                            req.name
                        ))
                    })?;
                    gather(comm, &input, &output, dims, row_elems, dtype, stream)?
                }
                OpKind::Alltoall => {
                    let n = members.len();
                    let m = &item.split_matrix;
                    if m.len() != n * n {
                        return Err(Error::Io(format!(
                            "internal error: a {}-entry split matrix for {n} ranks",
                            m.len()
                        )));
                    }
                    let send: Vec<usize> = (0..n).map(|j| m[me * n + j] * row_elems).collect();
                    let recv: Vec<usize> = (0..n).map(|j| m[j * n + me] * row_elems).collect();
                    comm.alltoall(&input, &send, &output, &recv, dtype, stream)?
                }
                // Every member has the same shape (validated), so every member skips it.
                _ if count == 0 => {}
                OpKind::Allreduce => {
                    let red = Reduction::new(dtype, req.op).scaled(req.postscale);
                    comm.allreduce(&input, &output, count, red, req.prescale, stream)?
                }
                OpKind::Broadcast => {
                    let root = members.binary_search(&req.root).map_err(|_| {
                        Error::InvalidArgument(format!("root {} is not in the set", req.root))
                    })?;
                    comm.broadcast(&input, &output, count, dtype, root, stream)?
                }
                OpKind::Reducescatter => {
                    let red = Reduction::new(dtype, req.op).scaled(req.postscale);
                    let rows = count / members.len();
                    comm.reducescatter(&input, &output, rows, red, req.prescale, stream)?
                }
                other => {
                    return Err(Error::InvalidArgument(format!(
                        "{} is not run on the NCCL path",
                        other.name()
                    )))
                }
            }
        }
    }
    Ok(())
}

/// Every rank's rows (`dims[r]` of `row_elems` elements) into `output`, in rank order: one
/// `ncclAllGather` when every rank has as many rows, else one broadcast per rank that has
/// any (in the caller's group, so they run together).
fn gather(
    comm: &mut DeviceComm,
    input: &DeviceBuf,
    output: &DeviceBuf,
    dims: &[usize],
    row_elems: usize,
    dtype: crate::types::DType,
    stream: Stream,
) -> Result<()> {
    let row_bytes = row_elems * dtype.size();
    let total: usize = dims.iter().sum::<usize>() * row_bytes;
    if output.len() != total {
        return Err(Error::InvalidArgument(format!(
            "the allgather's output holds {} bytes, the {} ranks' rows {total}",
            output.len(),
            dims.len()
        )));
    }
    if total == 0 {
        return Ok(());
    }
    if dims.iter().all(|&d| d == dims[0]) {
        return comm.allgather(input, output, dims[0] * row_elems, dtype, stream);
    }
    let mut at = 0;
    for (root, &rows) in dims.iter().enumerate() {
        let bytes = rows * row_bytes;
        if bytes > 0 {
            let place = output.slice(at, bytes)?;
            comm.broadcast(input, &place, rows * row_elems, dtype, root, stream)?;
        }
        at += bytes;
    }
    Ok(())
}

/// The backend's view of a device buffer (host buffers never get here: see `device_of`).
pub(super) fn device_buf(t: &TensorBuf) -> DeviceBuf {
    t.device_parts()
        .expect("device_of checked that every buffer is device memory")
        .0
}

/// The one CUDA device every tensor (input and output) of the response is on.
pub(super) fn device_of(entries: &[Option<Entry>]) -> Result<u32> {
    let mut device = None;
    for e in entries {
        let e = e.as_ref().ok_or_else(|| {
            Error::Io("internal error: a CUDA response without this rank's tensor".into())
        })?;
        for t in &e.spec.tensors {
            for buf in std::iter::once(&t.input).chain(t.output.as_ref()) {
                let Some((d, _)) = buf.cuda() else {
                    return Err(Error::Io(format!(
                        "internal error: tensor '{}' of a CUDA response is in host memory",
                        e.request.name
                    )));
                };
                match device {
                    None => device = Some(d),
                    Some(prev) if prev != d => {
                        return Err(Error::InvalidArgument(format!(
                            "CUDA tensors of one response are on devices {prev} and {d}: use \
                             one GPU per process"
                        )))
                    }
                    Some(_) => {}
                }
            }
        }
    }
    device.ok_or_else(|| Error::Io("internal error: a CUDA response without tensors".into()))
}
