//! Making the links of the data mesh: at start for the peers the caller names, on first use
//! for every other peer.
//!
//! A full mesh costs every rank a descriptor and a socket buffer per peer (1024 ranks exceed
//! the default `ulimit -n`), or on one host a shared-memory pair and its doorbell, and its
//! start makes `N·(N-1)/2` handshakes, while a rank's algorithms talk to a few peers: ring
//! neighbours, recursive-doubling partners, the other hosts' ranks of its local index. So a
//! link is made when a transfer first needs it.
//!
//! Each connection runs the mutual HMAC handshake of [`crate::bootstrap::auth`], then a
//! 16-byte hello each way (`"FVM1"`, sender rank, receiver rank, job size), which both sides
//! validate, then one verdict byte from the accepting side, then the owner's [`Finish`] on both
//! sides (a peer on this host moves to shared memory over the new connection, see
//! [`super::shm`]; the connection is then closed). An **acceptor thread** per rank
//! takes every incoming connection (each handshake on a short-lived thread of its own, so a
//! stranger that sends garbage or nothing holds up nobody) for the life of the transport: a
//! link never needs the peer's engine thread, whatever that thread is busy with, so making
//! one inside a collective cannot deadlock.
//!
//! Two ranks may dial each other at once. Exactly one connection per pair is kept: the
//! acceptor of rank `a` takes a connection from rank `b` unless `b > a` and `a` has dialled
//! `b` itself; a dialler refused that way waits for `a`'s connection, which `b`'s acceptor
//! always takes (it comes from the lower rank), as does a dialler that finds `a` gone once its
//! acceptor has taken `a`'s connection (`a` may have sent all it had and left before
//! answering). Dialling and deciding share one lock per rank ([`Claims`]), so a rank never
//! both takes a connection and dials its own.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::fast_links::FastLinks;
use super::messenger::Messenger;
use super::shm::ShmLink;
use crate::bootstrap::auth::authenticate;
use crate::bootstrap::net::{read_exact_until, write_all_until};
use crate::error::{Error, Result};
use crate::sys::{poll, poll_fd, POLL_IN};
use crate::wire::{Reader, Writer};

const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"FVM1");
/// The hello of a connection that carries point-to-point messages ([`super::messenger`]).
const MESSAGES_MAGIC: u32 = u32::from_le_bytes(*b"FVP1");
/// The hello of a connection that carries the fast path's posts across hosts
/// ([`super::fast_links`]).
const FAST_MAGIC: u32 = u32::from_le_bytes(*b"FVF1");
const HELLO_LEN: usize = 16;

/// A link made: the connection itself, or the shared-memory link set up over it.
pub(super) enum Made {
    Tcp(TcpStream),
    Shm(Box<ShmLink>),
}

/// What a new connection to a peer becomes, run by both sides once the link is agreed (by the
/// dialler on its own thread, by the acceptor on the connection's handshake thread, so that it
/// never needs the peer's engine thread): `Some` moves the pair to shared memory, `None` keeps
/// the connection. Both sides must decide alike for a peer (the same host table).
pub(super) type Finish =
    Arc<dyn Fn(usize, &mut TcpStream, Instant) -> Result<Option<ShmLink>> + Send + Sync>;

/// The link `s` to `peer` becomes through `finish`.
fn finished(
    finish: Option<&Finish>,
    peer: usize,
    mut s: TcpStream,
    deadline: Instant,
) -> Result<Made> {
    let Some(f) = finish else {
        return Ok(Made::Tcp(s));
    };
    Ok(match f(peer, &mut s, deadline)? {
        Some(link) => Made::Shm(Box::new(link)),
        None => Made::Tcp(s),
    })
}

/// What reaches the owner of a [`Dialer`]: a link made by its acceptor or by its start-up
/// connector (or, for a connection the acceptor took, why finishing it failed, so that nobody
/// waits for that link until a timeout), or why the connector gave up.
pub(super) enum Event {
    Peer(usize, Result<Made>),
    Failed(Error),
}

