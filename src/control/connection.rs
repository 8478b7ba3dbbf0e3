//! A framed, non-blocking control connection (u32 little-endian length + payload). The engine
//! and the coordinator poll these alongside other descriptors, so reads never block and
//! partial frames are kept until complete.
//!
//! Ranks on the coordinator's host talk to it through a pair of shared-memory rings (the shm
//! transport's [`ShmLink`]) whose Unix socket only rings and carries hang-up: a socket message
//! costs a system call on each side and a failed read for every poll that finds nothing, about
//! half a small op's time in the engine; a ring costs a few stores and loads. The price is that
//! a thread about to block must arm the ring first ([`FrameConn::arm`]), so that the writer
//! knows to ring.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::bootstrap::net::Stream;
use crate::error::{Error, Result};
use crate::transport::shm::ShmLink;

/// The socket under a control connection: TCP, or (for ranks on the coordinator's host) a
/// Unix socket, which costs about half as much per message as loopback TCP here (a busy-polled
/// round trip 15.6 µs against 28.3 µs in the same run); a small op pays one round trip.
#[derive(Debug)]
pub enum ControlStream {
    /// Across hosts.
    Tcp(TcpStream),
    /// Same host: the coordinator's abstract Unix socket.
    Unix(UnixStream),
    /// Same host, after set-up: rings in a shared segment (the socket under it rings).
    Shm(Box<ShmLink>),
}

impl ControlStream {
    fn shutdown(&mut self) {
        let _ = match self {
            ControlStream::Tcp(s) => s.shutdown(Shutdown::Both),
            ControlStream::Unix(s) => s.shutdown(Shutdown::Both),
            ControlStream::Shm(l) => {
                l.abort();
                Ok(())
            }
        };
    }
}

/// How long a thread with control output waiting may sleep before trying again.
pub const OUTPUT_RETRY: Duration = Duration::from_micros(200);

/// A ring's `PeerLost` as the I/O error a socket would give.
fn ring_error(e: Error) -> io::Error {
    io::Error::new(ErrorKind::BrokenPipe, e.to_string())
}

impl Read for ControlStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            ControlStream::Tcp(s) => s.read(buf),
            ControlStream::Unix(s) => s.read(buf),
            ControlStream::Shm(l) => match l.read_some(buf) {
                Ok(0) => Err(ErrorKind::WouldBlock.into()),
                Ok(n) => Ok(n),
                // The peer is gone and we have read everything it sent: end of stream.
                Err(_) => Ok(0),
            },
        }
    }
}

impl Write for ControlStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            ControlStream::Tcp(s) => s.write(buf),
            ControlStream::Unix(s) => s.write(buf),
            ControlStream::Shm(l) => match l.write_some(buf).map_err(ring_error)? {
                0 => Err(ErrorKind::WouldBlock.into()),
                n => Ok(n),
            },
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl AsRawFd for ControlStream {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            ControlStream::Tcp(s) => s.as_raw_fd(),
            ControlStream::Unix(s) => s.as_raw_fd(),
            ControlStream::Shm(l) => l.doorbell().as_raw_fd(),
        }
    }
}

impl Stream for ControlStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            ControlStream::Tcp(s) => s.set_read_timeout(t),
            ControlStream::Unix(s) => s.set_read_timeout(t),
            ControlStream::Shm(l) => l.doorbell().set_read_timeout(t),
        }
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            ControlStream::Tcp(s) => s.set_write_timeout(t),
            ControlStream::Unix(s) => s.set_write_timeout(t),
            ControlStream::Shm(l) => l.doorbell().set_write_timeout(t),
        }
    }
    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            ControlStream::Tcp(s) => s.set_nonblocking(on),
            ControlStream::Unix(s) => s.set_nonblocking(on),
            ControlStream::Shm(l) => l.doorbell().set_nonblocking(on),
        }
    }
}

/// Largest control frame accepted (responses for thousands of tensors fit easily).
pub const MAX_FRAME: usize = 256 << 20;

