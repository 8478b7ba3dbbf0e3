//! TCP transport: one connection per pair of ranks, non-blocking sockets progressed with poll(2).
//!
//! Mesh set-up ([`TcpTransport::connect_mesh`]): rank r connects to every lower rank and accepts
//! from every higher one, concurrently, so ranks may start in any order. Each connection runs
//! the mutual HMAC handshake of [`crate::bootstrap::auth`], then a 16-byte hello in each
//! direction (`"FVM1"`, sender rank, receiver rank, job size) that both sides validate.
//! Accepted connections are handled on their own short-lived threads, so a stranger that sends
//! garbage or nothing is dropped without holding up the real peers or taking their slot.
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
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use super::exchange::{self, Links};
use super::{Transport, Xfer};
use crate::bootstrap::auth::authenticate;
use crate::bootstrap::net::{
    self, poll, poll_fd, read_exact_until, write_all_until, PollFd, POLL_IN, POLL_OUT,
};
use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};

/// Default for [`TcpTransport::spin`].
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"FVM1");
const HELLO_LEN: usize = 16;

/// Full mesh of authenticated TCP connections to every other rank.
pub struct TcpTransport {
    rank: usize,
    size: usize,
    /// `peers[r]` is the connection to rank r (`None` for this rank).
    peers: Vec<Option<TcpStream>>,
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

/// What the set-up helper threads report to `connect_mesh`.
enum Event {
    /// An authenticated connection with `rank` (connected or accepted).
    Peer(usize, TcpStream),
    /// Connecting to a lower rank failed for good.
    Failed(Error),
}

impl TcpTransport {
    /// Builds the full mesh. `listener` is this rank's bound data listener and `addrs[r]` is
    /// rank r's listener address (as published through the rendezvous store). Every connection
    /// proves knowledge of `secret` in both directions before anything else is read.
    ///
    /// Connecting retries until `timeout`, since peers start at different times. On return
    /// `listener` is left in blocking mode; later connections to it are not accepted.
    /// Errors: `Error::Auth` when a peer has another secret, `Error::InvalidArgument` when a
    /// peer at `addrs[r]` says it is not rank r of a job of `size`, `Error::Timeout` when the
    /// mesh is not complete in time (naming the missing ranks).
    pub fn connect_mesh(
        rank: usize,
        size: usize,
        listener: &TcpListener,
        addrs: &[SocketAddr],
        secret: &[u8],
        timeout: Duration,
    ) -> Result<TcpTransport> {
        if rank >= size || addrs.len() != size {
            return Err(Error::InvalidArgument(format!(
                "connect_mesh: rank {rank}, size {size}, {} addresses",
                addrs.len()
            )));
        }
        let mut peers: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        if size > 1 {
            let result =
                Self::gather_peers(rank, size, listener, addrs, secret, timeout, &mut peers);
            let restored = listener.set_nonblocking(false);
            result?;
            restored?;
            for s in peers.iter().flatten() {
                s.set_nodelay(true)?;
                s.set_nonblocking(true)?;
            }
        }
        Ok(TcpTransport {
            rank,
            size,
            peers,
            aborted: false,
            spin: DEFAULT_SPIN,
        })
    }