/// Who dialled whom, and whose connection was taken, for the verdicts (see the module doc).
struct Claims {
    dialled: Vec<bool>,
    taken: Vec<bool>,
}

/// This rank's acceptor and the links it made that nobody has asked for yet.
pub(super) struct Dialer {
    rank: usize,
    size: usize,
    addrs: Arc<[SocketAddr]>,
    secret: Arc<[u8]>,
    finish: Option<Finish>,
    claims: Arc<Mutex<Claims>>,
    tx: mpsc::Sender<Event>,
    rx: mpsc::Receiver<Event>,
    /// Rung after each event; readable while events may wait.
    bell: UnixStream,
    ringer: Arc<UnixStream>,
    /// Links made (or lost in the making) but not asked for yet.
    arrived: HashMap<usize, Result<Made>>,
    stop: Arc<AtomicBool>,
    /// Written on drop, so the acceptor leaves its poll at once.
    stop_bell: UnixStream,
    acceptor: Option<thread::JoinHandle<()>>,
    /// Where the acceptor hands the connections that carry point-to-point messages.
    messenger: Messenger,
    /// Where it hands those that carry the fast path's posts.
    fast: FastLinks,
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialer")
            .field("rank", &self.rank)
            .field("arrived", &self.arrived.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Dialer {
    /// Starts accepting on `listener` (this rank's data listener, `addrs[rank]`) for rank
    /// `rank` of `size`; `timeout` bounds each incoming handshake; every link made goes
    /// through `finish`.
    pub(super) fn start(
        rank: usize,
        size: usize,
        listener: &TcpListener,
        addrs: &[SocketAddr],
        secret: &[u8],
        timeout: Duration,
        finish: Option<Finish>,
    ) -> Result<Dialer> {
        let listener = listener.try_clone()?;
        listener.set_nonblocking(true)?;
        let (bell, ringer) = UnixStream::pair()?;
        bell.set_nonblocking(true)?;
        ringer.set_nonblocking(true)?;
        let (stop_bell, stop_rx) = UnixStream::pair()?;
        let (tx, rx) = mpsc::channel();
        let (addrs, secret): (Arc<[SocketAddr]>, Arc<[u8]>) = (Arc::from(addrs), Arc::from(secret));
        let messenger = Messenger::new(
            rank,
            size,
            addrs.clone(),
            secret.clone(),
            timeout,
            finish.clone(),
        )?;
        let fast = FastLinks::new(rank, size, addrs.clone(), secret.clone(), timeout);
        let mut d = Dialer {
            rank,
            size,
            addrs,
            secret,
            finish,
            claims: Arc::new(Mutex::new(Claims {
                dialled: vec![false; size],
                taken: vec![false; size],
            })),
            tx,
            rx,
            bell,
            ringer: Arc::new(ringer),
            arrived: HashMap::new(),
            stop: Arc::new(AtomicBool::new(false)),
            stop_bell,
            acceptor: None,
            messenger,
            fast,
        };
        let acceptor = Acceptor {
            rank,
            size,
            secret: d.secret.clone(),
            finish: d.finish.clone(),
            claims: d.claims.clone(),
            tx: d.tx.clone(),
            ringer: d.ringer.clone(),
            stop: d.stop.clone(),
            timeout,
            messenger: d.messenger.clone(),
            fast: d.fast.clone(),
        };
        let handle = thread::Builder::new()
            .name(format!("ferrovod-accept-{rank}"))
            .spawn(move || acceptor.run(&listener, &stop_rx))?;
        d.acceptor = Some(handle);
        Ok(d)
    }

    /// Dials `peers` (each lower than this rank) one after another on a thread of its own,
    /// retrying a peer not listening yet until `deadline`; each link, or the first failure,
    /// arrives as an [`Event`] (see [`Dialer::next_event`]).
    pub(super) fn dial_in_background(
        &self,
        peers: Vec<usize>,
        start: Instant,
        deadline: Instant,
    ) -> Result<()> {
        if peers.is_empty() {
            return Ok(());
        }
        let (rank, size) = (self.rank, self.size);
        let (addrs, secret, claims) =
            (self.addrs.clone(), self.secret.clone(), self.claims.clone());
        let finish = self.finish.clone();
        let (tx, ringer, stop) = (self.tx.clone(), self.ringer.clone(), self.stop.clone());
        thread::Builder::new()
            .name(format!("ferrovod-connect-{rank}"))
            .spawn(move || {
                for peer in peers {
                    claims.lock().expect("claims lock").dialled[peer] = true;
                    let made = connect_peer(
                        HELLO_MAGIC,
                        (rank, size),
                        (peer, addrs[peer]),
                        &secret,
                        Retry::Until(start),
                        deadline,
                        &stop,
                    )
                    .and_then(|s| {
                        s.map(|s| finished(finish.as_ref(), peer, s, deadline))
                            .transpose()
                    });
                    let ev = match made {
                        Ok(Some(m)) => Event::Peer(peer, Ok(m)),
                        Ok(None) => Event::Failed(Error::Io(format!(
                            "rank {peer} refused rank {rank}'s data connection at start"
                        ))),
                        Err(e) => Event::Failed(e),
                    };
                    let failed = matches!(ev, Event::Failed(_));
                    if tx.send(ev).is_err() || failed {
                        break;
                    }
                    ring(&ringer);
                }
                ring(&ringer);
            })?;
        Ok(())
    }

    /// The next event, waiting for it until `deadline` (`None`: the deadline passed).
    pub(super) fn next_event(&mut self, deadline: Instant) -> Result<Option<Event>> {
        loop {
            if let Ok(ev) = self.rx.try_recv() {
                return Ok(Some(ev));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            let mut fds = [poll_fd(&self.bell, POLL_IN)];
            poll(&mut fds, Some(left))?;
            let mut sink = [0u8; 64];
            while matches!((&self.bell).read(&mut sink), Ok(n) if n > 0) {}
        }
    }

    /// This rank's point-to-point messenger, which the acceptor feeds.
    pub(super) fn fast_links(&self) -> FastLinks {
        self.fast.clone()
    }

    pub(super) fn messenger(&self) -> Messenger {
        self.messenger.clone()
    }

    /// Keeps a link the owner has no place for yet (or why it was lost).
    pub(super) fn keep(&mut self, peer: usize, m: Result<Made>) {
        self.arrived.insert(peer, m);
    }

    /// Takes the link to `peer` that arrived, if one did.
    fn take(&mut self, peer: usize) -> Option<Result<Made>> {
        self.arrived.remove(&peer)
    }

    /// The link to `peer`, made now if no link has arrived: dialled (a peer not listening
    /// is gone: every rank's acceptor runs before any collective), or, where the peer dials
    /// us at the same time, its connection awaited. Within `timeout`; a connection kept is
    /// non-blocking, without delay.
    pub(super) fn link(&mut self, peer: usize, timeout: Duration) -> Result<Made> {
        let start = Instant::now();
        let deadline = start + timeout;
        let m = self.make(peer, start, deadline)?;
        if let Made::Tcp(s) = &m {
            s.set_nodelay(true)?;
            s.set_nonblocking(true)?;
        }
        Ok(m)
    }

    fn make(&mut self, peer: usize, start: Instant, deadline: Instant) -> Result<Made> {
        self.drain();
        if let Some(m) = self.take(peer) {
            return m;
        }
        let dial = {
            let mut c = self.claims.lock().expect("claims lock");
            if !c.taken[peer] {
                c.dialled[peer] = true;
            }
            !c.taken[peer]
        };
        if dial {
            if let Some(s) = self.dial(peer, deadline)? {
                return finished(self.finish.as_ref(), peer, s, deadline);
            }
        }
        self.await_link(peer, start, deadline)
    }

    /// Dials `peer` for [`Dialer::make`]: the connection, or `None` when the peer's own
    /// connection is the link (its acceptor declined ours, or it has gone after linking).
    fn dial(&self, peer: usize, deadline: Instant) -> Result<Option<TcpStream>> {
        let made = connect_peer(
            HELLO_MAGIC,
            (self.rank, self.size),
            (peer, self.addrs[peer]),
            &self.secret,
            Retry::Never,
            deadline,
            &self.stop,
        );
        match made {
            // Both sides dialled, and the peer's connection, which our acceptor took while we
            // dialled, carried all it had for us: it may then have finished its work and
            // closed its listener before answering ours (reset or refused). Its link, and
            // what it sent over it, is waiting here.
            Err(_) if self.claims.lock().expect("claims lock").taken[peer] => Ok(None),
            made => made,
        }
    }

    /// Waits for the link `peer`'s own connection makes through the acceptor.
    fn await_link(&mut self, peer: usize, start: Instant, deadline: Instant) -> Result<Made> {
        loop {
            match self.next_event(deadline)? {
                Some(Event::Peer(r, m)) if r == peer => return m,
                Some(Event::Peer(r, m)) => self.keep(r, m),
                Some(Event::Failed(e)) => return Err(e),
                None => {
                    return Err(Error::Timeout {
                        what: format!(
                            "rank {} waiting for the data connection of rank {peer}",
                            self.rank
                        ),
                        after: deadline - start,
                    })
                }
            }
        }
    }

    /// Moves every link the acceptor made into `arrived`.
    fn drain(&mut self) {
        while let Ok(ev) = self.rx.try_recv() {
            if let Event::Peer(r, m) = ev {
                self.keep(r, m);
            }
        }
    }
}

impl Drop for Dialer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = (&self.stop_bell).write(&[1]);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

/// The acceptor thread's state.
struct Acceptor {
    rank: usize,
    size: usize,
    secret: Arc<[u8]>,
    finish: Option<Finish>,
    claims: Arc<Mutex<Claims>>,
    tx: mpsc::Sender<Event>,
    ringer: Arc<UnixStream>,
    stop: Arc<AtomicBool>,
    timeout: Duration,
    messenger: Messenger,
    fast: FastLinks,
}

impl Acceptor {
    fn run(self, listener: &TcpListener, stop_rx: &UnixStream) {
        let me = Arc::new(self);
        while !me.stop.load(Ordering::Relaxed) {
            let mut fds = [poll_fd(listener, POLL_IN), poll_fd(stop_rx, POLL_IN)];
            if poll(&mut fds, None).is_err() || fds[1].revents != 0 {
                continue;
            }
            loop {
                let stream = match listener.accept() {
                    Ok((s, _)) => s,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    // WouldBlock, or a transient per-connection failure (the client reset
                    // before we accepted, out of descriptors): wait for the next one.
                    Err(_) => break,
                };
                let a = me.clone();
                let spawned = thread::Builder::new()
                    .name(format!("ferrovod-hello-{}", me.rank))
                    .spawn(move || a.greet(stream));
                if let Err(e) = spawned {
                    log::warn!(target: crate::LOG_TARGET, "rank {}: no thread for a data connection: {e}", me.rank);
                }
            }
        }
    }

    /// Runs one incoming handshake and hands the link over when it is taken.
    fn greet(&self, mut s: TcpStream) {
        let deadline = Instant::now() + self.timeout;
        let decide = |from: usize| {
            let mut c = self.claims.lock().expect("claims lock");
            let take = from < self.rank || !c.dialled[from];
            if take {
                c.taken[from] = true;
            }
            take
        };
        let from_addr = s.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string());
        let event = match accept_peer(&mut s, self.rank, self.size, &self.secret, deadline, decide)
        {
            // Taken, so the owner may already wait for this very link, failed or not.
            Ok(Accepted::Link(from)) => {
                Event::Peer(from, finished(self.finish.as_ref(), from, s, deadline))
            }
            Ok(Accepted::Messages(from)) => {
                let made = finished(self.finish.as_ref(), from, s, deadline);
                self.messenger.incoming(from, made);
                return;
            }
            Ok(Accepted::Fast(from)) => {
                self.fast.arrived(from, s);
                return;
            }
            Ok(Accepted::Declined) => return,
            Err(e) => {
                log::warn!(
                    target: crate::LOG_TARGET,
                    "rank {} dropped a data connection from {from_addr}: {e}",
                    self.rank,
                );
                return;
            }
        };
        if !self.stop.load(Ordering::Relaxed) && self.tx.send(event).is_ok() {
            ring(&self.ringer);
        }
    }
}

/// Rings a [`Dialer`]'s bell. A full socket buffer already guarantees a wake-up, so a failed
/// write loses nothing.
fn ring(mut ringer: &UnixStream) {
    let _ = ringer.write(&[1]);
}

fn encode_hello(magic: u32, from: usize, to: usize, size: usize) -> Vec<u8> {
    let mut w = Writer::new();
    w.u32(magic)
        .u32(from as u32)
        .u32(to as u32)
        .u32(size as u32);
    w.finish()
}

/// (magic, from, to, size) of a hello: a data link's or a messages connection's.
fn decode_hello(bytes: &[u8]) -> Result<(u32, usize, usize, usize)> {
    let mut r = Reader::new(bytes);
    let magic = r.u32()?;
    if ![HELLO_MAGIC, MESSAGES_MAGIC, FAST_MAGIC].contains(&magic) {
        return Err(Error::Decode("bad mesh hello".into()));
    }
    let hello = (
        magic,
        r.u32()? as usize,
        r.u32()? as usize,
        r.u32()? as usize,
    );
    r.finish()?;
    Ok(hello)
}

/// Whether a refused connection is tried again.
#[derive(Clone, Copy)]
enum Retry {
    /// At start, until the deadline: the peer may not be listening yet (the `Instant` is
    /// when the whole start began, for the error).
    Until(Instant),
    /// Later: every rank listens before any collective, so a refusal means the peer is gone.
    Never,
}

/// Connects to `peer`, listening at `addr`; `None` when its acceptor declined the link
/// because `peer` dials this rank itself (see the module doc).
fn connect_peer(
    magic: u32,
    (rank, size): (usize, usize),
    (peer, addr): (usize, SocketAddr),
    secret: &[u8],
    retry: Retry,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<Option<TcpStream>> {
    let mut backoff = Duration::from_millis(2);
    let mut last_error = String::from("none");
    let begun = Instant::now();
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(Error::Shutdown("mesh set-up abandoned".into()));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let start = match retry {
                Retry::Until(start) => start,
                Retry::Never => begun,
            };
            return Err(Error::Timeout {
                what: format!(
                    "rank {rank} connecting to rank {peer} at {addr} (last error: {last_error})"
                ),
                after: deadline - start,
            });
        }
        // Refused or unreachable: at start the peer may not be listening yet, so wait and
        // retry. So too a connect that met itself: one to a free port of this host's
        // ephemeral range can pick that very port as its own source (TCP's simultaneous
        // open), and elastic re-forming reconnects to addresses whose owner may be gone.
        let attempt = TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5)))
            .map_err(|e| e.to_string())
            .and_then(|s| {
                if is_self_connection(&s) {
                    Err(format!(
                        "connected to itself at {addr} (rank {peer} not listening)"
                    ))
                } else {
                    Ok(s)
                }
            });
        let mut s = match (attempt, retry) {
            (Ok(s), _) => s,
            (Err(why), Retry::Never) => {
                return Err(Error::PeerLost {
                    rank: peer,
                    detail: format!("its data listener at {addr} is gone ({why})"),
                })
            }
            (Err(why), Retry::Until(_)) => {
                last_error = why;
                thread::sleep(backoff.min(left));
                backoff = (backoff * 2).min(Duration::from_millis(100));
                continue;
            }
        };
        s.set_nodelay(true)?;
        // From here on the peer is listening; its acceptor answers within the handshake's
        // deadline, so there is nothing left worth retrying. A connection dropped meanwhile
        // is the peer's listener closing: the peer left.
        let lost = |e: Error| match e {
            Error::Io(m) => Error::PeerLost {
                rank: peer,
                detail: format!(
                    "its data listener at {addr} dropped rank {rank}'s connection: {m}"
                ),
            },
            e => e,
        };
        authenticate(&mut s, secret, true, left).map_err(lost)?;
        let what = format!("waiting for the mesh hello of rank {peer}");
        write_all_until(
            &mut s,
            &encode_hello(magic, rank, peer, size),
            deadline,
            &what,
        )
        .map_err(lost)?;
        let mut reply = [0u8; HELLO_LEN + 1];
        read_exact_until(&mut s, &mut reply, deadline, &what).map_err(lost)?;
        let (their_magic, from, to, their_size) = decode_hello(&reply[..HELLO_LEN])?;
        if their_magic != magic || from != peer || to != rank || their_size != size {
            return Err(Error::InvalidArgument(format!(
                "the process at {addr} is rank {from} of {their_size}, but rank {rank} of \
                 {size} expected rank {peer} there"
            )));
        }
        return Ok((reply[HELLO_LEN] == 1).then_some(s));
    }
}