/// Control frames this process sent and received, on every connection (its engine's and, on
/// rank 0, the coordinator's): what negotiation costs each rank, for the scale benchmark.
static FRAMES_SENT: AtomicU64 = AtomicU64::new(0);
static FRAMES_RECEIVED: AtomicU64 = AtomicU64::new(0);
static BYTES_SENT: AtomicU64 = AtomicU64::new(0);
static BYTES_RECEIVED: AtomicU64 = AtomicU64::new(0);

/// `(sent, received)` control frames of this process so far (see [`FRAMES_SENT`]).
pub fn frames() -> (u64, u64) {
    (
        FRAMES_SENT.load(Ordering::Relaxed),
        FRAMES_RECEIVED.load(Ordering::Relaxed),
    )
}

/// `(sent, received)` bytes of those frames.
pub fn frame_bytes() -> (u64, u64) {
    (
        BYTES_SENT.load(Ordering::Relaxed),
        BYTES_RECEIVED.load(Ordering::Relaxed),
    )
}

/// One control connection to `peer`.
///
/// Sends never block: a frame the peer cannot take yet waits in `out` and goes out on later
/// [`FrameConn::flush`] calls. Both ends send and read on one thread, so a side that blocked
/// in a send could not read; with thousands of submissions in flight, the coordinator
/// blocked writing answers to a rank that was blocked in a collective waiting for a second
/// rank, itself blocked writing submissions to the coordinator: nobody moved until the
/// timeout called a rank dead.
#[derive(Debug)]
pub struct FrameConn {
    stream: ControlStream,
    /// Global rank at the other end (`usize::MAX` for the coordinator).
    pub peer: usize,
    buf: Vec<u8>,
    start: usize,
    /// Read buffer, zeroed once: a fresh 64 KiB array per read cost a memset on every poll, a
    /// fifth of a small op's CPU time.
    scratch: Box<[u8]>,
    /// Frames accepted by `send` and not yet written, from `out_start` on.
    out: Vec<u8>,
    out_start: usize,
    /// Since when the peer has taken none of `out`.
    stalled_since: Option<Instant>,
}

impl FrameConn {
    /// Wraps an authenticated stream and makes it non-blocking.
    pub fn new(stream: ControlStream, peer: usize) -> Result<FrameConn> {
        stream.set_nonblocking(true)?;
        if let ControlStream::Tcp(s) = &stream {
            s.set_nodelay(true)?;
        }
        Ok(FrameConn {
            stream,
            peer,
            buf: Vec::with_capacity(4096),
            start: 0,
            scratch: vec![0u8; 64 * 1024].into_boxed_slice(),
            out: Vec::with_capacity(4096),
            out_start: 0,
            stalled_since: None,
        })
    }

