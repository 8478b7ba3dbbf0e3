//! Rendezvous store over TCP: a small key-value server (run by the launcher or by rank 0) and
//! the client every rank uses to publish and look up addresses.
//!
//! Every connection runs the mutual handshake of [`super::auth`] first; the server reads no
//! request from a client that has not proved the job secret. Requests and replies are frames
//! ([`super::net`]) whose bodies are encoded with [`crate::wire`]:
//!
//! ```text
//! request  SET u8=1 key:str value:bytes        reply  OK u8=0
//!          GET u8=2 key:str timeout_ms:u64            OK u8=0 value:bytes | TIMEOUT u8=1
//!          ADD u8=3 key:str delta:i64                 OK u8=0 new:i64
//! any reply may instead be an error: u8 (2 invalid argument, 3 shutting down, 4 bad request)
//! followed by a message:str
//! ```
//!
//! `add` keeps its counter as decimal ASCII (as torch's TCPStore does), so `get` of a counter
//! returns e.g. `b"3"`. A GET waits on the server, so a client keeps a small pool of
//! connections: a thread blocked in `get` does not hold up another thread's `set`.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::auth::authenticate;
use super::net::{deadline_after, read_frame, read_frame_until, write_frame};
use super::Store;
use crate::error::{Error, Result};
use crate::sys::{poll, poll_fd, POLL_IN};
use crate::wire::{Reader, Writer};

/// Largest request or reply frame, in bytes (the store holds addresses and small blobs).
pub const MAX_STORE_FRAME: usize = 64 << 20;

/// How long the server gives a new connection to complete the handshake.
const SERVER_AUTH_TIMEOUT: Duration = Duration::from_secs(10);

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;

const ST_OK: u8 = 0;
const ST_TIMEOUT: u8 = 1;
const ST_INVALID: u8 = 2;
const ST_SHUTDOWN: u8 = 3;
const ST_BAD_REQUEST: u8 = 4;

/// One connected client, as the server's shutdown sees it.
struct ClientSlot {
    /// A handle on the client's socket, to unblock its thread at shutdown.
    stream: TcpStream,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    secret: Vec<u8>,
    data: Mutex<HashMap<String, Vec<u8>>>,
    /// Signalled whenever `data` changes or the server stops.
    changed: Condvar,
    stopping: AtomicBool,
    clients: Mutex<HashMap<u64, ClientSlot>>,
    next_id: AtomicU64,
}

impl Shared {
    /// Sets `key` and wakes every `get` waiting on the store.
    fn set(&self, key: &str, value: &[u8]) {
        self.data.lock().insert(key.to_owned(), value.to_vec());
        self.changed.notify_all();
    }
}

/// The rendezvous server. Serves on background threads (one per client) until
/// [`TcpStoreServer::shutdown`] or drop, which close every socket and join every thread.
pub struct TcpStoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    wake: UnixStream,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for TcpStoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStoreServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpStoreServer {
    /// Binds `bind` (port 0 picks a free port) and starts serving clients that know `secret`.
    pub fn start(bind: SocketAddr, secret: Vec<u8>) -> Result<TcpStoreServer> {
        let listener = TcpListener::bind(bind)
            .map_err(|e| Error::Io(format!("rendezvous store: binding {bind}: {e}")))?;
        Self::serve(listener, secret)
    }