    /// Runs the connect and accept sides concurrently until every slot of `peers` except this
    /// rank's is filled.
    fn gather_peers(
        rank: usize,
        size: usize,
        listener: &TcpListener,
        addrs: &[SocketAddr],
        secret: &[u8],
        timeout: Duration,
        peers: &mut [Option<TcpStream>],
    ) -> Result<()> {
        let start = Instant::now();
        let deadline = net::deadline_after(timeout);
        let secret: Arc<[u8]> = Arc::from(secret);
        let cancel = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Event>();
        // Helper threads poke this socket pair after each event, so the loop below can sleep
        // in one poll on both the listener and its helpers.
        let (wake_rx, wake_tx) = UnixStream::pair()?;
        wake_rx.set_nonblocking(true)?;
        wake_tx.set_nonblocking(true)?;
        let wake_tx = Arc::new(wake_tx);

        // Cancels the connector and the accepted-connection threads however we leave.
        struct CancelOnDrop(Arc<AtomicBool>);
        impl Drop for CancelOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _cancel_guard = CancelOnDrop(cancel.clone());

        if rank > 0 {
            let (tx, wake, secret, cancel) =
                (tx.clone(), wake_tx.clone(), secret.clone(), cancel.clone());
            let lower: Vec<SocketAddr> = addrs[..rank].to_vec();
            thread::Builder::new()
                .name(format!("ferrovod-connect-{rank}"))
                .spawn(move || {
                    for (peer, addr) in lower.iter().enumerate() {
                        let ev = match connect_peer(
                            rank, size, peer, *addr, &secret, start, deadline, &cancel,
                        ) {
                            Ok(s) => Event::Peer(peer, s),
                            Err(e) => Event::Failed(e),
                        };
                        let failed = matches!(ev, Event::Failed(_));
                        if tx.send(ev).is_err() || failed {
                            break;
                        }
                        notify(&wake);
                    }
                    notify(&wake);
                })?;
        }

        listener.set_nonblocking(true)?;
        let mut missing: usize = size - 1;
        loop {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    Event::Peer(r, s) => {
                        // A repeated rank means the connector gave up on its first attempt
                        // after we accepted it: the newer connection is the live one.
                        if peers[r].replace(s).is_none() {
                            missing -= 1;
                        }
                    }
                    Event::Failed(e) => return Err(e),
                }
            }
            if missing == 0 {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let absent: Vec<String> = (0..size)
                    .filter(|&r| r != rank && peers[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                return Err(Error::Timeout {
                    what: format!(
                        "rank {rank} connecting the TCP mesh (no connection with rank(s) {})",
                        absent.join(", ")
                    ),
                    after: timeout,
                });
            }
            let accepting = peers[rank + 1..].iter().any(Option::is_none);
            let mut fds = vec![poll_fd(&wake_rx, POLL_IN)];
            if accepting {
                fds.push(poll_fd(listener, POLL_IN));
            }
            poll(&mut fds, Some(left))?;
            let mut sink = [0u8; 64];
            while matches!((&wake_rx).read(&mut sink), Ok(n) if n > 0) {}
            if !accepting {
                continue;
            }
            loop {
                let stream = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    // Transient per-connection failures (the client reset before we accepted,
                    // out of descriptors) must not end the mesh: wait for the next one.
                    Err(_) => break,
                };
                let (tx, wake, secret, cancel) =
                    (tx.clone(), wake_tx.clone(), secret.clone(), cancel.clone());
                thread::Builder::new()
                    .name(format!("ferrovod-accept-{rank}"))
                    .spawn(move || {
                        let mut stream = stream;
                        match accept_peer(&mut stream, rank, size, &secret, deadline) {
                            Ok(from) => {
                                if !cancel.load(Ordering::Relaxed)
                                    && tx.send(Event::Peer(from, stream)).is_ok()
                                {
                                    notify(&wake);
                                }
                            }
                            Err(e) => log::warn!(
                                target: crate::LOG_TARGET,
                                "rank {rank} dropped a data connection from {}: {e}",
                                stream.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string())
                            ),
                        }
                    })?;
            }
        }
    }

    /// Test support: `n` transports fully connected over 127.0.0.1, index = rank.
    #[doc(hidden)]
    pub fn loopback_mesh(n: usize, secret: &[u8]) -> Result<Vec<TcpTransport>> {
        let listeners = (0..n)
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<io::Result<Vec<_>>>()?;
        let addrs = listeners
            .iter()
            .map(TcpListener::local_addr)
            .collect::<io::Result<Vec<_>>>()?;
        let timeout = Duration::from_secs(60);
        thread::scope(|scope| {
            let handles: Vec<_> = listeners
                .iter()
                .enumerate()
                .map(|(rank, l)| {
                    let addrs = &addrs;
                    scope.spawn(move || {
                        TcpTransport::connect_mesh(rank, n, l, addrs, secret, timeout)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("connect_mesh thread panicked"))
                .collect()
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
    pub(crate) fn into_parts(self) -> (usize, usize, Vec<Option<TcpStream>>, Duration, bool) {
        (self.rank, self.size, self.peers, self.spin, self.aborted)
    }
}

/// Wakes `connect_mesh`'s loop. A full socket buffer already guarantees a wake-up, so a
/// failed write loses nothing.
fn notify(mut wake: &UnixStream) {
    let _ = wake.write(&[1]);
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

fn encode_hello(from: usize, to: usize, size: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(HELLO_MAGIC)
        .u32(from as u32)
        .u32(to as u32)
        .u32(size as u32);
    w.finish()
}

/// (from, to, size) of a hello.
fn decode_hello(bytes: &[u8]) -> Result<(usize, usize, usize)> {
    let mut r = Reader::new(bytes);
    if r.u32()? != HELLO_MAGIC {
        return Err(Error::Decode("bad mesh hello".into()));
    }
    let hello = (r.u32()? as usize, r.u32()? as usize, r.u32()? as usize);
    r.finish()?;
    Ok(hello)
}

/// Connects to lower rank `peer`, retrying refused connections until `deadline`.
#[allow(clippy::too_many_arguments)]
fn connect_peer(
    rank: usize,
    size: usize,
    peer: usize,
    addr: SocketAddr,
    secret: &[u8],
    start: Instant,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(2);
    let mut last_error = String::from("none");
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(Error::Shutdown("mesh set-up abandoned".into()));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::Timeout {
                what: format!(
                    "rank {rank} connecting to rank {peer} at {addr} (last error: {last_error})"
                ),
                after: deadline - start,
            });
        }
        // Refused or unreachable: the peer may not be listening yet, so wait and retry. So
        // too a connect that met itself: one to a free port of this host's ephemeral range can
        // pick that very port as its own source (TCP's simultaneous open), and elastic
        // re-forming reconnects to addresses whose owner may be gone.
        let attempt = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5)))
            .map_err(|e| e.to_string())
            .and_then(|s| {
                if is_self_connection(&s) {
                    Err(format!(
                        "connected to itself at {addr} (rank {peer} not listening yet)"
                    ))
                } else {
                    Ok(s)
                }
            });
        let mut s = match attempt {
            Ok(s) => s,
            Err(why) => {
                last_error = why;
                thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(100));
                continue;
            }
        };
        s.set_nodelay(true)?;
        // From here on the peer is listening; it may still be busy before it accepts, which the
        // handshake's deadline covers, so there is nothing left worth retrying.
        authenticate(&mut s, secret, true, left)?;
        let what = format!("waiting for the mesh hello of rank {peer}");
        write_all_until(&mut s, &encode_hello(rank, peer, size), deadline, &what)?;
        let mut reply = [0u8; HELLO_LEN];
        read_exact_until(&mut s, &mut reply, deadline, &what)?;
        let (from, to, their_size) = decode_hello(&reply)?;
        if from != peer || to != rank || their_size != size {
            return Err(Error::InvalidArgument(format!(
                "the process at {addr} is rank {from} of {their_size}, but rank {rank} of \
                 {size} expected rank {peer} there"
            )));
        }
        return Ok(s);
    }
}

