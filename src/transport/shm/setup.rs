//! Set-up of a pair's link over its TCP connection (`ShmLink::establish`) and of a control
//! connection's rings (`ShmLink::offer_control`, `ShmLink::accept_control`).
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

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{
    ring_stride, segment_len, ShmLink, CHUNK_BYTES, MAX_RING_BYTES, MIN_RING_BYTES, NAME_PREFIX,
    OFF_MAGIC, OFF_RING_BYTES, RINGS,
};
use crate::bootstrap::net::{read_exact_until, remaining, write_all_until};
use crate::error::{Error, Result};
use crate::sys::{self, poll, poll_fd, POLL_IN};
use crate::wire::{Reader, Writer};

const CONTROL_MAGIC: u64 = u64::from_le_bytes(*b"FVCTL001");
/// Magic, then ring bytes (0 and no descriptor: declined).
pub(super) const CONTROL_OFFER_LEN: usize = 16;

const MAGIC: u64 = u64::from_le_bytes(*b"FVSHM001");
const OFFER_MAGIC: u32 = u32::from_le_bytes(*b"FVS1");
/// Magic, willing, ring bytes, listening, then name and key as length-prefixed byte strings.
pub(super) const OFFER_LEN: usize = 4 + 1 + 8 + 1 + (4 + 16) + (4 + KEY_LEN);
pub(super) const KEY_LEN: usize = 16;
/// Unverified connections to the set-up socket kept before giving up (someone is flooding it).
const MAX_PENDING: usize = 256;

/// What each side announces first.
pub(super) struct Offer {
    pub(super) willing: bool,
    pub(super) ring_bytes: usize,
    /// (higher rank) the set-up socket is bound: `name` and `key` are valid.
    pub(super) listening: bool,
    pub(super) name: [u8; 16],
    pub(super) key: [u8; KEY_LEN],
}

impl Offer {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(OFFER_MAGIC)
            .u8(self.willing as u8)
            .u64(self.ring_bytes as u64)
            .u8(self.listening as u8)
            .bytes(&self.name)
            .bytes(&self.key);
        w.finish()
    }

    pub(super) fn decode(b: &[u8]) -> Result<Offer> {
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
pub(in crate::transport) fn random_name_with(prefix: &str, token: &[u8; 16]) -> String {
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
            map,
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
        let (fd, map) = sys::Mapping::create(NAME_PREFIX, segment_len(cap), false)
            .map_err(|e| format!("memfd segment: {e}"))?;
        map.atomic(OFF_RING_BYTES)
            .store(cap as u64, Ordering::Relaxed);
        map.atomic(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok((fd, map))
    }

    /// Maps a received segment and checks its header.
    fn map_segment(fd: OwnedFd, cap: usize) -> std::result::Result<sys::Mapping, String> {
        let map = sys::Mapping::open(fd, segment_len(cap), false)
            .map_err(|e| format!("mapping the segment: {e}"))?;
        let magic = map.atomic(OFF_MAGIC).load(Ordering::Acquire);
        let ring = map.atomic(OFF_RING_BYTES).load(Ordering::Relaxed);
        if magic == MAGIC && ring == cap as u64 {
            Ok(map)
        } else {
            Err(format!("bad segment header ({magic:#x}, {ring} bytes)"))
        }
    }

    /// Control connections (a rank's requests to its job's coordinator and the answers), client
    /// side: over `sock`, an already authenticated Unix connection to the coordinator, offers a
    /// segment of `cap`-byte rings (`None`: declines), and waits for the answer. The socket
    /// then only rings and watches for hang-up. `Ok(None)`: keep the plain socket.
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
}
