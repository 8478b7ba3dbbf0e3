//! TCP transport: one connection per pair of ranks that talk, non-blocking sockets progressed
//! with poll(2).
//!
//! Links ([`super::dial`]): [`TcpTransport::connect`] makes the links to the peers it is told
//! to at once (rank r dials those below it and accepts those above, concurrently, so ranks
//! may start in any order), and every other link when a transfer first needs it.
//! [`TcpTransport::connect_mesh`] makes them all at once.
//!
//! Data path ([`Transport::exchange`]): all transfers of a call are progressed together on
//! non-blocking sockets, straight from and into the caller's buffers. When nothing moves, the
//! loop retries (yielding the core between tries) for [`TcpTransport::spin`] — a blocking
//! wake-up costs 40–60 µs on our VMs, a busy-polled round trip ~15 µs — and then sleeps in
//! `poll` on exactly the sockets involved.
//!
//! Socket buffers are left to the kernel's autotuning: fixed 256 KiB–16 MiB `SO_SNDBUF`/
//! `SO_RCVBUF` measured no faster on loopback for 4 and 64 MiB ring steps.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::dial::{Dialer, Event, Finish, Made};
use super::exchange::{self, Links};
use super::{Transport, Xfer};
use crate::bootstrap::net;
use crate::error::{Error, Result};
use crate::sys::{poll, poll_fd, PollFd, POLL_IN, POLL_OUT};

/// Default for [`TcpTransport::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// Authenticated TCP connections to the other ranks, made at start or on first use.
pub struct TcpTransport {
    rank: usize,
    size: usize,
    /// `peers[r]` is the connection to rank r (`None` for this rank, and for a peer not
    /// linked yet).
    peers: Vec<Option<TcpStream>>,
    /// Makes the links not made at start; `None` on a one-rank job.
    dialer: Option<Dialer>,
    aborted: bool,
    /// How long `exchange` keeps retrying after the last byte moved before it blocks in
    /// `poll`. Longer lowers small-message latency; shorter wastes less CPU when ranks
    /// outnumber cores.
    pub spin: Duration,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("aborted", &self.aborted)
            .finish()
    }
}

/// A [`TcpTransport`] taken apart ([`TcpTransport::into_parts`]).
pub(super) struct Parts {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) peers: Vec<Option<TcpStream>>,
    pub(super) dialer: Option<Dialer>,
    pub(super) spin: Duration,
    pub(super) aborted: bool,
}

/// What linking a rank into a mesh takes: who it is, where every rank listens, the job's
/// secret and how long linking at start may take. Every transport's `connect` takes one.
#[derive(Clone, Copy)]
pub struct Mesh<'a> {
    /// This rank.
    pub rank: usize,
    /// Ranks in the job.
    pub size: usize,
    /// This rank's bound data listener, at `addrs[rank]`.
    pub listener: &'a TcpListener,
    /// Every rank's listener address, as published through the rendezvous store.
    pub addrs: &'a [SocketAddr],
    /// What every connection proves knowledge of, in both directions, before anything else
    /// is read.
    pub secret: &'a [u8],
    /// How long linking at start may take: peers start at different times.
    pub timeout: Duration,
}

impl TcpTransport {
    /// Builds the full mesh: [`TcpTransport::connect`] with every link made at once.
    pub fn connect_mesh(mesh: &Mesh<'_>) -> Result<TcpTransport> {
        Self::connect(mesh, &|_| true)
    }

    /// Links this rank with its peers: with each peer `now` names before returning, with
    /// the others when a transfer first needs them (see [`super::dial`]); `now` must name
    /// the same pairs on both sides. The mesh's listener goes on taking connections for the
    /// transport's life.
    ///
    /// Connecting at start retries until the mesh's timeout, since peers start at different
    /// times. Errors: `Error::Auth` when a peer has another secret, `Error::InvalidArgument`
    /// when a peer at `addrs[r]` says it is not rank r of a job of `size`, `Error::Timeout`
    /// when the links asked for are not made in time (naming the missing ranks).
    pub fn connect(mesh: &Mesh<'_>, now: &dyn Fn(usize) -> bool) -> Result<TcpTransport> {
        Self::connect_with(mesh, now, None)
    }

