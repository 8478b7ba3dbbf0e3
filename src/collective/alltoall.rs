//! All-to-all with variable counts: direct exchange for small payloads, pairwise exchange for
//! large ones.

use super::{blocks, split_blocks};
use crate::comm::Communicator;
use crate::error::Result;
use crate::sys::copy::copy;
use crate::transport::Xfer;

/// Sends block `r` of `input` (`send_counts[r]` bytes, blocks in rank order) to rank `r` and
/// receives rank `r`'s block for this rank into block `r` of `output` (`recv_counts`). Counts
/// may be zero; this rank's own block is copied locally.
///
/// When both `input` and `output` are at most `comm.tuning.small_allreduce_bytes`: one exchange
/// with every peer at once (one round trip). Otherwise pairwise exchange: for `s` in `1..n`,
/// rank `r` sends to `r+s` while receiving from `r-s` (mod `n`), so each step pairs every rank
/// with exactly one sender and one receiver. Bytes sent per rank: the sum of its blocks for
/// other ranks.
pub fn alltoallv(
    comm: &mut Communicator<'_>,
    input: &[u8],
    send_counts: &[usize],
    output: &mut [u8],
    recv_counts: &[usize],
) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let sends = blocks(send_counts, n, input.len(), "alltoallv send counts")?;
    let recvs = blocks(recv_counts, n, output.len(), "alltoallv receive counts")?;
    if sends[r].len() != recvs[r].len() {
        return Err(crate::error::Error::InvalidArgument(format!(
            "alltoallv: this rank sends itself {} bytes but expects {}",
            sends[r].len(),
            recvs[r].len()
        )));
    }
    // Each rank decides from its own counts, so ranks may take different paths. That is safe:
    // either way a rank sends each peer exactly its block and receives exactly theirs, once,
    // so the byte streams match; a direct rank has all its transfers in flight at once and so
    // never holds up a pairwise peer, and pairwise ranks are in lockstep with each other.
    let small = comm.tuning.small_allreduce_bytes;
    let direct = input.len() <= small && output.len() <= small;
    let mut slots = split_blocks(output, &recvs);
    copy(slots[r], &input[sends[r].clone()]);
    if direct {
        let mut xfers = Vec::with_capacity(2 * n);
        for (p, slot) in slots.into_iter().enumerate() {
            if p != r {
                xfers.push(Xfer::Send {
                    peer: p,
                    buf: &input[sends[p].clone()],
                });
                xfers.push(Xfer::Recv { peer: p, buf: slot });
            }
        }
        return comm.exchange(&mut xfers);
    }
    for s in 1..n {
        let (to, from) = ((r + s) % n, (r + n - s) % n);
        comm.sendrecv(to, &input[sends[to].clone()], from, slots[from])?;
    }
    Ok(())
}
