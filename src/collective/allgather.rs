//! Allgather with variable block sizes: direct exchange for small totals, ring for large ones.
//! The ring pass is also the second half of the large allreduce.

use std::ops::Range;

use super::{blocks, check_segments, chunk_count, chunk_of, split_blocks, split_pair};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::sys::copy::copy;
use crate::transport::Xfer;

/// Gathers every rank's `input` into `output` in rank order; `byte_counts[r]` is rank r's block
/// length (zeros allowed).
///
/// Totals up to `comm.tuning.small_allreduce_bytes`: one exchange in which every rank sends its
/// block to every other rank and receives theirs straight into `output` (one round trip; bytes
/// sent per rank: `(n-1)·B_rank`). Larger totals: [`ring_allgather`], `n-1` steps, bytes sent per
/// rank: every block but the one it receives last; with large blocks its first step also puts
/// this rank's block in place (see [`FOLD_OWN_COPY_CHUNKS`]).
pub fn allgatherv(
    comm: &mut Communicator<'_>,
    input: &[u8],
    output: &mut [u8],
    byte_counts: &[usize],
) -> Result<()> {
    let n = comm.size();
    let r = comm.rank();
    let segs = blocks(byte_counts, n, output.len(), "allgatherv")?;
    if input.len() != segs[r].len() {
        return Err(Error::InvalidArgument(format!(
            "allgatherv: input holds {} bytes but its count says {}",
            input.len(),
            segs[r].len()
        )));
    }
    let small = output.len() <= comm.tuning.small_allreduce_bytes;
    // Every rank takes the same path: the longest block is the same everywhere.
    let fold_min = FOLD_OWN_COPY_CHUNKS * comm.tuning.chunk_bytes.max(1);
    let fold = !small && n > 1 && segs.iter().any(|s| s.len() >= fold_min);
    if !fold {
        copy(&mut output[segs[r].clone()], input);
    }
    if n == 1 {
        return Ok(());
    }
    if fold {
        first_step_with_own_copy(comm, input, output, &segs)?;
        return ring_allgather_from(comm, output, &segs, 1);
    }
    if small {
        let slots = split_blocks(output, &segs);
        let mut xfers = Vec::with_capacity(2 * (n - 1));
        for (p, slot) in slots.into_iter().enumerate() {
            if p != r {
                xfers.push(Xfer::Send {
                    peer: p,
                    buf: input,
                });
                xfers.push(Xfer::Recv { peer: p, buf: slot });
            }
        }
        comm.exchange(&mut xfers)
    } else {
        ring_allgather(comm, output, &segs)
    }
}

/// [`allgatherv`] in place: on entry `buf`'s block of this rank (blocks in rank order,
/// `byte_counts[r]` bytes each) holds its contribution; on return every block is filled. The
/// same paths by size as [`allgatherv`] minus the copy of the rank's own block, which is
/// already where it belongs: a sharded optimizer gathers its updated parameters this way
/// straight into the flat buffer the model's parameters view.
pub fn allgatherv_in_place(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    byte_counts: &[usize],
) -> Result<()> {
    let n = comm.size();
    let r = comm.rank();
    let segs = blocks(byte_counts, n, buf.len(), "allgatherv")?;
    if n == 1 {
        return Ok(());
    }
    if buf.len() > comm.tuning.small_allreduce_bytes {
        return ring_allgather(comm, buf, &segs);
    }
    let mut slots = split_blocks(buf, &segs);
    let own: &[u8] = std::mem::take::<&mut [u8]>(&mut slots[r]);
    let mut xfers = Vec::with_capacity(2 * (n - 1));
    for (p, slot) in slots.into_iter().enumerate() {
        if p != r {
            xfers.push(Xfer::Send { peer: p, buf: own });
            xfers.push(Xfer::Recv { peer: p, buf: slot });
        }
    }
    comm.exchange(&mut xfers)
}

/// From a longest block of this many chunks (`comm.tuning.chunk_bytes`, 1 MiB by default) up,
/// the ring's first step copies this rank's own block into place chunk by chunk as it sends it
/// ([`first_step_with_own_copy`]). Smaller blocks are still in cache when the ring reads them,
/// and one exchange per step moved them faster (2 ranks: 0.75-0.98x at 2-4 MiB per rank
/// folded, 1.06-1.16x from 8 MiB up).
const FOLD_OWN_COPY_CHUNKS: usize = 8;

/// The first step of [`ring_allgather`] with the copy of this rank's own block into place
/// folded in, chunk by chunk: each chunk of `input` goes to the next rank and then into
/// `output` while it is still in cache, and the matching chunk of the previous rank's block
/// comes in. Copying the whole block first read `input` from memory twice. Every rank runs the
/// same number of exchanges (set by the longest block).
fn first_step_with_own_copy(
    comm: &mut Communicator<'_>,
    input: &[u8],
    output: &mut [u8],
    segs: &[Range<usize>],
) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let chunk = comm.tuning.chunk_bytes.max(1);
    let own = segs[r].start;
    for c in 0..chunk_count(segs, chunk) {
        let sc = chunk_of(&(0..input.len()), c, chunk);
        let rc = chunk_of(&segs[prev], c, chunk);
        comm.sendrecv(next, &input[sc.clone()], prev, &mut output[rc])?;
        copy(&mut output[own + sc.start..own + sc.end], &input[sc]);
    }
    Ok(())
}

/// Ring allgather in place: on entry `buf[segs[rank]]` holds this rank's block; on return every
/// block is filled. `segs` has one range per rank, ascending and disjoint (else
/// `InvalidArgument`).
///
/// Steps: for `s` in `0..n-1`, rank `r` sends block `r-s` to `r+1` while receiving block
/// `r-s-1` from `r-1` (mod `n`) directly into place. No chunking: nothing is computed between
/// transfers, and the transport streams each block as it goes.
pub fn ring_allgather(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    segs: &[Range<usize>],
) -> Result<()> {
    ring_allgather_from(comm, buf, segs, 0)
}

/// The steps of [`ring_allgather`] from step `first` on: the earlier ones are done (after
/// [`super::reducescatter::ring_reduce_scatter_and_share`], `first` is 1).
pub fn ring_allgather_from(
    comm: &mut Communicator<'_>,
    buf: &mut [u8],
    segs: &[Range<usize>],
    first: usize,
) -> Result<()> {
    let n = comm.size();
    check_segments(segs, n, buf.len(), 1)?;
    if n == 1 {
        return Ok(());
    }
    let r = comm.rank();
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for s in first..n - 1 {
        let send_seg = segs[(r + n - s) % n].clone();
        let recv_seg = segs[(r + 2 * n - s - 1) % n].clone();
        let (sb, rb) = split_pair(buf, send_seg, recv_seg);
        comm.sendrecv(next, sb, prev, rb)?;
    }
    Ok(())
}
