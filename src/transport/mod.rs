//! Point-to-point transports. A collective algorithm talks to peers only through
//! [`Transport::exchange`]; it never knows whether bytes travel over TCP or shared memory.
//!
//! - [`tcp::TcpTransport`]: authenticated TCP links, to the ranks on this host from the start,
//!   to the others on first use ([`dial`]);
//! - [`hybrid::HybridTransport`]: those links with the peers on this host moved to
//!   shared-memory links ([`shm`]), chosen per peer, progressed together;
//! - [`host_memory`]: not a link but memory of each rank that the other ranks of its host map,
//!   for algorithms that read their peers' buffers where they lie; [`offers`] lays the fast
//!   path's records out in such segments.
//! - [`fast_links`]: the fast path's connections across hosts, one per direction and pair,
//!   beside the data links.
//!
//! Algorithms over links see a [`Transport`]; algorithms over peers' memory ([`host_memory`]'s
//! segments, the fast path's offers among them) see a [`PeersMemory`].
//!
//! Both transports run `exchange` through one loop (the private `exchange` module); each
//! brings only how to move bytes on one of its links and how to sleep on several.
//!
//! Peers are identified by **global** rank here; [`crate::comm::Communicator`] maps process-set
//! ranks onto them.

mod dial;
mod exchange;
pub mod fast_links;
pub mod host_memory;
pub mod hybrid;
pub mod messenger;
pub mod offers;
pub mod shm;
pub mod tcp;

use std::ops::Range;
use std::time::Duration;

use crate::error::Result;

/// Every rank's input to one collective, read where it lies (a peer's in memory this rank
/// maps), ranks numbered as the collective numbers them.
///
/// Contract (every implementation): the bytes handed out do not change while the borrow lives
/// (the caller's protocol keeps their owner from writing them); `bytes` panics on a range
/// outside rank `r`'s input, and on this rank's input when the collective writes its result
/// into that input (an in-place view lends only the others').
pub trait PeersMemory {
    /// The number of ranks.
    fn size(&self) -> usize;
    /// Bytes `range` of rank `r`'s input.
    fn bytes(&self, r: usize, range: Range<usize>) -> &[u8];
}

/// Where rank `r` sits in a list of every rank but `rank`, in rank order (how the
/// implementations of [`PeersMemory`] keep their peers).
pub(crate) fn index_among_others(rank: usize, r: usize) -> usize {
    debug_assert_ne!(r, rank, "rank {rank} is not among its others");
    if r < rank {
        r
    } else {
        r - 1
    }
}

/// One side of a transfer inside an [`Transport::exchange`] call.
#[derive(Debug)]
pub enum Xfer<'a> {
    /// Send all of `buf` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Bytes to send.
        buf: &'a [u8],
    },
    /// Receive exactly `buf.len()` bytes from `peer`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Where the bytes go.
        buf: &'a mut [u8],
    },
}

impl Xfer<'_> {
    /// The peer this transfer talks to.
    pub fn peer(&self) -> usize {
        match self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => *peer,
        }
    }

    /// Mutable access to the peer, so a communicator can translate set ranks to global ranks.
    pub fn peer_mut(&mut self) -> &mut usize {
        match self {
            Xfer::Send { peer, .. } | Xfer::Recv { peer, .. } => peer,
        }
    }
}

/// A set of links from this rank to every other rank of the job.
///
/// Contract (every implementation):
/// - bytes between a pair of ranks arrive in the order they were sent (messages are not framed:
///   the algorithms know every size in advance);
/// - `exchange` progresses all its transfers concurrently, so a ring step that sends to the next
///   rank while receiving from the previous one never deadlocks, whatever the sizes;
/// - at most one `Send` and one `Recv` per peer in a single `exchange`;
/// - `exchange` returns `Error::PeerLost{rank}` as soon as a link to `rank` is closed, and
///   `Error::Timeout` when no byte moved on any of its transfers for `idle_timeout`;
/// - transfers with an empty buffer complete immediately and touch no link.
pub trait Transport: Send {
    /// This process's global rank.
    fn rank(&self) -> usize;
    /// Number of ranks in the job.
    fn size(&self) -> usize;
    /// Runs all `xfers` to completion (or the first error).
    fn exchange(&mut self, xfers: &mut [Xfer<'_>], idle_timeout: Duration) -> Result<()>;
    /// Closes every link at once, so that peers blocked on this rank fail fast instead of
    /// waiting for a timeout. Used when the job is being torn down after a failure.
    fn abort(&mut self);
}
