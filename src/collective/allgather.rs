//! Allgather with variable block sizes: direct exchange for small totals, ring for large ones.
//! The ring pass is also the second half of the large allreduce.

use std::ops::Range;

use super::{blocks, check_segments, split_blocks, split_pair};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::transport::Xfer;

/// Gathers every rank's `input` into `output` in rank order; `byte_counts[r]` is rank r's block
/// length (zeros allowed).
///
/// Totals up to `comm.tuning.small_allreduce_bytes`: one exchange in which every rank sends its
/// block to every other rank and receives theirs straight into `output` (one round trip; bytes
/// sent per rank: `(n-1)·B_rank`). Larger totals: [`ring_allgather`], `n-1` steps, bytes sent per
/// rank: every block but the one it receives last.
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
    output[segs[r].clone()].copy_from_slice(input);
    if n == 1 {
        return Ok(());
    }
    if output.len() <= comm.tuning.small_allreduce_bytes {
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