/// True when the connection's two ends are one socket address: a connect that met itself.
pub(super) fn is_self_connection(s: &TcpStream) -> bool {
    matches!((s.local_addr(), s.peer_addr()), (Ok(l), Ok(p)) if l == p)
}

/// What an accepted connection is for.
enum Accepted {
    /// The data link with this rank.
    Link(usize),
    /// This rank's messages from that rank (always taken: one per direction, no tie-break).
    Messages(usize),
    /// That rank's fast-path posts to this rank (likewise).
    Fast(usize),
    /// A data link the dialler's own connection stands in for.
    Declined,
}

/// Authenticates an accepted connection, reads its hello and answers it: a data link with
/// `take`'s verdict on the dialler's rank, a messages connection always.
fn accept_peer(
    s: &mut TcpStream,
    rank: usize,
    size: usize,
    secret: &[u8],
    deadline: Instant,
    take: impl FnOnce(usize) -> bool,
) -> Result<Accepted> {
    s.set_nodelay(true)?;
    let left = deadline.saturating_duration_since(Instant::now());
    authenticate(s, secret, false, left)?;
    let mut hello = [0u8; HELLO_LEN];
    read_exact_until(s, &mut hello, deadline, "waiting for a mesh hello")?;
    let (magic, from, to, their_size) = decode_hello(&hello)?;
    let valid = to == rank && their_size == size && from != rank && from < size;
    let one_way = magic != HELLO_MAGIC;
    let taken = valid && (one_way || take(from));
    // Answer even a hello we reject, so the dialler can say precisely what is misconfigured.
    let mut reply = encode_hello(magic, rank, from, size);
    reply.push(u8::from(taken));
    write_all_until(s, &reply, deadline, "answering a mesh hello")?;
    if !valid {
        return Err(Error::InvalidArgument(format!(
            "rank {from} of {their_size} connected to rank {rank} of {size} expecting rank {to}"
        )));
    }
    Ok(match (taken, magic) {
        (false, _) => Accepted::Declined,
        (true, MESSAGES_MAGIC) => Accepted::Messages(from),
        (true, FAST_MAGIC) => Accepted::Fast(from),
        (true, _) => Accepted::Link(from),
    })
}

