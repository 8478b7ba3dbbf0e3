//! Barrier: the dissemination algorithm.

use crate::comm::Communicator;
use crate::error::Result;

/// Returns once every rank of the set has entered.
///
/// Dissemination: in round `k` (`2^k < n`), rank `r` sends a one-byte token to `r + 2^k` while
/// receiving one from `r - 2^k` (mod `n`). After `ceil(log2 n)` rounds every rank has heard,
/// directly or through others, from every rank that entered. Bytes sent per rank:
/// `ceil(log2 n)`. Tokens carry no data (transports do not move empty buffers, hence one byte).
pub fn barrier(comm: &mut Communicator<'_>) -> Result<()> {
    let (n, r) = (comm.size(), comm.rank());
    let mut dist = 1;
    while dist < n {
        let mut token = [0u8; 1];
        comm.sendrecv((r + dist) % n, &[1], (r + n - dist) % n, &mut token)?;
        dist <<= 1;
    }
    Ok(())
}