/// True when the connection's two ends are one socket address: a connect that met itself.
fn is_self_connection(s: &TcpStream) -> bool {
    matches!((s.local_addr(), s.peer_addr()), (Ok(l), Ok(p)) if l == p)
}

/// Authenticates an accepted connection and reads its hello; returns the connector's rank.
fn accept_peer(
    s: &mut TcpStream,
    rank: usize,
    size: usize,
    secret: &[u8],
    deadline: Instant,
) -> Result<usize> {
    s.set_nodelay(true)?;
    let left = deadline.saturating_duration_since(Instant::now());
    authenticate(s, secret, false, left)?;
    let mut hello = [0u8; HELLO_LEN];
    read_exact_until(s, &mut hello, deadline, "waiting for a mesh hello")?;
    let (from, to, their_size) = decode_hello(&hello)?;
    // Answer even a hello we reject, so the connector can say precisely what is misconfigured.
    write_all_until(
        s,
        &encode_hello(rank, from, size),
        deadline,
        "answering a mesh hello",
    )?;
    if to != rank || their_size != size || from <= rank || from >= size {
        return Err(Error::InvalidArgument(format!(
            "rank {from} of {their_size} connected to rank {rank} of {size} expecting rank {to}"
        )));
    }
    Ok(from)
}

/// The mesh's sockets for one [`exchange::run`], with the poll set reused between sleeps.
struct Sockets<'a> {
    peers: &'a [Option<TcpStream>],
    fds: Vec<PollFd>,
}

fn stream_to(peers: &[Option<TcpStream>], peer: usize) -> &TcpStream {
    peers[peer].as_ref().expect("a link to every other rank")
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
        for s in self.peers.iter().flatten() {
            // The socket may already be dead; there is nothing more to do for it then.
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_to_itself_is_recognised() {
        // A socket that connects to its own bound address meets itself (simultaneous open).
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        let own = s.local_addr().unwrap();
        s.connect(&own).unwrap();
        assert!(is_self_connection(&s.into()));

        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        assert!(!is_self_connection(&c));
    }
}