    /// Starts serving, on `listener`, clients that know `secret`.
    pub fn serve(listener: TcpListener, secret: Vec<u8>) -> Result<TcpStoreServer> {
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let (wake_rx, wake) = UnixStream::pair()?;
        let shared = Arc::new(Shared {
            secret,
            data: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            clients: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
        });
        let sh = shared.clone();
        let acceptor = thread::Builder::new()
            .name("ferrovod-store".into())
            .spawn(move || accept_loop(listener, wake_rx, sh))?;
        Ok(TcpStoreServer {
            addr,
            shared,
            wake,
            acceptor: Some(acceptor),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sets `key` to `value` from the serving process itself (the launcher publishing what
    /// its workers wait for), waking every client waiting on it.
    pub fn set(&self, key: &str, value: &[u8]) {
        self.shared.set(key, value);
    }

    /// Stops serving: closes the listener and every client connection, wakes waiting `get`s
    /// (their clients get an error) and joins the server's threads. Idempotent.
    ///
    /// Blocks until every client thread has ended; a thread may be logging, which under Python
    /// takes the GIL, so a caller holding the GIL must release it around this call.
    pub fn shutdown(&mut self) {
        let Some(acceptor) = self.acceptor.take() else {
            return;
        };
        self.shared.stopping.store(true, Ordering::SeqCst);
        // The acceptor polls this socket; closing our end makes it readable for good.
        let _ = self.wake.shutdown(Shutdown::Both);
        let _ = acceptor.join();
        // No new client can appear now that the acceptor is gone.
        let clients = std::mem::take(&mut *self.shared.clients.lock());
        for c in clients.values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        {
            // Notify under the lock so a `get` between its check and its wait cannot miss it.
            let _data = self.shared.data.lock();
            self.shared.changed.notify_all();
        }
        for (_, c) in clients {
            if let Some(t) = c.thread {
                let _ = t.join();
            }
        }
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn accept_loop(listener: TcpListener, wake: UnixStream, shared: Arc<Shared>) {
    loop {
        let mut fds = [poll_fd(&listener, POLL_IN), poll_fd(&wake, POLL_IN)];
        if poll(&mut fds, None).is_err() || shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        loop {
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                // WouldBlock: drained. Anything else concerns one connection (reset before we
                // took it, descriptor limit): keep serving the others.
                Err(_) => break,
            };
            let Ok(handle) = stream.try_clone() else {
                continue;
            };
            let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
            // Hold the lock across spawn so the client cannot deregister before it is registered.
            let mut clients = shared.clients.lock();
            let sh = shared.clone();
            let spawned = thread::Builder::new()
                .name("ferrovod-store-client".into())
                .spawn(move || {
                    serve_client(&sh, stream);
                    sh.clients.lock().remove(&id);
                });
            if let Ok(t) = spawned {
                clients.insert(
                    id,
                    ClientSlot {
                        stream: handle,
                        thread: Some(t),
                    },
                );
            }
        }
    }
}

fn serve_client(shared: &Shared, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    if let Err(e) = authenticate(&mut stream, &shared.secret, false, SERVER_AUTH_TIMEOUT) {
        // Closed by our own shutdown: nothing to report, and the log (bridged to Python
        // logging, so it takes the GIL) must not be a reason for `shutdown` to wait.
        if shared.stopping.load(Ordering::SeqCst) {
            return;
        }
        log::warn!(
            target: crate::LOG_TARGET,
            "rendezvous store dropped a connection from {}: {e}",
            stream.peer_addr().map_or_else(|_| "?".into(), |a| a.to_string())
        );
        return;
    }
    while !shared.stopping.load(Ordering::SeqCst) {
        let Ok(request) = read_frame(&mut stream, MAX_STORE_FRAME) else {
            return;
        };
        let (reply, keep) = match handle_request(shared, &request) {
            Ok(reply) => (reply, true),
            Err(e) => {
                let mut w = Writer::new();
                w.u8(ST_BAD_REQUEST).str(&e.to_string());
                (w.finish(), false)
            }
        };
        if write_frame(&mut stream, &reply).is_err() || !keep {
            return;
        }
    }
}

/// Executes one request; `Err` means it did not decode.
fn handle_request(shared: &Shared, request: &[u8]) -> Result<Vec<u8>> {
    let mut r = Reader::new(request);
    let op = r.u8()?;
    let key = r.str()?;
    let mut w = Writer::new();
    match op {
        OP_SET => {
            let value = r.bytes()?;
            r.finish()?;
            shared.set(key, value);
            w.u8(ST_OK);
        }
        OP_GET => {
            let ms = r.u64()?;
            r.finish()?;
            // A deadline too far to represent means "wait as long as it takes".
            let deadline = Instant::now().checked_add(Duration::from_millis(ms));
            let mut data = shared.data.lock();
            loop {
                if shared.stopping.load(Ordering::SeqCst) {
                    w.u8(ST_SHUTDOWN)
                        .str("the rendezvous store is shutting down");
                    break;
                }
                if let Some(v) = data.get(key) {
                    w.u8(ST_OK).bytes(v);
                    break;
                }
                match deadline {
                    Some(d) => {
                        if Instant::now() >= d {
                            w.u8(ST_TIMEOUT);
                            break;
                        }
                        shared.changed.wait_until(&mut data, d);
                    }
                    None => shared.changed.wait(&mut data),
                }
            }
        }
        OP_ADD => {
            let delta = r.i64()?;
            r.finish()?;
            let mut data = shared.data.lock();
            let current = match data.get(key) {
                None => Ok(0),
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| format!("key {key:?} does not hold an integer")),
            };
            match current.and_then(|c| {
                c.checked_add(delta)
                    .ok_or_else(|| format!("adding {delta} to key {key:?} overflows"))
            }) {
                Ok(new) => {
                    data.insert(key.to_string(), new.to_string().into_bytes());
                    shared.changed.notify_all();
                    w.u8(ST_OK).i64(new);
                }
                Err(msg) => {
                    w.u8(ST_INVALID).str(&msg);
                }
            }
        }
        other => return Err(Error::Decode(format!("unknown store request {other}"))),
    }
    Ok(w.finish())
}

/// Client of a [`TcpStoreServer`]; implements [`Store`] and may be shared between threads.
pub struct TcpStore {
    addr: SocketAddr,
    secret: Vec<u8>,
    io_timeout: Duration,
    /// Authenticated connections not in use by any thread.
    idle: Mutex<Vec<TcpStream>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpStore {
    /// Connects to the store at `addr` and authenticates with `secret`, retrying a refused
    /// connection (or an unresolvable name) until `timeout`: the server may start later than
    /// its clients. `timeout` also bounds every later request (beyond a `get`'s own wait).
    /// A server with another secret is `Error::Auth` at once.
    pub fn connect(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        secret: &[u8],
        timeout: Duration,
    ) -> Result<TcpStore> {
        let deadline = deadline_after(timeout);
        let mut backoff = Duration::from_millis(5);
        let mut last_error = String::from("none");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout {
                    what: format!(
                        "connecting to the rendezvous store at {addr:?} (last error: {last_error})"
                    ),
                    after: timeout,
                });
            }
            let resolved = match addr.to_socket_addrs() {
                Ok(a) => a.collect::<Vec<_>>(),
                // Not "host:port" at all (no port, a port out of range): no retry can fix it.
                Err(e) if e.kind() == ErrorKind::InvalidInput => {
                    return Err(Error::InvalidArgument(format!(
                        "rendezvous store address {addr:?} is not host:port ({e})"
                    )));
                }
                // A name that does not resolve yet may resolve later (a service coming up).
                Err(e) => {
                    last_error = format!("resolving: {e}");
                    Vec::new()
                }
            };
            for a in resolved {
                match TcpStream::connect_timeout(&a, left.min(Duration::from_secs(5))) {
                    // With no listener yet on a port in the ephemeral range, the kernel can
                    // pick that very port as the source and connect the socket to itself
                    // (TCP simultaneous open): that is "not listening yet", not a store.
                    Ok(s) if s.local_addr().ok() == s.peer_addr().ok() => {
                        last_error = format!("{a}: connected to itself (no listener yet)");
                    }
                    Ok(mut s) => {
                        let left = deadline.saturating_duration_since(Instant::now());
                        prepare(&mut s, secret, left)?;
                        return Ok(TcpStore {
                            addr: a,
                            secret: secret.to_vec(),
                            io_timeout: timeout,
                            idle: Mutex::new(vec![s]),
                        });
                    }
                    Err(e) => last_error = format!("{a}: {e}"),
                }
            }
            thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
            backoff = (backoff * 2).min(Duration::from_millis(200));
        }
    }

    /// The server's address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Sends one request and returns the reply, on an idle pooled connection or a new one.
    /// `wait` is how long the server may legitimately take (a `get`'s timeout).
    fn request(&self, request: &[u8], wait: Duration) -> Result<Vec<u8>> {
        let pooled = self.idle.lock().pop();
        let mut stream = match pooled {
            Some(s) => s,
            None => {
                let mut s =
                    TcpStream::connect_timeout(&self.addr, self.io_timeout).map_err(|e| {
                        Error::Io(format!(
                            "connecting to the rendezvous store at {}: {e}",
                            self.addr
                        ))
                    })?;
                prepare(&mut s, &self.secret, self.io_timeout)?;
                s
            }
        };
        stream.set_write_timeout(Some(self.io_timeout))?;
        write_frame(&mut stream, request)?;
        let deadline = deadline_after(wait.saturating_add(self.io_timeout));
        let reply = read_frame_until(
            &mut stream,
            MAX_STORE_FRAME,
            deadline,
            "waiting for the rendezvous store to answer",
        )?;
        // Only a connection that completed a request cleanly goes back to the pool.
        self.idle.lock().push(stream);
        Ok(reply)
    }
}

fn prepare(s: &mut TcpStream, secret: &[u8], timeout: Duration) -> Result<()> {
    s.set_nodelay(true)?;
    authenticate(s, secret, true, timeout)
}

/// Decodes a reply's status byte; the `Ok` reader is positioned after it.
fn check_status<'a>(reply: &'a [u8], key: &str, timeout: Duration) -> Result<Reader<'a>> {
    let mut r = Reader::new(reply);
    match r.u8()? {
        ST_OK => Ok(r),
        ST_TIMEOUT => Err(Error::Timeout {
            what: format!("waiting for key {key:?} in the rendezvous store"),
            after: timeout,
        }),
        ST_INVALID => Err(Error::InvalidArgument(r.str()?.to_string())),
        ST_SHUTDOWN => Err(Error::Shutdown(r.str()?.to_string())),
        ST_BAD_REQUEST => Err(Error::Decode(format!(
            "the rendezvous store rejected a request: {}",
            r.str()?
        ))),
        s => Err(Error::Decode(format!("bad store reply status {s}"))),
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut w = Writer::new();
        w.u8(OP_SET).str(key).bytes(value);
        let reply = self.request(&w.finish(), Duration::ZERO)?;
        check_status(&reply, key, Duration::ZERO)?.finish()
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let ms = u64::try_from(timeout.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX);
        let mut w = Writer::new();
        w.u8(OP_GET).str(key).u64(ms);
        let reply = self.request(&w.finish(), timeout)?;
        let mut r = check_status(&reply, key, timeout)?;
        let value = r.bytes()?.to_vec();
        r.finish()?;
        Ok(value)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut w = Writer::new();
        w.u8(OP_ADD).str(key).i64(delta);
        let reply = self.request(&w.finish(), Duration::ZERO)?;
        let mut r = check_status(&reply, key, Duration::ZERO)?;
        let v = r.i64()?;
        r.finish()?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_refuses_what_is_not_host_port_at_once() {
        for bad in ["nohost:notaport", "1.2.3.4", "h:99999"] {
            let t0 = Instant::now();
            let e = TcpStore::connect(bad, b"secret", Duration::from_secs(30)).unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument(_)) && e.to_string().contains(bad),
                "{bad}: {e}"
            );
            assert!(t0.elapsed() < Duration::from_secs(1), "{bad}: retried");
        }
    }

    #[test]
    fn shutdown_with_a_silent_connection_open_returns() {
        let mut server =
            TcpStoreServer::start("127.0.0.1:0".parse().unwrap(), b"secret".to_vec()).unwrap();
        let silent = TcpStream::connect(server.local_addr()).unwrap();
        // Let the acceptor hand it to a client thread, which waits for the handshake.
        let t0 = Instant::now();
        while server.shared.clients.lock().is_empty() && t0.elapsed() < Duration::from_secs(5) {
            thread::sleep(Duration::from_millis(5));
        }
        let t0 = Instant::now();
        server.shutdown();
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        drop(silent);
    }
}
