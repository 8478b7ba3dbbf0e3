//! Shared-memory links between two ranks on the same host, used by
//! [`super::hybrid::HybridTransport`] in place of their TCP connection.
//!
//! **Segment.** One segment per pair of ranks: a 4 KiB header, then two single-producer /
//! single-consumer byte rings, one per direction (ring 0 carries lower rank → higher rank).
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
//! The set-up handshake and the segment's safety are described in `setup`.
//!
//! **Memory.** A pair maps `4 KiB + 2 × ring_bytes` (2 MiB by default), with
//! pages allocated only as transfers first reach them; `n` ranks on a host have `n·(n-1)/2` pairs.
//! memfd pages live on the kernel's internal tmpfs, so the size of a container's `/dev/shm` mount
//! (64 MiB by default under Docker) does not limit them; they count against the memory cgroup.
//!
//! All raw-pointer, `mmap` and `sendmsg`/`recvmsg` code is in the transport's private `sys`
//! module.

mod setup;
#[cfg(test)]
mod tests;

use std::io::{ErrorKind, Read};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use super::Xfer;
use crate::error::{Error, Result};
use crate::sys;

pub(crate) use setup::random_name;
pub(super) use setup::random_name_with;

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

fn ring_stride(cap: usize) -> usize {
    cap.div_ceil(PAGE) * PAGE
}

/// The rings follow the header.
const RINGS: usize = HEADER;

fn segment_len(cap: usize) -> usize {
    RINGS + 2 * ring_stride(cap)
}

/// One end of a shared-memory link with one peer. Side 0 is the lower rank.
pub struct ShmLink {
    peer: usize,
    side: usize,
    map: sys::Mapping,
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

impl ShmLink {
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

impl Drop for ShmLink {
    fn drop(&mut self) {
        // A peer spinning on our rings notices the flag without a system call; one blocked in
        // poll sees the doorbell close right after.
        self.at(off_closed(self.side)).store(1, Ordering::Release);
    }
}
