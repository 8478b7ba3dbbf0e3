//! The routing transport: per peer either a shared-memory link ([`super::shm`]) or the TCP
//! connection of the mesh it was built from, behind one [`Transport`].
//!
//! Shape: [`HybridTransport::connect`] (what a job uses) makes every link on first use
//! ([`super::dial`]), and a link to a peer named in `local_peers` (the ranks on this host)
//! moves to shared memory over its new, authenticated TCP connection, which is then closed: a
//! rank holds a pair and a doorbell only for the peers its algorithms reach. Pairs where
//! shared memory turns out to be unavailable or declined keep TCP.
//!
//! Data path: one `exchange` progresses all its transfers together, whatever their links.
//! When nothing moves it retries (yielding the core) for [`HybridTransport::spin`], then
//! blocks in a single `poll` over the TCP sockets involved and the doorbells of the
//! shared-memory links involved, after announcing its sleep on those links (see
//! [`super::shm`] for why no wake-up is lost). A peer lost on either kind of link is
//! `Error::PeerLost` at once.

use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use super::dial::{Dialer, Finish, Made};
use super::exchange::{self, Links};
use super::shm::{ShmLink, DEFAULT_RING_BYTES, MAX_RING_BYTES, MIN_RING_BYTES};
use super::tcp::{link_up, poll_for, progress, Mesh, Parts, TcpTransport};
use super::{Transport, Xfer};
use crate::error::{Error, Result};
use crate::sys::{poll, poll_fd, PollFd, POLL_IN};

/// How [`HybridTransport::upgrade`] uses shared memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmOptions {
    /// Bytes of each direction's ring, per pair of local ranks (a pair maps two rings, and
    /// uses the smaller of the two ranks' values). Transfers of any size stream through it.
    pub ring_bytes: usize,
    /// Decline shared memory on this rank. The set-up handshakes still run with every local
    /// peer, so peers that did not decline simply keep TCP with this rank.
    pub disabled: bool,
}

impl Default for ShmOptions {
    fn default() -> Self {
        ShmOptions {
            ring_bytes: DEFAULT_RING_BYTES,
            disabled: false,
        }
    }
}

/// How this rank reaches one peer.
enum Link {
    /// This rank itself.
    Me,
    Tcp(TcpStream),
    Shm(Box<ShmLink>),
    /// Not linked yet: made over TCP on first use ([`super::dial`]).
    Later,
}

/// A full mesh where each peer is reached over shared memory or TCP.
pub struct HybridTransport {
    rank: usize,
    size: usize,
    links: Vec<Link>,
    /// Makes the links to peers not linked at start.
    dialer: Option<Dialer>,
    aborted: bool,
    /// How long `exchange` keeps retrying after the last byte moved before it blocks in
    /// `poll` (taken from the TCP mesh by [`HybridTransport::upgrade`]).
    pub spin: Duration,
}

impl std::fmt::Debug for HybridTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HybridTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("shm_peers", &self.shm_peers())
            .field("aborted", &self.aborted)
            .finish()
    }
}

impl HybridTransport {
    /// Links this rank with its peers on first use, as [`TcpTransport::connect`] does with
    /// no link made at start, and each link to a peer in `local_peers` moves to shared
    /// memory as it is made (kept on TCP when either side declines or cannot share memory).
    /// `local_peers` must be symmetric (every rank derives it from the same host table).
    ///
    /// Errors: those of [`TcpTransport::connect`], and `InvalidArgument` for a bad peer list
    /// or ring size.
    pub fn connect(
        mesh: &Mesh<'_>,
        local_peers: &[usize],
        options: &ShmOptions,
    ) -> Result<HybridTransport> {
        let (rank, size) = (mesh.rank, mesh.size);
        let ring = ring_option(rank, size, local_peers, options)?;
        let mut local = vec![false; size];
        for &p in local_peers {
            local[p] = true;
        }
        let finish: Finish = Arc::new(move |peer, stream, deadline| {
            if !local[peer] {
                return Ok(None);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            ShmLink::establish(stream, rank, peer, ring, deadline, left).map_err(|e| match e {
                Error::Io(m) => Error::PeerLost {
                    rank: peer,
                    detail: format!("while setting up shared memory: {m}"),
                },
                e => e,
            })
        });
        let tcp = TcpTransport::connect_with(mesh, &|_| false, Some(finish))?;
        HybridTransport::from_tcp(tcp)
    }

    /// Takes over `tcp`, whose links to the peers of this host were not made at start (so
    /// that each moves to shared memory as it is made).
    fn from_tcp(tcp: TcpTransport) -> Result<HybridTransport> {
        let Parts {
            rank,
            size,
            peers: streams,
            dialer,
            spin,
            aborted,
        } = tcp.into_parts();
        if aborted {
            return Err(Error::Shutdown("the TCP transport was aborted".into()));
        }
        let links = streams
            .into_iter()
            .enumerate()
            .map(|(r, s)| match s {
                Some(s) => Link::Tcp(s),
                None if r == rank => Link::Me,
                None => Link::Later,
            })
            .collect();
        Ok(HybridTransport {
            rank,
            size,
            links,
            dialer,
            aborted: false,
            spin,
        })
    }

    /// This rank's point-to-point messenger (`None` in a job of one rank), whose connections
    /// the mesh's listener takes (see [`super::messenger`]).
    pub fn messenger(&self) -> Option<super::messenger::Messenger> {
        self.dialer.as_ref().map(|d| d.messenger())
    }

    /// The connections of the fast path across hosts (`None` in a job of one rank).
    pub fn fast_links(&self) -> Option<super::fast_links::FastLinks> {
        self.dialer.as_ref().map(|d| d.fast_links())
    }

    /// The peers this rank has a link with (either kind), ascending.
    pub fn linked_peers(&self) -> Vec<usize> {
        (0..self.size)
            .filter(|&p| matches!(self.links[p], Link::Tcp(_) | Link::Shm(_)))
            .collect()
    }

    /// The peers reached over shared memory, ascending.
    pub fn shm_peers(&self) -> Vec<usize> {
        (0..self.size)
            .filter(|&p| matches!(self.links[p], Link::Shm(_)))
            .collect()
    }
}

/// The ring bytes of this rank's shared-memory pairs (`None`: declined), once `local_peers`
/// and `options` are checked.
fn ring_option(
    rank: usize,
    size: usize,
    local_peers: &[usize],
    options: &ShmOptions,
) -> Result<Option<usize>> {
    let mut peers = local_peers.to_vec();
    peers.sort_unstable();
    peers.dedup();
    if peers.len() != local_peers.len() || peers.iter().any(|&p| p >= size || p == rank) {
        return Err(Error::InvalidArgument(format!(
            "rank {rank} of {size}: invalid local peers {local_peers:?}"
        )));
    }
    if !options.disabled && !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&options.ring_bytes) {
        return Err(Error::InvalidArgument(format!(
            "shared-memory ring of {} bytes (allowed {MIN_RING_BYTES}..={MAX_RING_BYTES})",
            options.ring_bytes
        )));
    }
    Ok((!options.disabled).then_some(options.ring_bytes))
}

