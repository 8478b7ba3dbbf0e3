//! `Communicator`: a process set's view of the job's transport. Algorithms address peers by
//! their rank *within the set*; the communicator maps them to global ranks.

use std::time::Duration;

use crate::error::Result;
use crate::transport::{Transport, Xfer};

/// When allreduce goes hierarchical (reduce inside each host, then across hosts; see
/// [`crate::collective::hierarchical`]). Only a set that spans more than one host, with more
/// than one member on some host, can: any other set keeps the flat algorithms whatever this
/// says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Hierarchical {
    /// Payloads above [`Tuning::small_allreduce_bytes`] (what crosses hosts is then large
    /// enough for the bytes saved on the slow links to outweigh the extra steps).
    #[default]
    Auto,
    /// Every payload, small ones included.
    Always,
    /// Never: flat algorithms only.
    Never,
}

/// Algorithm thresholds. Chosen by measurement; overridable through `config`.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Allreduce payloads up to this many bytes use the latency-optimal algorithm.
    pub small_allreduce_bytes: usize,
    /// Large transfers are cut into chunks of this many bytes so reduction overlaps transfer.
    pub chunk_bytes: usize,
    /// When allreduce goes hierarchical across hosts.
    pub hierarchical: Hierarchical,
}

impl Tuning {
    /// The settings every rank must share, as the variables that set them: ranks that cut a
    /// ring into different chunks, or pick different algorithms, would wait for transfers
    /// that never come or mix up each other's bytes. Compared across ranks at start-up.
    pub fn shared_settings(&self) -> String {
        format!(
            "FERROVOD_SMALL_ALLREDUCE_BYTES={} FERROVOD_CHUNK_BYTES={} \
             FERROVOD_HIERARCHICAL_ALLREDUCE={}",
            self.small_allreduce_bytes,
            self.chunk_bytes,
            match self.hierarchical {
                Hierarchical::Auto => "auto",
                Hierarchical::Always => "1",
                Hierarchical::Never => "0",
            }
        )
    }
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            small_allreduce_bytes: 64 * 1024,
            chunk_bytes: 1 << 20,
            hierarchical: Hierarchical::Auto,
        }
    }
}

/// The ranks of one process set, bound to the transport for the duration of a collective.
pub struct Communicator<'a> {
    transport: &'a mut dyn Transport,
    members: &'a [usize],
    rank: usize,
    /// Host index of every *global* rank (empty: unknown, as if each set were on one host).
    hosts: &'a [u32],
    /// How long a transfer may make no progress before it fails.
    pub idle_timeout: Duration,
    /// Algorithm thresholds.
    pub tuning: Tuning,
}

impl<'a> Communicator<'a> {
    /// A communicator over `members` (global ranks, which must include this process; set rank
    /// `i` is `members[i]`). It knows no hosts: see [`Communicator::with_hosts`].
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
            hosts: &[],
            idle_timeout,
            tuning,
        }
    }

    /// Tells the communicator which host each rank is on: `hosts[g]` is the host index of
    /// global rank `g` (any numbering, the same on every rank of the job). Hierarchical
    /// algorithms use it; a slice that does not cover every member is ignored.
    pub fn with_hosts(mut self, hosts: &'a [u32]) -> Self {
        self.hosts = if self.members.iter().all(|&g| g < hosts.len()) {
            hosts
        } else {
            &[]
        };
        self
    }

    /// Host index of set rank `r`, when hosts are known.
    pub fn host_of(&self, r: usize) -> Option<u32> {
        self.hosts.get(self.members[r]).copied()
    }

    /// A communicator over a subgroup of this one, for the duration of a borrow: `set_ranks`
    /// are ranks of *this* set (they must include this rank; the subgroup's rank `i` is
    /// `set_ranks[i]`), `scratch` receives their global ranks. Same transport, timeout,
    /// tuning and hosts.
    pub fn subgroup<'b>(
        &'b mut self,
        set_ranks: &[usize],
        scratch: &'b mut Vec<usize>,
    ) -> Communicator<'b> {
        scratch.clear();
        scratch.extend(set_ranks.iter().map(|&r| self.members[r]));
        let me = self.members[self.rank];
        let rank = scratch
            .iter()
            .position(|&g| g == me)
            .expect("subgroup built without this rank");
        Communicator {
            transport: &mut *self.transport,
            members: scratch,
            rank,
            hosts: self.hosts,
            idle_timeout: self.idle_timeout,
            tuning: self.tuning.clone(),
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
