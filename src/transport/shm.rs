//! Shared-memory links between two ranks on the same host, used by
//! [`super::hybrid::HybridTransport`] in place of their TCP connection.
//!
//! **Segment.** One segment per pair of ranks: a 4 KiB header, the pair's *board* (one
//! record per side, for the engine's fast path: see `engine::fast` and [`BoardView`]), then
//! two single-producer / single-consumer byte rings, one per direction (ring 0 carries lower
//! rank → higher rank).
//! Each ring has a `tail` (bytes ever published, written by its producer) and a `head` (bytes
//! ever consumed, written by its consumer), monotonic `u64`s on cache lines of their own,
//! stored with `Release` and loaded with `Acquire`. Transfers stream through the ring in chunks
//! of at most [`CHUNK_BYTES`], so the consumer drains while the producer fills, and a message of
//! any size passes through a ring of any size. Every index a peer writes is range-checked
//! before use: a bad value is an error, never an access outside the mapping.
//!
//! **Waiting.** Each pair also has a *doorbell*: a connected Unix stream socket. A side that
//! can move nothing sets its `sleeping` flag in the header, issues a `SeqCst` fence, checks the
//! rings once more and only then blocks in `poll` on the doorbell. A side that publishes data or
//! frees space issues a `SeqCst` fence after its store and writes one byte to the doorbell if
//! (and only if) it sees the other side's flag set, clearing it. With a fence between flag
//! store and ring load on one side and between ring store and flag load on the other, at least
//! one side sees the other's store, so no wake-up is lost. The poll also sees `POLLHUP` as soon
//! as the peer *process* dies (the kernel closes its end), so a SIGKILLed peer is
//! `Error::PeerLost` as fast as over TCP; a peer that drops or aborts its transport also sets a
//! `closed` flag, noticed even while spinning.
//!
//! **Set-up and segment safety** (`ShmLink::establish`, run over the pair's authenticated TCP
//! connection). The lower rank creates the segment with `memfd_create`: it has no name in
//! `/dev/shm` or anywhere else, so nothing can stay behind, whatever kills the processes and
//! whenever; the memory is freed when the last mapping or descriptor goes. The descriptor
//! travels by `SCM_RIGHTS` over a Unix socket in the *abstract* namespace (again no file; the
//! name dies with its socket): the higher rank binds `ferrovod-shm-<128 random bits>` and sends
//! that name with a random 128-bit key over the authenticated TCP link; the lower rank connects,
//! sends the key with the descriptor, and that connection becomes the doorbell. The name is
//! visible to local users (`/proc/net/unix`), so connections that do not present the key are
//! dropped; two jobs cannot collide because names are random. The segment is sealed against
//! shrinking and growing, so a peer can never make our mapping fault. Rejected alternatives:
//! `pidfd_getfd` needs ptrace rights that Yama (`ptrace_scope=1`, the Ubuntu default) denies
//! between sibling processes; `shm_open` leaves a name in `/dev/shm` if a rank dies between
//! create and unlink. When the socket cannot be reached (ranks that share a host name but not
//! a network namespace) or memfd is unavailable, both sides agree to keep TCP for the pair.
//!
//! **Memory.** A pair maps `4 KiB + 136 KiB (board) + 2 × ring_bytes` (2 MiB by default), with
//! pages allocated only as transfers first reach them; `n` ranks on a host have `n·(n-1)/2` pairs.
//! memfd pages live on the kernel's internal tmpfs, so the size of a container's `/dev/shm` mount
//! (64 MiB by default under Docker) does not limit them; they count against the memory cgroup.
//!
//! All raw-pointer, `mmap` and `sendmsg`/`recvmsg` code is in the private `sys` module below.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Xfer;
use crate::bootstrap::net::{poll, poll_fd, read_exact_until, remaining, write_all_until, POLL_IN};
use crate::error::{Error, Result};
use crate::wire::{Reader, Writer};

/// Default bytes of each direction's ring. A smaller ring stays in cache: on 2 ranks, 1 MiB
/// against 4 MiB gave allreduces of 4 and 16 MiB 1.05-1.6x the bus bandwidth (the same at
/// other sizes) and allgathers from 4 MiB per rank 1.05-1.4x (there the larger rings, the
/// inputs and two generations of outputs no longer fit the last-level cache); broadcast was
/// about the same. 512 KiB was no better, 2 MiB worse at 1 MiB allreduces.
pub const DEFAULT_RING_BYTES: usize = 1 << 20;
/// Smallest ring accepted (tests use small rings to exercise wrap-around).
pub const MIN_RING_BYTES: usize = 64;
/// Largest ring accepted.
pub const MAX_RING_BYTES: usize = 1 << 30;
/// Most bytes copied before a publish: small enough that the peer starts draining early,
/// large enough that the per-publish fence and flag check cost nothing.
pub const CHUNK_BYTES: usize = 64 << 10;

/// Prefix of every name this module creates (memfd names, abstract socket names).
pub const NAME_PREFIX: &str = "ferrovod-shm";

/// Ring bytes per direction of a control connection: control messages are small, and a
/// larger one streams through.
pub const CONTROL_RING_BYTES: usize = 256 << 10;
const CONTROL_MAGIC: u64 = u64::from_le_bytes(*b"FVCTL001");
/// Magic, then ring bytes (0 and no descriptor: declined).
const CONTROL_OFFER_LEN: usize = 16;

const MAGIC: u64 = u64::from_le_bytes(*b"FVSHM001");
const OFFER_MAGIC: u32 = u32::from_le_bytes(*b"FVS1");
/// Magic, willing, ring bytes, listening, then name and key as length-prefixed byte strings.
const OFFER_LEN: usize = 4 + 1 + 8 + 1 + (4 + 16) + (4 + KEY_LEN);
const KEY_LEN: usize = 16;
/// Unverified connections to the set-up socket kept before giving up (someone is flooding it).
const MAX_PENDING: usize = 256;

// ---- segment layout ----
const PAGE: usize = 4096;
/// Header fields each own a 128-byte line (two cache lines: adjacent-line prefetch).
const LINE: usize = 128;
const HEADER: usize = PAGE;
const OFF_MAGIC: usize = 0;
const OFF_RING_BYTES: usize = 8;
const fn off_tail(ring: usize) -> usize {
    LINE * (1 + 2 * ring)
}
const fn off_head(ring: usize) -> usize {
    LINE * (2 + 2 * ring)
}
const fn off_sleeping(side: usize) -> usize {
    LINE * (5 + side)
}
const fn off_closed(side: usize) -> usize {
    LINE * (7 + side)
}
const _: () = assert!(off_closed(1) + LINE <= HEADER);
const _: () = assert!(LINE * (BoardWord::Rows as usize + 1) <= OFF_DESC_LEN);

fn ring_stride(cap: usize) -> usize {
    cap.div_ceil(PAGE) * PAGE
}