    /// [`TcpTransport::connect`] where every link made on first use goes through `finish` (see
    /// [`super::dial`]): for [`super::hybrid::HybridTransport`], which takes the mesh over
    /// before any exchange, and `now` naming no peer `finish` moves to shared memory.
    pub(super) fn connect_with(
        mesh: &Mesh<'_>,
        now: &dyn Fn(usize) -> bool,
        finish: Option<Finish>,
    ) -> Result<TcpTransport> {
        let Mesh {
            rank,
            size,
            listener,
            addrs,
            secret,
            timeout,
        } = *mesh;
        if rank >= size || addrs.len() != size {
            return Err(Error::InvalidArgument(format!(
                "connect_mesh: rank {rank}, size {size}, {} addresses",
                addrs.len()
            )));
        }
        let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let dialer = if size > 1 {
            let start = Instant::now();
            let deadline = net::deadline_after(timeout);
            let mut d = Dialer::start(rank, size, listener, addrs, secret, timeout, finish)?;
            d.dial_in_background((0..rank).filter(|&p| now(p)).collect(), start, deadline)?;
            let mut missing = (0..size).filter(|&p| p != rank && now(p)).count();
            while missing > 0 {
                match d.next_event(deadline)? {
                    // A repeated rank means its dialler gave up on a first attempt after we
                    // took it: the newer connection is the live one.
                    Some(Event::Peer(r, Ok(Made::Tcp(s)))) if now(r) => {
                        if peers[r].replace(s).is_none() {
                            missing -= 1;
                        }
                    }
                    Some(Event::Peer(r, Err(e))) if now(r) => return Err(e),
                    // A peer that already uses the link it needs with us.
                    Some(Event::Peer(r, m)) => d.keep(r, m),
                    Some(Event::Failed(e)) => return Err(e),
                    None => {
                        let absent: Vec<String> = (0..size)
                            .filter(|&r| r != rank && now(r) && peers[r].is_none())
                            .map(|r| r.to_string())
                            .collect();
                        return Err(Error::Timeout {
                            what: format!(
                                "rank {rank} connecting the TCP mesh (no connection with \
                                 rank(s) {})",
                                absent.join(", ")
                            ),
                            after: timeout,
                        });
                    }
                }
            }
            for s in peers.iter().flatten() {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
            }
            Some(d)
        } else {
            None
        };
        Ok(TcpTransport {
            rank,
            size,
            peers,
            dialer,
            aborted: false,
            spin: DEFAULT_SPIN,
        })
    }

    /// The peers this rank has a link with, ascending.
    pub fn linked_peers(&self) -> Vec<usize> {
        (0..self.size)
            .filter(|&p| self.peers[p].is_some())
            .collect()
    }