    /// The descriptor to poll.
    pub fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Queues one frame and writes as much of the queue as the connection takes now (see
    /// [`FrameConn::flush`]).
    pub fn send(&mut self, payload: &[u8], timeout: Duration) -> Result<()> {
        self.out
            .extend_from_slice(&(payload.len() as u32).to_le_bytes());
        self.out.extend_from_slice(payload);
        FRAMES_SENT.fetch_add(1, Ordering::Relaxed);
        BYTES_SENT.fetch_add(4 + payload.len() as u64, Ordering::Relaxed);
        self.flush(timeout).map(|_| ())
    }

    /// Writes queued frames until the connection takes no more, without blocking. Returns
    /// whether any bytes went out. A peer that has taken nothing for `timeout` while frames
    /// wait is `Timeout`.
    pub fn flush(&mut self, timeout: Duration) -> Result<bool> {
        let mut moved = false;
        while self.out_start < self.out.len() {
            match self.stream.write(&self.out[self.out_start..]) {
                Ok(0) => return Err(self.lost("connection closed")),
                Ok(n) => {
                    self.out_start += n;
                    self.stalled_since = None;
                    moved = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    // Drop what went out once it is most of the queue: under a steady flow
                    // that never drains completely the queue would otherwise only grow.
                    if self.out_start >= 64 * 1024 && 2 * self.out_start >= self.out.len() {
                        self.out.drain(..self.out_start);
                        self.out_start = 0;
                    }
                    let since = *self.stalled_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= timeout {
                        return Err(Error::Timeout {
                            what: format!("sending a control message to rank {}", self.peer),
                            after: timeout,
                        });
                    }
                    return Ok(moved);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::from_peer_io(self.peer, &e)),
            }
        }
        self.out.clear();
        self.out_start = 0;
        Ok(moved)
    }

    /// Whether frames wait to be written. Nothing tells a sleeper when the peer makes room:
    /// a thread with output waiting sleeps at most [`OUTPUT_RETRY`].
    pub fn has_output(&self) -> bool {
        self.out_start < self.out.len()
    }

    /// Writes every queued frame before returning, waiting (bounded by `timeout` without
    /// progress) while the peer's buffer is full; for a last message before closing.
    pub fn flush_all(&mut self, timeout: Duration) -> Result<()> {
        while {
            self.flush(timeout)?;
            self.has_output()
        } {
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Reads whatever is available without blocking. Returns `Ok(false)` at end of stream.
    pub fn fill(&mut self) -> Result<bool> {
        loop {
            match self.stream.read(&mut self.scratch) {
                Ok(0) => return Ok(false),
                Ok(n) => self.buf.extend_from_slice(&self.scratch[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::from_peer_io(self.peer, &e)),
            }
        }
    }

    /// Takes the next complete frame, if any.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>> {
        let avail = &self.buf[self.start..];
        if avail.len() < 4 {
            self.compact();
            return Ok(None);
        }
        let len = u32::from_le_bytes([avail[0], avail[1], avail[2], avail[3]]) as usize;
        if len > MAX_FRAME {
            return Err(Error::Decode(format!(
                "control frame of {len} bytes from rank {}",
                self.peer
            )));
        }
        if avail.len() < 4 + len {
            self.compact();
            return Ok(None);
        }
        let frame = avail[4..4 + len].to_vec();
        self.start += 4 + len;
        FRAMES_RECEIVED.fetch_add(1, Ordering::Relaxed);
        BYTES_RECEIVED.fetch_add(4 + len as u64, Ordering::Relaxed);
        Ok(Some(frame))
    }

    /// Shuts the connection down in both directions.
    pub fn close(&mut self) {
        self.stream.shutdown();
    }

    /// Whether input may be waiting without asking the kernel: bytes in the ring (or its
    /// peer gone). Sockets say false; poll their descriptor.
    pub fn has_input(&self) -> bool {
        match &self.stream {
            ControlStream::Shm(l) => l.readable(),
            _ => false,
        }
    }

    /// Whether this connection is a ring (its descriptor only rings).
    pub fn has_ring(&self) -> bool {
        matches!(self.stream, ControlStream::Shm(_))
    }

    /// Before blocking on [`FrameConn::fd`]: asks a ring's writer to ring the socket. Returns
    /// false when input is already waiting (do not block; [`FrameConn::disarm`] and read).
    pub fn arm(&self) -> bool {
        match &self.stream {
            ControlStream::Shm(l) => {
                l.arm();
                !l.readable()
            }
            _ => true,
        }
    }

    /// After a blocking wait (or instead of one): stops the writer ringing, and consumes the
    /// rings when `rang` (the descriptor polled readable), noticing a hang-up.
    pub fn disarm(&mut self, rang: bool) {
        if let ControlStream::Shm(l) = &mut self.stream {
            l.disarm();
            if rang {
                l.drain_doorbell(0);
            }
        }
    }

    /// Blocks until input may be waiting, for at most `timeout`.
    pub fn wait_readable(&mut self, timeout: Duration) -> Result<()> {
        if self.arm() {
            let ready = crate::sys::wait_readable(&[self.fd()], timeout);
            self.disarm(ready.as_ref().is_ok_and(|r| !r.is_empty()));
            ready?;
        } else {
            self.disarm(false);
        }
        Ok(())
    }

    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
    }

    fn lost(&self, detail: &str) -> Error {
        Error::PeerLost {
            rank: self.peer,
            detail: detail.into(),
        }
    }
}