// ---- board (see `engine::fast`): one record per side, after the header ----
/// Payload bytes one side of a pair's board holds: the fast path's largest op.
pub const BOARD_DATA_BYTES: usize = 64 << 10;
/// A side's record: a page of words and descriptor, then the payload.
const BOARD_SIDE: usize = PAGE + BOARD_DATA_BYTES;
const BOARD: usize = HEADER;
const RINGS: usize = BOARD + 2 * BOARD_SIDE;
/// Offset of a board word (`BoardWord as usize` lines into a side's record).
const fn off_board(side: usize, word: BoardWord) -> usize {
    BOARD + side * BOARD_SIDE + LINE * word as usize
}
/// The descriptor: its length word, then its bytes up to the end of the record's first page.
const OFF_DESC_LEN: usize = LINE * 6;
const OFF_DESC: usize = LINE * 6 + 8;
/// Largest descriptor a board record holds.
pub const BOARD_DESC_BYTES: usize = PAGE - OFF_DESC;

/// The words of a side's board record, each on its own line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BoardWord {
    /// Slots this side has taken (`u64::MAX`: never again).
    Posted = 0,
    /// 1 + the slot of this side's current offer (0: none yet).
    Offer = 1,
    /// Slots below this one this side will never read again.
    Done = 2,
    /// Changes with every store above; its low 32 bits are the futex word peers sleep on.
    Bell = 3,
    /// This side sleeps on the other side's bell.
    Waiting = 4,
    /// Rows of the payload (an allgather's first dimension; written with the offer).
    Rows = 5,
}

fn segment_len(cap: usize) -> usize {
    RINGS + 2 * ring_stride(cap)
}

/// One end of a shared-memory link with one peer. Side 0 is the lower rank.
pub struct ShmLink {
    peer: usize,
    side: usize,
    /// Shared with this pair's [`BoardView`], which touches only the board.
    map: Arc<sys::Mapping>,
    cap: u64,
    chunk: usize,
    /// Byte offsets of the outbound and inbound rings' data.
    out_base: usize,
    in_base: usize,
    /// Producer state of the outbound ring: our tail, the last head we loaded.
    tail: u64,
    head_seen: u64,
    /// Consumer state of the inbound ring: our head, the last tail we loaded.
    head: u64,
    tail_seen: u64,
    doorbell: UnixStream,
    /// The doorbell reported end of stream, hang-up or an error: the peer process is gone.
    dead: bool,
}

impl std::fmt::Debug for ShmLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmLink")
            .field("peer", &self.peer)
            .field("ring_bytes", &self.cap)
            .field("dead", &self.dead)
            .finish()
    }
}

/// What each side announces first.
struct Offer {
    willing: bool,
    ring_bytes: usize,
    /// (higher rank) the set-up socket is bound: `name` and `key` are valid.
    listening: bool,
    name: [u8; 16],
    key: [u8; KEY_LEN],
}

impl Offer {
    fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(OFFER_MAGIC)
            .u8(self.willing as u8)
            .u64(self.ring_bytes as u64)
            .u8(self.listening as u8)
            .bytes(&self.name)
            .bytes(&self.key);
        w.finish()
    }

    fn decode(b: &[u8]) -> Result<Offer> {
        let mut r = Reader::new(b);
        if r.u32()? != OFFER_MAGIC {
            return Err(Error::Decode("bad shared-memory offer".into()));
        }
        let willing = r.u8()? != 0;
        let ring_bytes = r.usize()?;
        let listening = r.u8()? != 0;
        let bad = |_| Error::Decode("bad shared-memory offer".into());
        let name: [u8; 16] = r.bytes()?.try_into().map_err(bad)?;
        let key: [u8; KEY_LEN] = r.bytes()?.try_into().map_err(bad)?;
        r.finish()?;
        if willing && !(MIN_RING_BYTES..=MAX_RING_BYTES).contains(&ring_bytes) {
            return Err(Error::Decode(format!(
                "shared-memory offer with a ring of {ring_bytes} bytes"
            )));
        }
        Ok(Offer {
            willing,
            ring_bytes,
            listening,
            name,
            key,
        })
    }
}

fn random<const N: usize>() -> Result<[u8; N]> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| Error::Io(format!("getrandom: {e}")))?;
    Ok(b)
}

fn abstract_name(token: &[u8; 16]) -> String {
    random_name_with(NAME_PREFIX, token)
}

/// `prefix` and `token` in hex: a name for an abstract Unix socket.
pub(super) fn random_name_with(prefix: &str, token: &[u8; 16]) -> String {
    let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
    format!("{prefix}-{hex}")
}

/// A fresh unguessable name for an abstract Unix socket: `prefix` and 128 random bits in hex.
pub(crate) fn random_name(prefix: &str) -> Result<String> {
    Ok(random_name_with(prefix, &random::<16>()?))
}

fn write_all(sock: &mut UnixStream, bytes: &[u8]) -> Result<()> {
    sock.write_all(bytes)
        .map_err(|e| Error::Io(format!("setting up a control ring: {e}")))
}

