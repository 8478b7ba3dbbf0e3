//! The fused allreduce: a response's tensors of one dtype packed into the fusion buffer in
//! chunks, pre-scaled, reduced once per chunk and unpacked, large ones reduced where they
//! lie. Allreduce is the one collective whose responses carry many entries, and the buffer,
//! its sizes and the split between fused and solo tensors concern it alone.

use crate::collective::{self, reduce};
use crate::comm::Communicator;
use crate::error::Result;
use crate::sys::copy::copy;
use crate::types::{DType, ReduceOp, Reduction};

use crate::control::message::Item;
use crate::engine::entry::Entry;
use crate::engine::tensor::TensorBuf;
use crate::engine::TensorSpec;

use super::Trace;

/// Fused allreduce: tensors of one dtype are packed into the fusion buffer (a single tensor is
/// reduced in place in its output), pre-scaled, reduced once, post-scaled and unpacked.
pub(super) fn allreduce(
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