/// The links for one [`exchange::run`], with the poll set and the armed doorbells reused
/// between sleeps.
struct Routes<'a> {
    links: &'a mut [Link],
    fds: Vec<PollFd>,
    /// Shared-memory peers armed for the current sleep.
    bells: Vec<usize>,
}

impl Links for Routes<'_> {
    fn progress(&mut self, x: &mut Xfer<'_>, off: &mut usize) -> Result<bool> {
        match &mut self.links[x.peer()] {
            Link::Tcp(s) => progress(s, x, off),
            Link::Shm(l) => l.progress(x, off),
            Link::Me | Link::Later => {
                unreachable!("transfers to self are copied up front, and link_up made the others")
            }
        }
    }

    fn wait(
        &mut self,
        xfers: &[Xfer<'_>],
        active: &[(usize, usize)],
        left: Duration,
    ) -> Result<()> {
        // Announce the sleep on every shared-memory link involved, then look once more:
        // a peer that published before seeing our flag is caught here.
        self.fds.clear();
        self.bells.clear();
        let mut ready = false;
        for &(i, _) in active {
            let x = &xfers[i];
            match &self.links[x.peer()] {
                Link::Tcp(s) => self.fds.push(poll_for(s, x)),
                Link::Shm(l) => {
                    if !self.bells.contains(&x.peer()) {
                        l.arm();
                        self.bells.push(x.peer());
                    }
                    ready |= l.ready(matches!(x, Xfer::Send { .. }));
                }
                Link::Me | Link::Later => {
                    unreachable!(
                        "transfers to self are copied up front, and link_up made the others"
                    )
                }
            }
        }
        let first_bell = self.fds.len();
        if !ready {
            for &p in &self.bells {
                if let Link::Shm(l) = &self.links[p] {
                    self.fds.push(poll_fd(l.doorbell(), POLL_IN));
                }
            }
            poll(&mut self.fds, Some(left))?;
        }
        for (k, &p) in self.bells.iter().enumerate() {
            if let Link::Shm(l) = &mut self.links[p] {
                l.disarm();
                let revents = self.fds.get(first_bell + k).map_or(0, |f| f.revents);
                if !ready && revents != 0 {
                    l.drain_doorbell(revents);
                }
            }
        }
        Ok(())
    }
}

impl Transport for HybridTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, xfers: &mut [Xfer<'_>], idle_timeout: Duration) -> Result<()> {
        if self.aborted {
            return Err(Error::Shutdown("the transport was aborted".into()));
        }
        let links = &self.links;
        let made = link_up(self.rank, &mut self.dialer, xfers, idle_timeout, |p| {
            links.get(p).map_or(true, |l| !matches!(l, Link::Later))
        })?;
        for (p, m) in made {
            log::debug!(
                target: crate::LOG_TARGET,
                "rank {}: data link to rank {p} made, over {}",
                self.rank,
                if matches!(m, Made::Shm(_)) { "shared memory" } else { "TCP" }
            );
            self.links[p] = match m {
                Made::Tcp(s) => Link::Tcp(s),
                Made::Shm(l) => Link::Shm(l),
            };
        }
        let mut routes = Routes {
            links: &mut self.links,
            fds: Vec::new(),
            bells: Vec::new(),
        };
        exchange::run(
            self.rank,
            self.size,
            self.spin,
            &mut routes,
            xfers,
            idle_timeout,
        )
    }

    fn abort(&mut self) {
        self.aborted = true;
        self.dialer = None;
        for link in &mut self.links {
            match link {
                // The socket may already be dead; there is nothing more to do for it then.
                Link::Tcp(s) => {
                    let _ = s.shutdown(Shutdown::Both);
                }
                Link::Shm(l) => l.abort(),
                Link::Me | Link::Later => {}
            }
        }
    }
}
