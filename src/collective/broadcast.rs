//! Broadcast: a binomial tree rooted at any rank, pipelined in chunks.

use super::{check_rank, chunk_of};
use crate::comm::Communicator;
use crate::error::Result;
use crate::transport::Xfer;

/// Copies `root`'s `buf` into every rank's `buf`.
///
/// Ranks are renumbered relative to the root (`v = (rank - root) mod n`). Rank `v ≠ 0` receives
/// from `v - lowbit(v)` and forwards to `v + m` for each power of two `m < lowbit(v)`; the root
/// forwards to every `m < n`. So the data reaches everyone in `ceil(log2 n)` hops. Inner ranks
/// pipeline: buffers are cut into `comm.tuning.chunk_bytes` chunks and one exchange receives
/// chunk `c` from the parent while sending chunk `c-1` to all children, so a large buffer does
/// not wait at each level. Bytes: every non-root receives `B` once; each rank sends `B` per child
/// (the root `ceil(log2 n)·B`).
pub fn broadcast(comm: &mut Communicator<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let n = comm.size();
    check_rank(root, n, "broadcast root")?;
    if n == 1 || buf.is_empty() {
        return Ok(());
    }
    let v = (comm.rank() + n - root) % n;
    let real = |x: usize| (x + root) % n;
    let lowbit = if v == 0 {
        n.next_power_of_two()
    } else {
        v & v.wrapping_neg()
    };
    let children: Vec<usize> = std::iter::successors(Some(lowbit >> 1), |m| Some(m >> 1))
        .take_while(|&m| m > 0)
        .filter(|&m| v + m < n)
        .map(|m| real(v + m))
        .collect();
    if v == 0 {
        let mut xfers: Vec<Xfer<'_>> = children
            .iter()
            .map(|&peer| Xfer::Send { peer, buf: &*buf })
            .collect();
        return comm.exchange(&mut xfers);
    }
    let parent = real(v - lowbit);
    if children.is_empty() {
        return comm.recv(parent, buf);
    }
    let len = buf.len();
    let chunk = comm.tuning.chunk_bytes.max(1);
    let nchunks = len.div_ceil(chunk);
    for c in 0..=nchunks {
        let here = chunk_of(&(0..len), c, chunk);
        let (done, rest) = buf.split_at_mut(here.start);
        let mut xfers = Vec::with_capacity(children.len() + 1);
        if c < nchunks {
            xfers.push(Xfer::Recv {
                peer: parent,
                buf: &mut rest[..here.len()],
            });
        }
        if c > 0 {
            let prev = &done[chunk_of(&(0..len), c - 1, chunk)];
            xfers.extend(children.iter().map(|&peer| Xfer::Send { peer, buf: prev }));
        }
        comm.exchange(&mut xfers)?;
    }
    Ok(())
}