/// This rank's connection for its messages to `peer`, listening at `addr` (see
/// [`super::messenger`]), then what `finish` makes of it (shared memory with a peer on this
/// host).
pub(super) fn connect_messages(
    (rank, size): (usize, usize),
    (peer, addr): (usize, SocketAddr),
    secret: &[u8],
    finish: Option<&Finish>,
    deadline: Instant,
) -> Result<Made> {
    let s = connect_one_way(MESSAGES_MAGIC, (rank, size), (peer, addr), secret, deadline)?;
    finished(finish, peer, s, deadline)
}

/// This rank's connection for its fast-path posts to `peer`, listening at `addr` (see
/// [`super::fast_links`]): always TCP.
pub(super) fn connect_fast(
    (rank, size): (usize, usize),
    (peer, addr): (usize, SocketAddr),
    secret: &[u8],
    deadline: Instant,
) -> Result<TcpStream> {
    connect_one_way(FAST_MAGIC, (rank, size), (peer, addr), secret, deadline)
}

/// A connection of one direction (messages or fast-path posts, by `magic`), authenticated and
/// introduced as the data links are. Every rank listens before any op, so a refusal means the
/// peer is gone.
fn connect_one_way(
    magic: u32,
    (rank, size): (usize, usize),
    (peer, addr): (usize, SocketAddr),
    secret: &[u8],
    deadline: Instant,
) -> Result<TcpStream> {
    let never = AtomicBool::new(false);
    let made = connect_peer(
        magic,
        (rank, size),
        (peer, addr),
        secret,
        Retry::Never,
        deadline,
        &never,
    )?;
    made.ok_or_else(|| Error::PeerLost {
        rank: peer,
        detail: format!("it refused a connection of rank {rank}"),
    })
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

    #[test]
    fn a_link_lost_while_being_finished_fails_its_waiter_at_once() {
        let secret = b"k";
        let t = Duration::from_secs(30);
        let (listeners, addrs) = crate::testing::loopback_listeners(2).unwrap();
        // Rank 1 finishes every link as a shared-memory set-up that meets a vanished peer.
        let finish: Finish = Arc::new(|peer, _s, _deadline| {
            Err(Error::PeerLost {
                rank: peer,
                detail: "while setting up shared memory: connection closed".into(),
            })
        });
        let mut one = Dialer::start(1, 2, &listeners[1], &addrs, secret, t, Some(finish)).unwrap();
        let mut zero = Dialer::start(0, 2, &listeners[0], &addrs, secret, t, None).unwrap();
        zero.link(1, t).unwrap();
        // Rank 1's acceptor took rank 0's connection, so rank 1 waits for that link: the loss
        // reaches it at once, not after the link's timeout.
        let begun = Instant::now();
        match one.link(0, t).err() {
            Some(Error::PeerLost { rank: 0, detail }) => assert!(detail.contains("shared memory")),
            other => panic!("expected rank 0 lost, got {other:?}"),
        }
        assert!(begun.elapsed() < t / 2, "waited {:?}", begun.elapsed());
    }

    #[test]
    fn a_peer_gone_after_linking_leaves_its_link_to_a_rank_that_dialled_it_too() {
        let secret = b"k";
        let t = Duration::from_secs(10);
        let (listeners, addrs) = crate::testing::loopback_listeners(2).unwrap();
        let mut one = Dialer::start(1, 2, &listeners[1], &addrs, secret, t, None).unwrap();
        // Rank 1 decides to dial rank 0 (it needs the link) ...
        one.claims.lock().unwrap().dialled[0] = true;
        // ... while rank 0 links with rank 1 itself, sends what it has for it and leaves.
        {
            let mut zero = Dialer::start(0, 2, &listeners[0], &addrs, secret, t, None).unwrap();
            let Made::Tcp(mut s) = zero.link(1, t).unwrap() else {
                unreachable!("no finish: TCP")
            };
            s.set_nonblocking(false).unwrap();
            s.write_all(b"from 0").unwrap();
        }
        let mut gone = listeners.into_iter();
        drop(gone.next());
        let deadline = Instant::now() + t;
        // Rank 1's dial now meets a closed listener, but rank 0's own connection is the link.
        assert!(one.dial(0, deadline).unwrap().is_none());
        let Made::Tcp(mut s) = one.await_link(0, Instant::now(), deadline).unwrap() else {
            unreachable!("no finish: TCP")
        };
        s.set_nonblocking(false).unwrap();
        let mut got = [0u8; 6];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"from 0");

        // A peer gone without linking is lost, named.
        let alone = TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = TcpListener::bind("127.0.0.1:0").unwrap();
        let addrs = [closed.local_addr().unwrap(), alone.local_addr().unwrap()];
        drop(closed);
        let lonely = Dialer::start(1, 2, &alone, &addrs, secret, t, None).unwrap();
        match lonely.dial(0, Instant::now() + t) {
            Err(Error::PeerLost { rank: 0, .. }) => {}
            other => panic!("expected rank 0 lost, got {other:?}"),
        }
    }
}
