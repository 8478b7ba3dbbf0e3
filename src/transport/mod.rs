//! Point-to-point transports. A collective algorithm talks to peers only through
//! [`Transport::exchange`]; it never knows whether bytes travel over TCP or shared memory.
//!
//! - [`tcp::TcpTransport`]: the authenticated full mesh every job starts with;
//! - [`hybrid::HybridTransport`]: that mesh with the peers on this host moved to
//!   shared-memory links ([`shm`]), chosen per peer, progressed together;
//! - [`host_memory`]: not a link but memory of each rank that the other ranks of its host map,
//!   for algorithms that read their peers' buffers where they lie.
//!
//! Peers are identified by **global** rank here; [`crate::comm::Communicator`] maps process-set
//! ranks onto them.

pub mod host_memory;
pub mod hybrid;
pub mod shm;
mod sys;
pub mod tcp;

use crate::spin::Spin;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

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

/// What an exchange loop does after one pass over its transfers (see [`Pacer`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pace {
    /// Make another pass at once.
    Again,
    /// Block (in poll) for at most this long.
    Block(Duration),
    /// Nothing moved for the whole idle timeout.
    TimedOut,
}

/// The waiting rhythm every transport's `exchange` shares: after a pass that moved bytes, go
/// again; otherwise spin (yielding) for `spin`, then block until the idle timeout runs out.
pub(crate) struct Pacer {
    spin: Duration,
    idle_timeout: Duration,
    last_progress: Instant,
    /// The spin after the last pass that moved bytes; `None` until a pass moves none.
    spinning: Option<Spin>,
}

impl Pacer {
    pub(crate) fn new(spin: Duration, idle_timeout: Duration) -> Pacer {
        Pacer {
            spin,
            idle_timeout,
            last_progress: Instant::now(),
            spinning: None,
        }
    }

    /// Decides the next step after a pass; `moved` says whether it moved any byte.
    pub(crate) fn after_pass(&mut self, moved: bool) -> Pace {
        let now = Instant::now();
        if moved {
            self.last_progress = now;
            self.spinning = None;
            return Pace::Again;
        }
        match &mut self.spinning {
            None => {
                self.spinning = Some(Spin::new(self.spin));
                return Pace::Again;
            }
            // Yield rather than pause: when ranks outnumber free cores the peer we wait for
            // may be queued on this very core (measured: 4-byte round trip 15 µs with yield,
            // 80-105 µs with a pure spin, on a loaded 2-core VM).
            Some(spin) => {
                if spin.yield_core() {
                    return Pace::Again;
                }
            }
        }
        // Spun long enough, the core is wanted, or we just woke from poll with nothing to do:
        // block.
        let left = self.idle_timeout.saturating_sub(now - self.last_progress);
        if left.is_zero() {
            Pace::TimedOut
        } else {
            Pace::Block(left)
        }
    }
}

/// The error of an exchange whose `active` transfers (index into `xfers`, bytes done) made no
/// progress for `idle`: names every peer waited for and how far each transfer got.
pub(crate) fn stalled_error(
    xfers: &[Xfer<'_>],
    active: &[(usize, usize)],
    idle: Duration,
) -> Error {
    let waits: Vec<String> = active
        .iter()
        .map(|&(i, off)| match &xfers[i] {
            Xfer::Send { peer, buf } => format!("rank {peer} (sent {off} of {} bytes)", buf.len()),
            Xfer::Recv { peer, buf } => {
                format!("rank {peer} (received {off} of {} bytes)", buf.len())
            }
        })
        .collect();
    Error::Timeout {
        what: format!("waiting for {}", waits.join(", ")),
        after: idle,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pacer_spins_then_blocks_then_times_out() {
        let mut p = Pacer::new(Duration::ZERO, Duration::from_millis(50));
        assert_eq!(p.after_pass(true), Pace::Again);
        // The first idle pass starts the (empty) spin; the next one blocks for what is left.
        assert_eq!(p.after_pass(false), Pace::Again);
        match p.after_pass(false) {
            Pace::Block(left) => assert!(left <= Duration::from_millis(50) && !left.is_zero()),
            other => panic!("expected Block, got {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(p.after_pass(false), Pace::TimedOut);
        // Progress resets the idle clock.
        assert_eq!(p.after_pass(true), Pace::Again);
        assert_eq!(p.after_pass(false), Pace::Again);
        assert!(matches!(p.after_pass(false), Pace::Block(_)));
    }

    #[test]
    fn a_stall_names_each_peer_and_how_far_it_got() {
        let data = [0u8; 8];
        let mut into = [0u8; 4];
        let xfers = [
            Xfer::Send {
                peer: 1,
                buf: &data,
            },
            Xfer::Recv {
                peer: 2,
                buf: &mut into,
            },
        ];
        let e = stalled_error(&xfers, &[(0, 3), (1, 0)], Duration::from_secs(2)).to_string();
        assert!(e.contains("rank 1 (sent 3 of 8 bytes)"), "{e}");
        assert!(e.contains("rank 2 (received 0 of 4 bytes)"), "{e}");
    }
}