/// Key comparison whose time does not depend on where the first difference is.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl ShmLink {
    /// Runs the set-up handshake with `peer` over `stream` (its authenticated TCP connection,
    /// in blocking mode). `ring_bytes` is `None` when this rank declines shared memory; the
    /// handshake still runs so that both sides agree. Returns the link, or `None` when the pair
    /// keeps TCP (either side declined, or the segment could not be shared: logged). The ring
    /// is the smaller of the two offers. Errors are failures of the TCP link or the deadline.
    pub(crate) fn establish(
        stream: &mut TcpStream,
        rank: usize,
        peer: usize,
        ring_bytes: Option<usize>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Option<ShmLink>> {
        debug_assert_ne!(rank, peer);
        let lower = rank < peer;
        let what = format!("setting up shared memory with rank {peer}");
        // The higher rank owns the set-up socket; bind it before announcing its name.
        let mut listener = None;
        let (name, key) = (random::<16>()?, random::<KEY_LEN>()?);
        if !lower && ring_bytes.is_some() {
            match UnixAddr::from_abstract_name(abstract_name(&name).as_bytes())
                .and_then(|a| UnixListener::bind_addr(&a))
                .and_then(|l| l.set_nonblocking(true).map(|()| l))
            {
                Ok(l) => listener = Some(l),
                Err(e) => log::warn!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: no shared memory with rank {peer}: binding a Unix socket: {e}"
                ),
            }
        }
        let mine = Offer {
            willing: ring_bytes.is_some(),
            ring_bytes: ring_bytes.unwrap_or(0),
            listening: listener.is_some(),
            name,
            key,
        };
        write_all_until(stream, &mine.encode(), deadline, &what)?;
        let mut buf = [0u8; OFFER_LEN];
        read_exact_until(stream, &mut buf, deadline, &what)?;
        let theirs = Offer::decode(&buf)?;
        if !(mine.willing && theirs.willing) {
            return Ok(None);
        }
        let cap = mine.ring_bytes.min(theirs.ring_bytes);
        let hi_listening = if lower {
            theirs.listening
        } else {
            mine.listening
        };
        if !hi_listening {
            return Ok(None);
        }
        let attempt = if lower {
            let attempt = Self::create_and_send(&theirs, cap);
            write_all_until(stream, &[attempt.is_ok() as u8], deadline, &what)?;
            let mut status = [0u8; 1];
            read_exact_until(stream, &mut status, deadline, &what)?;
            match (attempt, status[0]) {
                (Ok(parts), 1) => Ok(parts),
                (Ok(_), _) => Err("the peer could not map the segment".to_string()),
                (Err(e), _) => Err(e),
            }
        } else {
            let listener = listener.as_ref().expect("bound above");
            let wait = (deadline, timeout, what.as_str());
            let attempt = Self::receive_and_map(stream, listener, &key, cap, wait)?;
            write_all_until(stream, &[attempt.is_ok() as u8], deadline, &what)?;
            attempt
        };
        match attempt {
            Ok((map, doorbell)) => Ok(Some(Self::over(
                map,
                doorbell,
                peer,
                usize::from(!lower),
                cap,
            )?)),
            Err(why) => {
                log::warn!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: keeping TCP for rank {peer}, shared memory failed: {why}"
                );
                Ok(None)
            }
        }
    }

    /// A link over a mapped segment of `cap`-byte rings; `side` 0 created it.
    fn over(
        map: sys::Mapping,
        doorbell: UnixStream,
        peer: usize,
        side: usize,
        cap: usize,
    ) -> Result<ShmLink> {
        doorbell.set_nonblocking(true)?;
        let stride = ring_stride(cap);
        Ok(ShmLink {
            peer,
            side,
            map: Arc::new(map),
            cap: cap as u64,
            chunk: CHUNK_BYTES.min(cap.div_ceil(4)),
            out_base: RINGS + side * stride,
            in_base: RINGS + (1 - side) * stride,
            tail: 0,
            head_seen: 0,
            head: 0,
            tail_seen: 0,
            doorbell,
            dead: false,
        })
    }

    /// A new segment of `cap`-byte rings with its header written: its descriptor and mapping.
    fn new_segment(cap: usize) -> std::result::Result<(OwnedFd, sys::Mapping), String> {
        let (fd, map) =
            sys::Mapping::create(segment_len(cap)).map_err(|e| format!("memfd segment: {e}"))?;
        map.atomic(OFF_RING_BYTES)
            .store(cap as u64, Ordering::Relaxed);
        map.atomic(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok((fd, map))
    }

    /// Maps a received segment and checks its header.
    fn map_segment(fd: OwnedFd, cap: usize) -> std::result::Result<sys::Mapping, String> {
        let map = sys::Mapping::open(fd, segment_len(cap))
            .map_err(|e| format!("mapping the segment: {e}"))?;
        let magic = map.atomic(OFF_MAGIC).load(Ordering::Acquire);
        let ring = map.atomic(OFF_RING_BYTES).load(Ordering::Relaxed);
        if magic == MAGIC && ring == cap as u64 {
            Ok(map)
        } else {
            Err(format!("bad segment header ({magic:#x}, {ring} bytes)"))
        }
    }

    /// Control connections (see `engine::control`), client side: over `sock`, an already
    /// authenticated Unix connection to the coordinator, offers a segment of `cap`-byte rings
    /// (`None`: declines), and waits for the answer. The socket then only rings and watches
    /// for hang-up. `Ok(None)`: keep the plain socket.
    pub(crate) fn offer_control(
        sock: &mut UnixStream,
        cap: Option<usize>,
        timeout: Duration,
    ) -> Result<Option<ShmLink>> {
        let segment = cap.map(|cap| (cap, Self::new_segment(cap)));
        let mut offer = [0u8; CONTROL_OFFER_LEN];
        offer[..8].copy_from_slice(&CONTROL_MAGIC.to_le_bytes());
        match &segment {
            Some((cap, Ok((fd, _)))) => {
                offer[8..].copy_from_slice(&(*cap as u64).to_le_bytes());
                sys::send_with_fd(sock, &offer, fd)?;
            }
            Some((_, Err(why))) => {
                log::debug!(target: crate::LOG_TARGET, "control over a socket: {why}");
                write_all(sock, &offer)?;
            }
            None => write_all(sock, &offer)?,
        }
        sock.set_read_timeout(Some(timeout))?;
        let mut status = [0u8; 1];
        sock.read_exact(&mut status)
            .map_err(|e| Error::from_peer_io(0, &e))?;
        sock.set_read_timeout(None)?;
        match (segment, status[0]) {
            (Some((cap, Ok((_, map)))), 1) => {
                Ok(Some(Self::over(map, sock.try_clone()?, 0, 0, cap)?))
            }
            _ => Ok(None),
        }
    }

    /// Control connections, coordinator side: receives the offer [`ShmLink::offer_control`]
    /// sent on `sock` (from global rank `rank`), maps the segment and answers. `Ok(None)`: the
    /// client declined or the segment was unusable (logged); the plain socket stays.
    pub(crate) fn accept_control(
        sock: &mut UnixStream,
        rank: usize,
        timeout: Duration,
    ) -> Result<Option<ShmLink>> {
        let deadline = Instant::now() + timeout;
        let what = format!("waiting for rank {rank}'s control offer");
        let mut offer = [0u8; CONTROL_OFFER_LEN];
        let (n, fd) = loop {
            let left = remaining(deadline, &what, timeout)?;
            let mut fds = [poll_fd(&*sock, POLL_IN)];
            poll(&mut fds, Some(left))?;
            match sys::recv_with_fd(sock, &mut offer) {
                Ok(got) => break got,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
                Err(e) => return Err(Error::from_peer_io(rank, &e)),
            }
        };
        if n != CONTROL_OFFER_LEN || offer[..8] != CONTROL_MAGIC.to_le_bytes() {
            return Err(Error::Decode(format!("bad control offer from rank {rank}")));
        }
        let cap = u64::from_le_bytes(offer[8..].try_into().expect("8 bytes")) as usize;
        let mapped = match fd {
            Some(fd) if (MIN_RING_BYTES..=MAX_RING_BYTES).contains(&cap) => {
                Self::map_segment(fd, cap).map(Some)
            }
            Some(_) => Err(format!("a control ring of {cap} bytes")),
            None => Ok(None),
        };
        let mapped = mapped.unwrap_or_else(|why| {
            log::warn!(
                target: crate::LOG_TARGET,
                "control connection of rank {rank} stays on its socket: {why}"
            );
            None
        });
        write_all(sock, &[u8::from(mapped.is_some())])?;
        match mapped {
            Some(map) => Ok(Some(Self::over(map, sock.try_clone()?, rank, 1, cap)?)),
            None => Ok(None),
        }
    }

    /// Bytes waiting in the inbound ring, or the peer gone; no system call.
    pub(crate) fn readable(&self) -> bool {
        self.ready(false)
    }

    /// Moves bytes of `buf` into the outbound ring; how many (0: full).
    pub(crate) fn write_some(&mut self, buf: &[u8]) -> Result<usize> {
        let mut off = 0;
        self.send(buf, &mut off)?;
        Ok(off)
    }

    /// Moves waiting bytes into `buf`; how many (0: none yet). Once the peer has gone and its
    /// last bytes are read, `PeerLost`.
    pub(crate) fn read_some(&mut self, buf: &mut [u8]) -> Result<usize> {
        let mut off = 0;
        self.recv(buf, &mut off)?;
        Ok(off)
    }

    /// Lower rank: creates and initialises the segment, then hands its descriptor to the
    /// higher rank's set-up socket along with the key. The connection is the doorbell.
    fn create_and_send(
        theirs: &Offer,
        cap: usize,
    ) -> std::result::Result<(sys::Mapping, UnixStream), String> {
        let (fd, map) = Self::new_segment(cap)?;
        let addr = UnixAddr::from_abstract_name(abstract_name(&theirs.name).as_bytes())
            .map_err(|e| e.to_string())?;
        let sock = UnixStream::connect_addr(&addr)
            .map_err(|e| format!("connecting to the peer's Unix socket: {e}"))?;
        sys::send_with_fd(&sock, &theirs.key, &fd)
            .map_err(|e| format!("passing the segment: {e}"))?;
        Ok((map, sock))
    }

    /// Higher rank: waits for the lower rank's status on `stream` while accepting set-up
    /// connections, then maps the descriptor from the one that presents `key`.
    /// `Err(_)`: the TCP link failed or the deadline passed; `Ok(Err(why))`: fall back to TCP.
    fn receive_and_map(
        stream: &mut TcpStream,
        listener: &UnixListener,
        key: &[u8; KEY_LEN],
        cap: usize,
        (deadline, timeout, what): (Instant, Duration, &str),
    ) -> Result<std::result::Result<(sys::Mapping, UnixStream), String>> {
        let mut pending: Vec<UnixStream> = Vec::new();
        let accept_all = |pending: &mut Vec<UnixStream>| loop {
            match listener.accept() {
                Ok((s, _)) => pending.push(s),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        };
        // The lower rank sends its descriptor before its status, so once the status is here
        // its connection and message are queued: no waiting on the Unix side after that.
        loop {
            let left = remaining(deadline, what, timeout)?;
            let mut fds = [poll_fd(stream, POLL_IN), poll_fd(listener, POLL_IN)];
            poll(&mut fds, Some(left))?;
            if fds[1].revents != 0 {
                accept_all(&mut pending);
                if pending.len() > MAX_PENDING {
                    // Someone floods the socket; answer the status first, then give up.
                    let mut status = [0u8; 1];
                    read_exact_until(stream, &mut status, deadline, what)?;
                    return Ok(Err("too many connections to the set-up socket".into()));
                }
            }
            if fds[0].revents != 0 {
                break;
            }
        }
        let mut status = [0u8; 1];
        read_exact_until(stream, &mut status, deadline, what)?;
        if status[0] != 1 {
            return Ok(Err("the peer could not create or send the segment".into()));
        }
        accept_all(&mut pending);
        for s in pending {
            let mut msg = [0u8; KEY_LEN + 1];
            match sys::recv_with_fd(&s, &mut msg) {
                Ok((n, Some(fd))) if n == KEY_LEN && same_key(&msg[..n], key) => {
                    return Ok(Self::map_segment(fd, cap).map(|map| (map, s)));
                }
                // A stranger (or a message without a descriptor): drop it, closing any fd.
                _ => {}
            }
        }
        Ok(Err("no set-up connection presented the key".into()))
    }

    fn at(&self, off: usize) -> &AtomicU64 {
        self.map.atomic(off)
    }

    fn lost(&self, detail: &str) -> Error {
        Error::PeerLost {
            rank: self.peer,
            detail: detail.to_string(),
        }
    }

    fn peer_closed(&self) -> bool {
        self.at(off_closed(1 - self.side)).load(Ordering::Acquire) != 0
    }

    /// The peer's head of our outbound ring, checked: it may only advance, and not past our
    /// tail.
    fn load_head(&self) -> Result<u64> {
        let h = self.at(off_head(self.side)).load(Ordering::Acquire);
        if h < self.head_seen || h > self.tail {
            return Err(self.lost("shared-memory ring corrupted (bad head)"));
        }
        Ok(h)
    }

    /// The peer's tail of our inbound ring, checked: it may only advance, and at most one
    /// ring ahead of our head.
    fn load_tail(&self) -> Result<u64> {
        let t = self.at(off_tail(1 - self.side)).load(Ordering::Acquire);
        if t < self.tail_seen || t - self.head > self.cap {
            return Err(self.lost("shared-memory ring corrupted (bad tail)"));
        }
        Ok(t)
    }

    /// Rings the doorbell if the peer sleeps. The fence orders our ring store before the
    /// flag load (the peer fences between its flag store and ring load).
    fn wake_peer(&self) {
        fence(Ordering::SeqCst);
        let flag = self.at(off_sleeping(1 - self.side));
        if flag.load(Ordering::Relaxed) != 0 && flag.swap(0, Ordering::AcqRel) != 0 {
            // WouldBlock means unread bytes are there already, which wakes the peer as well;
            // EPIPE means it is gone, which our own poll will tell.
            let _ = sys::send_nosignal(&self.doorbell, &[1]);
        }
    }

    /// Moves as many bytes of `x` as the rings allow right now, advancing `off`; returns
    /// whether any byte moved. Sending to a peer that closed or died is `PeerLost`; receiving
    /// is, once the bytes it published before going are consumed.
    pub(crate) fn progress(&mut self, x: &mut Xfer<'_>, off: &mut usize) -> Result<bool> {
        match x {
            Xfer::Send { buf, .. } => self.send(buf, off),
            Xfer::Recv { buf, .. } => self.recv(buf, off),
        }
    }

    fn send(&mut self, buf: &[u8], off: &mut usize) -> Result<bool> {
        if self.dead || self.peer_closed() {
            return Err(self.lost("shared-memory link closed (the peer exited or aborted)"));
        }
        // At most one ring's worth per call, so that a peer draining as fast as we fill
        // cannot keep the other transfers of the exchange waiting.
        let start = *off;
        while *off < buf.len() && ((*off - start) as u64) < self.cap {
            let want = (buf.len() - *off).min(self.chunk) as u64;
            if self.cap - (self.tail - self.head_seen) < want {
                self.head_seen = self.load_head()?;
            }
            let n = want.min(self.cap - (self.tail - self.head_seen)) as usize;
            if n == 0 {
                break;
            }
            let src = &buf[*off..*off + n];
            let pos = (self.tail % self.cap) as usize;
            let first = n.min(self.cap as usize - pos);
            self.map.write(self.out_base + pos, &src[..first]);
            self.map.write(self.out_base, &src[first..]);
            self.tail += n as u64;
            self.at(off_tail(self.side))
                .store(self.tail, Ordering::Release);
            *off += n;
            self.wake_peer();
        }
        Ok(*off > start)
    }

    fn recv(&mut self, buf: &mut [u8], off: &mut usize) -> Result<bool> {
        let start = *off;
        while *off < buf.len() && ((*off - start) as u64) < self.cap {
            let want = (buf.len() - *off).min(self.chunk) as u64;
            if self.tail_seen - self.head < want {
                self.tail_seen = self.load_tail()?;
            }
            let n = want.min(self.tail_seen - self.head) as usize;
            if n == 0 {
                // Bytes published before the peer went are still ours to read, and those
                // moved by this call are reported before the closure is (on the next call).
                if *off == start && (self.dead || self.peer_closed()) {
                    self.tail_seen = self.load_tail()?;
                    if self.tail_seen == self.head {
                        return Err(
                            self.lost("shared-memory link closed (the peer exited or aborted)")
                        );
                    }
                    continue;
                }
                break;
            }
            let dst = &mut buf[*off..*off + n];
            let pos = (self.head % self.cap) as usize;
            let first = n.min(self.cap as usize - pos);
            self.map.read(self.in_base + pos, &mut dst[..first]);
            self.map.read(self.in_base, &mut dst[first..]);
            self.head += n as u64;
            self.at(off_head(1 - self.side))
                .store(self.head, Ordering::Release);
            *off += n;
            self.wake_peer();
        }
        Ok(*off > start)
    }

    /// Announces that this side is about to sleep on the doorbell. Must be followed by
    /// [`ShmLink::ready`] checks before blocking, and by [`ShmLink::disarm`] after.
    pub(crate) fn arm(&self) {
        self.at(off_sleeping(self.side)).store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Clears this side's sleeping flag.
    pub(crate) fn disarm(&self) {
        self.at(off_sleeping(self.side)).store(0, Ordering::Relaxed);
    }

    /// Whether a transfer in direction `send` could move now (or would fail): space in the
    /// outbound ring, bytes in the inbound one, or the peer gone.
    pub(crate) fn ready(&self, send: bool) -> bool {
        if self.dead || self.peer_closed() {
            return true;
        }
        if send {
            let h = self.at(off_head(self.side)).load(Ordering::Acquire);
            h != self.tail.wrapping_sub(self.cap)
        } else {
            self.at(off_tail(1 - self.side)).load(Ordering::Acquire) != self.head
        }
    }

    /// The descriptor to poll (readable on a wake-up byte, hang-up when the peer dies).
    pub(crate) fn doorbell(&self) -> &UnixStream {
        &self.doorbell
    }

    /// Consumes wake-up bytes after `poll` reported `revents` on the doorbell; end of stream,
    /// hang-up or an error marks the peer dead.
    pub(crate) fn drain_doorbell(&mut self, revents: i16) {
        if revents & (libc::POLLHUP | libc::POLLERR) != 0 {
            self.dead = true;
        }
        let mut sink = [0u8; 64];
        loop {
            match (&self.doorbell).read(&mut sink) {
                Ok(0) => {
                    self.dead = true;
                    break;
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    self.dead = true;
                    break;
                }
            }
        }
    }

    /// Makes the peer fail fast: sets our `closed` flag and shuts the doorbell down.
    pub(crate) fn abort(&mut self) {
        self.at(off_closed(self.side)).store(1, Ordering::Release);
        // Already dead or shut down: nothing more to do for it.
        let _ = self.doorbell.shutdown(Shutdown::Both);
    }
}

impl ShmLink {
    /// This pair's board, for the engine's fast path (see `engine::fast`): usable from any
    /// thread, alive as long as the view even after the link is dropped.
    pub(crate) fn board(&self) -> Result<BoardView> {
        Ok(BoardView {
            peer: self.peer,
            side: self.side,
            map: self.map.clone(),
            hangup: self.doorbell.try_clone()?,
        })
    }
}

/// One pair's board as this rank sees it: its own record (written only by this rank's fast
/// path, under its lock) and the peer's (read only). The peer's words are untrusted: lengths
/// are range-checked before use.
pub(crate) struct BoardView {
    peer: usize,
    side: usize,
    map: Arc<sys::Mapping>,
    /// A second descriptor of the doorbell, only ever polled for hang-up (never read: the
    /// link owns the wake-up bytes).
    hangup: UnixStream,
}

impl std::fmt::Debug for BoardView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoardView")
            .field("peer", &self.peer)
            .finish()
    }
}