    /// Makes the links `xfers` need that are not made yet (see [`super::dial`]).
    fn link_up(&mut self, xfers: &[Xfer<'_>], timeout: Duration) -> Result<()> {
        link_up(self.rank, &mut self.dialer, xfers, timeout, |p| {
            self.peers.get(p).map_or(true, Option::is_some)
        })
        .and_then(|made| {
            for (p, m) in made {
                let Made::Tcp(s) = m else {
                    return Err(Error::Io(format!(
                        "internal error: rank {} got a shared-memory link to rank {p} in a TCP \
                         transport",
                        self.rank
                    )));
                };
                self.peers[p] = Some(s);
            }
            Ok(())
        })
    }

    /// Error for a failed transfer with `peer`: a closed or broken link is `PeerLost`.
    fn link_error(peer: usize, e: &io::Error) -> Error {
        match e.kind() {
            ErrorKind::UnexpectedEof => Error::PeerLost {
                rank: peer,
                detail: "connection closed (EOF)".into(),
            },
            ErrorKind::TimedOut | ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => {
                Error::PeerLost {
                    rank: peer,
                    detail: format!("connection lost ({e})"),
                }
            }
            _ => Error::from_peer_io(peer, e),
        }
    }

    /// Takes the mesh apart for a transport that routes some peers elsewhere
    /// ([`super::hybrid::HybridTransport`]): (rank, size, per-peer streams, spin, aborted).
    pub(super) fn into_parts(self) -> Parts {
        Parts {
            rank: self.rank,
            size: self.size,
            peers: self.peers,
            dialer: self.dialer,
            spin: self.spin,
            aborted: self.aborted,
        }
    }
}

/// Moves as many bytes of `x` as `stream` takes/has right now, advancing `off`; returns
/// whether any byte moved. `WouldBlock` is not an error; a closed or broken connection is
/// `PeerLost` (see [`TcpTransport::link_error`]).
pub(crate) fn progress(stream: &TcpStream, x: &mut Xfer<'_>, off: &mut usize) -> Result<bool> {
    let peer = x.peer();
    move_bytes(stream, x, off).map_err(|e| TcpTransport::link_error(peer, &e))
}

/// The socket I/O of [`progress`].
fn move_bytes(mut stream: &TcpStream, x: &mut Xfer<'_>, off: &mut usize) -> io::Result<bool> {
    let mut moved = false;
    match x {
        Xfer::Send { buf, .. } => {
            while *off < buf.len() {
                // std's TcpStream::write is send(2) with MSG_NOSIGNAL on Linux: a closed peer
                // is an EPIPE error here, never a SIGPIPE.
                match stream.write(&buf[*off..]) {
                    Ok(0) => return Err(ErrorKind::WriteZero.into()),
                    Ok(n) => {
                        *off += n;
                        moved = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Xfer::Recv { buf, .. } => {
            while *off < buf.len() {
                match stream.read(&mut buf[*off..]) {
                    Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                    Ok(n) => {
                        *off += n;
                        moved = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(moved)
}

/// What `x` waits for on `stream`: room to write for a send, bytes to read for a receive.
pub(crate) fn poll_for(stream: &TcpStream, x: &Xfer<'_>) -> PollFd {
    let events = if matches!(x, Xfer::Send { .. }) {
        POLL_OUT
    } else {
        POLL_IN
    };
    poll_fd(stream, events)
}

/// The links `xfers` need that `linked` says are not made yet, made through `dialer` within
/// `timeout`: (peer, link) pairs. Transfers that touch no link (empty, or to this rank, or
/// to a rank out of range, which the exchange refuses) need none.
pub(super) fn link_up(
    rank: usize,
    dialer: &mut Option<Dialer>,
    xfers: &[Xfer<'_>],
    timeout: Duration,
    linked: impl Fn(usize) -> bool,
) -> Result<Vec<(usize, Made)>> {
    let mut made: Vec<(usize, Made)> = Vec::new();
    for x in xfers {
        let p = x.peer();
        let empty = match x {
            Xfer::Send { buf, .. } => buf.is_empty(),
            Xfer::Recv { buf, .. } => buf.is_empty(),
        };
        if p == rank || empty || linked(p) || made.iter().any(|(q, _)| *q == p) {
            continue;
        }
        let d = dialer.as_mut().ok_or_else(|| {
            Error::Io(format!(
                "internal error: rank {rank} has no link to rank {p}"
            ))
        })?;
        made.push((p, d.link(p, timeout)?));
    }
    Ok(made)
}

/// The mesh's sockets for one [`exchange::run`], with the poll set reused between sleeps.
struct Sockets<'a> {
    peers: &'a [Option<TcpStream>],
    fds: Vec<PollFd>,
}

fn stream_to(peers: &[Option<TcpStream>], peer: usize) -> &TcpStream {
    peers[peer]
        .as_ref()
        .expect("link_up made a link to every peer of the exchange")
}

impl Links for Sockets<'_> {
    fn progress(&mut self, x: &mut Xfer<'_>, off: &mut usize) -> Result<bool> {
        progress(stream_to(self.peers, x.peer()), x, off)
    }

    fn wait(
        &mut self,
        xfers: &[Xfer<'_>],
        active: &[(usize, usize)],
        left: Duration,
    ) -> Result<()> {
        let peers = self.peers;
        self.fds.clear();
        self.fds.extend(active.iter().map(|&(i, _)| {
            let x = &xfers[i];
            poll_for(stream_to(peers, x.peer()), x)
        }));
        poll(&mut self.fds, Some(left))?;
        Ok(())
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, xfers: &mut [Xfer<'_>], idle_timeout: Duration) -> Result<()> {
        if self.aborted {
            return Err(Error::Shutdown("the TCP transport was aborted".into()));
        }
        self.link_up(xfers, idle_timeout)?;
        let mut sockets = Sockets {
            peers: &self.peers,
            fds: Vec::new(),
        };
        exchange::run(
            self.rank,
            self.size,
            self.spin,
            &mut sockets,
            xfers,
            idle_timeout,
        )
    }

    fn abort(&mut self) {
        self.aborted = true;
        self.dialer = None;
        for s in self.peers.iter().flatten() {
            // The socket may already be dead; there is nothing more to do for it then.
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}
