//! `Communicator`: a process set's view of the job's transport. Algorithms address peers by
//! their rank *within the set*; the communicator maps them to global ranks.

use std::time::Duration;

use crate::error::Result;
use crate::transport::{Transport, Xfer};

/// Algorithm thresholds. Chosen by measurement; overridable through `config`.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Allreduce payloads up to this many bytes use the latency-optimal algorithm.
    pub small_allreduce_bytes: usize,
    /// Large transfers are cut into chunks of this many bytes so reduction overlaps transfer.
    pub chunk_bytes: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            small_allreduce_bytes: 64 * 1024,
            chunk_bytes: 1 << 20,
        }
    }
}

/// The ranks of one process set, bound to the transport for the duration of a collective.
pub struct Communicator<'a> {
    transport: &'a mut dyn Transport,
    members: &'a [usize],
    rank: usize,
    /// How long a transfer may make no progress before it fails.
    pub idle_timeout: Duration,
    /// Algorithm thresholds.
    pub tuning: Tuning,
}

impl<'a> Communicator<'a> {
    /// A communicator over `members` (sorted global ranks, which must include this process).
    pub fn new(
        transport: &'a mut dyn Transport,
        members: &'a [usize],
        idle_timeout: Duration,
        tuning: Tuning,
    ) -> Self {
        let me = transport.rank();
        let rank = members
            .iter()
            .position(|&r| r == me)
            .expect("communicator built for a set that does not contain this rank");
        Communicator {
            transport,
            members,
            rank,
            idle_timeout,
            tuning,
        }
    }

    /// This process's rank within the set.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the set.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// Global rank of set rank `r`.
    pub fn global_rank(&self, r: usize) -> usize {
        self.members[r]
    }

    /// Runs transfers whose `peer` fields are set ranks.
    pub fn exchange(&mut self, xfers: &mut [Xfer<'_>]) -> Result<()> {
        for x in xfers.iter_mut() {
            let p = x.peer_mut();
            *p = self.members[*p];
        }
        self.transport.exchange(xfers, self.idle_timeout)
    }

    /// Sends `buf` to set rank `peer`.
    pub fn send(&mut self, peer: usize, buf: &[u8]) -> Result<()> {
        self.exchange(&mut [Xfer::Send { peer, buf }])
    }

    /// Receives `buf.len()` bytes from set rank `peer`.
    pub fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<()> {
        self.exchange(&mut [Xfer::Recv { peer, buf }])
    }

    /// Sends to one peer while receiving from another (or the same), concurrently.
    pub fn sendrecv(&mut self, to: usize, send: &[u8], from: usize, recv: &mut [u8]) -> Result<()> {
        self.exchange(&mut [
            Xfer::Send {
                peer: to,
                buf: send,
            },
            Xfer::Recv {
                peer: from,
                buf: recv,
            },
        ])
    }
}