impl BoardView {
    /// The peer's global rank.
    pub(crate) fn peer(&self) -> usize {
        self.peer
    }

    /// One of this rank's words.
    pub(crate) fn mine(&self, w: BoardWord) -> &AtomicU64 {
        self.map.atomic(off_board(self.side, w))
    }

    /// One of the peer's words.
    pub(crate) fn theirs(&self, w: BoardWord) -> &AtomicU64 {
        self.map.atomic(off_board(1 - self.side, w))
    }

    /// Writes this rank's descriptor and payload (before it publishes `Offer` and `Posted`).
    pub(crate) fn write_offer(&self, desc: &[u8], data: &[u8]) {
        assert!(desc.len() <= BOARD_DESC_BYTES && data.len() <= BOARD_DATA_BYTES);
        let base = BOARD + self.side * BOARD_SIDE;
        self.map.write(base + OFF_DESC, desc);
        self.map
            .atomic(base + OFF_DESC_LEN)
            .store(desc.len() as u64, Ordering::Relaxed);
        self.map.write(base + PAGE, data);
    }

    /// Whether the peer's descriptor equals `desc` (read after its `Posted` was seen with
    /// `Acquire`).
    pub(crate) fn same_desc(&self, desc: &[u8], scratch: &mut [u8]) -> bool {
        let base = BOARD + (1 - self.side) * BOARD_SIDE;
        let len = self.map.atomic(base + OFF_DESC_LEN).load(Ordering::Relaxed);
        if len != desc.len() as u64 || desc.len() > scratch.len() {
            return false;
        }
        self.map.read(base + OFF_DESC, &mut scratch[..desc.len()]);
        scratch[..desc.len()] == *desc
    }

    /// Copies the first `dst.len()` bytes of the peer's payload.
    pub(crate) fn read_data(&self, dst: &mut [u8]) {
        self.read_data_at(0, dst);
    }

    /// Copies `dst.len()` bytes of the peer's payload from byte `at` on.
    pub(crate) fn read_data_at(&self, at: usize, dst: &mut [u8]) {
        assert!(at.saturating_add(dst.len()) <= BOARD_DATA_BYTES);
        self.map
            .read(BOARD + (1 - self.side) * BOARD_SIDE + PAGE + at, dst);
    }

    /// Bumps this rank's bell after its words changed and wakes the peer if it sleeps on it.
    /// The `SeqCst` fence pairs with the one in [`BoardView::sleep`]: either the peer sees
    /// the new words before sleeping, or this side sees its `Waiting` flag.
    pub(crate) fn ring(&self) {
        let bell = self.mine(BoardWord::Bell);
        bell.fetch_add(1, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.theirs(BoardWord::Waiting).swap(0, Ordering::Relaxed) != 0 {
            sys::futex_wake(self.bell_word(self.side));
        }
    }

    /// The low half of a side's bell, as a futex word.
    fn bell_word(&self, side: usize) -> &AtomicU32 {
        self.map.atomic32(off_board(side, BoardWord::Bell))
    }

    /// Sleeps until the peer rings (or `timeout`), unless `ready` turns true once this rank
    /// has announced its sleep. Returns whether the peer's process is gone (its doorbell
    /// hung up or it set its `closed` flag).
    pub(crate) fn sleep(&self, ready: impl Fn() -> bool, timeout: Duration) -> bool {
        let seen = self.bell_word(1 - self.side).load(Ordering::Acquire);
        self.mine(BoardWord::Waiting).store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if !ready() {
            sys::futex_wait(self.bell_word(1 - self.side), seen, timeout);
        }
        self.mine(BoardWord::Waiting).store(0, Ordering::Relaxed);
        self.peer_gone()
    }

    /// The peer's process has gone (or dropped its link): nothing more will come.
    pub(crate) fn peer_gone(&self) -> bool {
        if self
            .map
            .atomic(off_closed(1 - self.side))
            .load(Ordering::Acquire)
            != 0
        {
            return true;
        }
        let mut fds = [poll_fd(&self.hangup, 0)];
        matches!(poll(&mut fds, Some(Duration::ZERO)), Ok(n) if n > 0)
            && fds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        // A peer spinning on our rings notices the flag without a system call; one blocked in
        // poll sees the doorbell close right after.
        self.at(off_closed(self.side)).store(1, Ordering::Release);
    }
}

/// The only `unsafe` of the shared-memory transport: memfd + mmap, copies into and out of the
/// mapping, and descriptor passing.
pub(super) mod sys {
    use std::fs::File;
    use std::io;
    use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
    use std::os::unix::net::UnixStream;
    use std::ptr::NonNull;
    use std::sync::atomic::{AtomicU32, AtomicU64};
    use std::time::Duration;

    fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(rc)
        }
    }

    /// A shared, read-write mapping of a whole memfd segment, unmapped on drop.
    ///
    /// Within this process the link's thread touches the rings and the pair's board view the
    /// board (see the `Sync` impl), so the copies below never race with each other. The *other* process writes the same pages
    /// concurrently, but only regions the ring protocol gives it (the other ring half and
    /// its own header words): the bytes we copy are ones the peer published and will not
    /// touch until we advance our head. A misbehaving peer could only corrupt payload bytes
    /// (any bit pattern is a valid `u8`); indices it writes are range-checked by the caller.
    pub(in crate::transport) struct Mapping {
        ptr: NonNull<u8>,
        len: usize,
    }

    // SAFETY: the mapping is plain memory owned by this value (like a `Box<[u8]>`); moving it
    // to another thread moves the only handle to it.
    unsafe impl Send for Mapping {}
    // SAFETY: shared between a link (its owning thread touches only the rings and the header)
    // and that pair's board view (touched only by the fast path, under its lock): the two
    // never copy into or out of the same bytes, and the words they share are atomics. That
    // is the same discipline the two processes follow with each other (see above).
    unsafe impl Sync for Mapping {}

    impl Mapping {
        /// A new sealed memfd of `len` zero bytes, and its mapping (not inherited by a fork).
        pub(in crate::transport) fn create(len: usize) -> io::Result<(OwnedFd, Mapping)> {
            Self::create_with(len, false)
        }

        /// [`Mapping::create`]; `inherit`: a forked child keeps the mapping (memory that
        /// torch tensors view, which a data-loader worker's copy of them may touch).
        pub(in crate::transport) fn create_with(
            len: usize,
            inherit: bool,
        ) -> io::Result<(OwnedFd, Mapping)> {
            let name = std::ffi::CString::new(super::NAME_PREFIX).expect("no NUL in the prefix");
            // SAFETY: `name` is a valid NUL-terminated string that outlives the call; the flags
            // are plain integers. A negative return is handled.
            let fd = cvt(unsafe {
                libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
            })?;
            // SAFETY: `fd` was just returned by memfd_create, is open and owned by nobody else.
            let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
            file.set_len(len as u64)?;
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            // SAFETY: fcntl on our own open descriptor with an integer argument.
            cvt(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) })?;
            let map = Self::map(file.as_fd(), len, inherit)?;
            Ok((OwnedFd::from(file), map))
        }

        /// Maps a segment received from a peer, after checking that it is exactly `len` bytes
        /// and sealed against shrinking (a shrink would turn our accesses into SIGBUS). The
        /// descriptor is closed on return; the mapping keeps the memory alive.
        pub(in crate::transport) fn open(fd: OwnedFd, len: usize) -> io::Result<Mapping> {
            Self::open_with(fd, len, false)
        }

        /// [`Mapping::open`]; `inherit` as for [`Mapping::create_with`].
        pub(in crate::transport) fn open_with(
            fd: OwnedFd,
            len: usize,
            inherit: bool,
        ) -> io::Result<Mapping> {
            let file = File::from(fd);
            let size = file.metadata()?.len();
            if size != len as u64 {
                return Err(io::Error::other(format!(
                    "segment has {size} bytes, expected {len}"
                )));
            }
            // SAFETY: fcntl on an open descriptor we own, no pointer argument.
            let seals = cvt(unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) })?;
            let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
            if seals & need != need {
                return Err(io::Error::other("segment is not sealed against resizing"));
            }
            Self::map(file.as_fd(), len, inherit)
        }

        fn map(fd: BorrowedFd<'_>, len: usize, inherit: bool) -> io::Result<Mapping> {
            // SAFETY: a fresh shared mapping chosen by the kernel (null hint) of an open
            // descriptor whose size is at least `len` (set or checked by the callers, and
            // sealed); it aliases no Rust object. MAP_FAILED is handled.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let map = Mapping {
                ptr: NonNull::new(p.cast()).expect("mmap returned null without MAP_FIXED"),
                len,
            };
            if !inherit {
                // A forked child (a data-loader worker) must not inherit a writable view of
                // the rings. Advice only: failure changes nothing else.
                // SAFETY: the range is exactly the mapping created above.
                unsafe { libc::madvise(p, len, libc::MADV_DONTFORK) };
            }
            Ok(map)
        }

        /// Bytes mapped.
        pub(in crate::transport) fn len(&self) -> usize {
            self.len
        }

        /// The first mapped byte (the mapping lives as long as `self`).
        pub(in crate::transport) fn as_ptr(&self) -> *mut u8 {
            self.ptr.as_ptr()
        }

        /// The 8-byte header word at `off`.
        pub(super) fn atomic(&self, off: usize) -> &AtomicU64 {
            assert!(off % 8 == 0 && off + 8 <= self.len, "header offset {off}");
            // SAFETY: in bounds and 8-aligned (the mapping is page-aligned) as asserted; the
            // memory lives as long as `self`. AtomicU64 has interior mutability, so other
            // processes changing the word concurrently is exactly what atomics allow, and
            // any bit pattern is a valid u64.
            unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() }
        }

        /// The 4-byte word at `off` (a futex word).
        pub(super) fn atomic32(&self, off: usize) -> &AtomicU32 {
            assert!(off % 4 == 0 && off + 4 <= self.len, "header offset {off}");
            // SAFETY: as for `atomic`, with a 4-aligned in-bounds u32.
            unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() }
        }

        /// Copies `src` into the mapping at `off`.
        pub(super) fn write(&self, off: usize, src: &[u8]) {
            assert!(
                off <= self.len && src.len() <= self.len - off,
                "write out of range"
            );
            // SAFETY: the destination range is inside the mapping (asserted) and cannot overlap
            // `src`, a Rust slice outside it; no reference to this range exists (see the type's
            // doc for the peer's side).
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(off), src.len())
            };
        }

        /// Copies from the mapping at `off` into `dst`.
        pub(super) fn read(&self, off: usize, dst: &mut [u8]) {
            assert!(
                off <= self.len && dst.len() <= self.len - off,
                "read out of range"
            );
            // SAFETY: as for `write`, with the source inside the mapping and `dst` an exclusive
            // Rust slice outside it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.ptr.as_ptr().add(off),
                    dst.as_mut_ptr(),
                    dst.len(),
                )
            };
        }
    }

    impl Drop for Mapping {
        fn drop(&mut self) {
            // SAFETY: unmaps exactly the range mapped in `map`, once; references handed out by
            // `atomic` borrow `self` and so are gone.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }

    /// Blocks while `word` holds `seen`, at most `timeout` (a shared futex: the word is in a
    /// mapping other processes share). Spurious returns are fine: callers re-check.
    pub(super) fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        // SAFETY: FUTEX_WAIT reads the aligned u32 behind `word` (alive for the call) and
        // sleeps; `ts` outlives the call; the unused arguments are null/0.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                0u32,
            )
        };
    }

    /// Wakes every thread (of any process) sleeping on `word`.
    pub(super) fn futex_wake(word: &AtomicU32) {
        // SAFETY: FUTEX_WAKE only uses the address as a key; the other arguments are plain.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            )
        };
    }

    /// Sends `payload` with one descriptor attached (SCM_RIGHTS).
    pub(in crate::transport) fn send_with_fd(
        sock: &UnixStream,
        payload: &[u8],
        fd: &OwnedFd,
    ) -> io::Result<()> {
        let mut iov = libc::iovec {
            iov_base: payload.as_ptr() as *mut libc::c_void,
            iov_len: payload.len(),
        };
        // u64 storage keeps the control buffer aligned for cmsghdr.
        let mut control = [0u64; 8];
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) };
        assert!(space as usize <= std::mem::size_of_val(&control));
        // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as usize;
        // SAFETY: `msg` points at `control`, large enough for one header with one int (checked
        // above), so CMSG_FIRSTHDR is non-null and CMSG_DATA is inside `control`; the data is
        // written unaligned-safe. sendmsg only reads `payload` (through `iov`) and `control`,
        // both alive for the call.
        let sent = unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd.as_raw_fd());
            libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        if sent as usize != payload.len() {
            return Err(io::Error::other("short sendmsg"));
        }
        Ok(())
    }

    /// Receives one message without waiting: (bytes, the first descriptor attached). Any
    /// other descriptors are closed. `WouldBlock` when nothing is queued.
    pub(in crate::transport) fn recv_with_fd(
        sock: &UnixStream,
        buf: &mut [u8],
    ) -> io::Result<(usize, Option<OwnedFd>)> {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let mut control = [0u64; 16];
        // SAFETY: an all-zero msghdr is valid (null pointers, zero lengths).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control);
        let flags = libc::MSG_DONTWAIT | libc::MSG_CMSG_CLOEXEC;
        // SAFETY: `iov` describes `buf`, exclusively borrowed, and `msg_control` describes
        // `control`; the kernel writes within those lengths only.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, flags) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut first = None;
        // SAFETY: walks the control messages the kernel wrote into `control` with the CMSG_*
        // macros, which stay within `msg_controllen`; each SCM_RIGHTS payload holds
        // `(cmsg_len - CMSG_LEN(0)) / sizeof(int)` descriptors now owned by this process, each
        // read unaligned and wrapped exactly once (so every one is closed unless kept).
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                    let bytes = (*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize;
                    for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                        let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                        if first.is_none() {
                            first = Some(fd);
                        }
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok((n as usize, first))
    }

    /// Writes `bytes` without blocking and without SIGPIPE if the peer is gone.
    pub(super) fn send_nosignal(sock: &UnixStream, bytes: &[u8]) -> io::Result<usize> {
        // SAFETY: send only reads `bytes`, alive for the call.
        let n = unsafe {
            libc::send(
                sock.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::time::Duration;

    /// A linked pair (rank 0, rank 1) over a real loopback TCP connection.
    fn pair(ring: usize) -> (ShmLink, ShmLink) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = Duration::from_secs(10);
        let deadline = Instant::now() + t;
        let hi = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            ShmLink::establish(&mut s, 1, 0, Some(ring), deadline, t).unwrap()
        });
        let mut s = TcpStream::connect(addr).unwrap();
        let lo = ShmLink::establish(&mut s, 0, 1, Some(ring), deadline, t).unwrap();
        (lo.unwrap(), hi.join().unwrap().unwrap())
    }

    #[test]
    fn offer_round_trip_and_rejections() {
        let o = Offer {
            willing: true,
            ring_bytes: 4096,
            listening: true,
            name: [7; 16],
            key: [9; KEY_LEN],
        };
        let b = o.encode();
        assert_eq!(b.len(), OFFER_LEN);
        let d = Offer::decode(&b).unwrap();
        assert!(d.willing && d.listening && d.ring_bytes == 4096);
        assert_eq!((d.name, d.key), ([7; 16], [9; KEY_LEN]));
        let mut bad = b.clone();
        bad[0] ^= 1;
        assert!(matches!(Offer::decode(&bad), Err(Error::Decode(_))));
        let huge = Offer {
            ring_bytes: MAX_RING_BYTES + 1,
            ..o
        };
        assert!(matches!(
            Offer::decode(&huge.encode()),
            Err(Error::Decode(_))
        ));
        assert!(Offer::decode(&b[..OFFER_LEN - 1]).is_err());
    }

    #[test]
    fn bytes_wrap_around_and_full_ring_stops_the_producer() {
        let (mut a, mut b) = pair(100);
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut got = vec![0u8; 1000];
        let (mut so, mut ro) = (0, 0);
        let mut rounds = 0;
        while ro < data.len() {
            let mut s = Xfer::Send {
                peer: 1,
                buf: &data,
            };
            a.progress(&mut s, &mut so).unwrap();
            // The ring holds exactly 100 bytes until the consumer frees some.
            assert_eq!(so - ro, 100.min(data.len() - ro));
            let mut r = Xfer::Recv {
                peer: 0,
                buf: &mut got[..(ro + 37).min(1000)],
            };
            b.progress(&mut r, &mut ro).unwrap();
            rounds += 1;
        }
        assert_eq!(got, data);
        assert!(rounds > 20);
    }

    #[test]
    fn corrupt_indices_are_errors_not_accesses() {
        let (mut a, mut b) = pair(64);
        // The "peer" claims to have published more than a ring's worth.
        b.at(off_tail(1)).store(1 << 40, Ordering::Release);
        let mut buf = [0u8; 8];
        let mut off = 0;
        let res = a.progress(
            &mut Xfer::Recv {
                peer: 1,
                buf: &mut buf,
            },
            &mut off,
        );
        assert!(
            matches!(res, Err(Error::PeerLost { rank: 1, .. })),
            "{res:?}"
        );
        // And a head beyond what was ever sent.
        a.at(off_head(1)).store(1000, Ordering::Release);
        // (Checked when the producer next needs space: after filling the ring.)
        let mut off = 0;
        let mut x = Xfer::Send {
            peer: 0,
            buf: &[1; 200],
        };
        assert!(b.progress(&mut x, &mut off).unwrap());
        let res = b.progress(&mut x, &mut off);
        assert!(
            matches!(res, Err(Error::PeerLost { rank: 0, .. })),
            "{res:?}"
        );
    }

    #[test]
    fn closed_peer_fails_sends_at_once_and_receives_after_the_last_byte() {
        let (mut a, mut b) = pair(64);
        let mut off = 0;
        a.progress(
            &mut Xfer::Send {
                peer: 1,
                buf: b"last words",
            },
            &mut off,
        )
        .unwrap();
        drop(a);
        let mut got = [0u8; 10];
        let mut off = 0;
        let mut x = Xfer::Recv {
            peer: 0,
            buf: &mut got,
        };
        assert!(b.progress(&mut x, &mut off).unwrap());
        assert_eq!(&got, b"last words");
        let mut more = [0u8; 1];
        let mut off = 0;
        let mut x = Xfer::Recv {
            peer: 0,
            buf: &mut more,
        };
        assert!(matches!(
            b.progress(&mut x, &mut off),
            Err(Error::PeerLost { rank: 0, .. })
        ));
        let mut off = 0;
        let res = b.progress(&mut Xfer::Send { peer: 0, buf: &[1] }, &mut off);
        assert!(matches!(res, Err(Error::PeerLost { rank: 0, .. })));
        assert!(b.ready(true) && b.ready(false));
    }

    fn control_pair(ring: usize) -> (ShmLink, ShmLink) {
        let (mut c, mut s) = UnixStream::pair().unwrap();
        let t = Duration::from_secs(10);
        let coordinator =
            std::thread::spawn(move || ShmLink::accept_control(&mut s, 3, t).unwrap().unwrap());
        let client = ShmLink::offer_control(&mut c, Some(ring), t)
            .unwrap()
            .unwrap();
        (client, coordinator.join().unwrap())
    }

    #[test]
    fn control_rings_stream_both_ways_and_ring_only_for_an_armed_sleeper() {
        let (mut client, mut coord) = control_pair(4096);
        // More than a ring's worth each way, interleaved as the two threads would.
        let up: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let down: Vec<u8> = (0..9_000u32).map(|i| (i * 13 % 241) as u8).collect();
        let (mut got_up, mut got_down) = (Vec::new(), Vec::new());
        let (mut sent_up, mut sent_down) = (0, 0);
        let mut buf = [0u8; 1000];
        while got_up.len() < up.len() || got_down.len() < down.len() {
            sent_up += client.write_some(&up[sent_up..]).unwrap();
            sent_down += coord.write_some(&down[sent_down..]).unwrap();
            let n = coord.read_some(&mut buf).unwrap();
            got_up.extend_from_slice(&buf[..n]);
            let n = client.read_some(&mut buf).unwrap();
            got_down.extend_from_slice(&buf[..n]);
        }
        assert_eq!((got_up, got_down), (up, down));
        let quiet = |l: &ShmLink| {
            let mut fds = [poll_fd(l.doorbell(), POLL_IN)];
            poll(&mut fds, Some(Duration::ZERO)).unwrap();
            fds[0].revents == 0
        };
        // Not armed: a write rings nothing.
        client.write_some(b"x").unwrap();
        assert!(quiet(&coord) && coord.readable());
        assert_eq!(coord.read_some(&mut buf).unwrap(), 1);
        // Armed: the next write rings once, and the ring is cleared by the writer.
        coord.arm();
        assert!(!coord.readable());
        client.write_some(b"yz").unwrap();
        let mut fds = [poll_fd(coord.doorbell(), POLL_IN)];
        poll(&mut fds, Some(Duration::from_secs(5))).unwrap();
        assert_ne!(fds[0].revents, 0);
        coord.drain_doorbell(fds[0].revents);
        coord.disarm();
        assert!(quiet(&coord));
        assert_eq!(coord.read_some(&mut buf).unwrap(), 2);
    }

    #[test]
    fn control_ring_hands_over_the_last_words_before_the_closure() {
        let (mut client, mut coord) = control_pair(4096);
        client.write_some(b"leave").unwrap();
        drop(client);
        // A buffer larger than what is there: the bytes come first, the closure after.
        let mut buf = [0u8; 64];
        assert_eq!(coord.read_some(&mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"leave");
        assert!(matches!(
            coord.read_some(&mut buf),
            Err(Error::PeerLost { rank: 3, .. })
        ));
        assert!(coord.write_some(b"late").is_err());
    }

    #[test]
    fn control_offer_declined_or_malformed() {
        let t = Duration::from_secs(10);
        let (mut c, mut s) = UnixStream::pair().unwrap();
        let coordinator = std::thread::spawn(move || {
            let link = ShmLink::accept_control(&mut s, 1, t).unwrap();
            (link.is_none(), s)
        });
        assert!(ShmLink::offer_control(&mut c, None, t).unwrap().is_none());
        let (declined, mut s) = coordinator.join().unwrap();
        assert!(declined);
        // The socket is still a plain byte stream for both.
        c.write_all(b"plain").unwrap();
        let mut got = [0u8; 5];
        s.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"plain");

        let (mut c, mut s) = UnixStream::pair().unwrap();
        c.write_all(&[0xAB; CONTROL_OFFER_LEN]).unwrap();
        let res = ShmLink::accept_control(&mut s, 2, t);
        assert!(matches!(res, Err(Error::Decode(m)) if m.contains("rank 2")));
    }
}
