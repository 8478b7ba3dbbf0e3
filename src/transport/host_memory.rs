//! Host memory: one segment per rank that every other rank of its host maps as well.
//!
//! **Why.** A sharded optimizer on the CPU ranks of one host moves each shard of the gradients
//! through a ring (the reduce-scatter) and then the updated parameters through another (the
//! allgather): every byte is copied into a shared ring and out again, on the one memory bus
//! all ranks share. With the gradient buffers in segments every rank of the host maps, a rank
//! reduces its shard straight from its peers' buffers, where their backward passes wrote them;
//! with the parameters in one segment, every rank updates its shard of the one copy, and no
//! allgather is needed at all (see `ferrovod.torch.sharded`).
//!
//! **Set-up** ([`Exposed::new`], then [`Exposed::share`]; a collective over the ranks that take
//! part, which exchange their [`Exposed::address`] by any means, e.g. an allgather). One
//! segment for all the ranks of a host is [`Exposed::serve`]d by the rank that made it and
//! [`fetch`]ed by the others, one exchange each. Each rank
//! creates its segment with `memfd_create` (sealed against resizing) and binds a Unix socket in
//! the abstract namespace under a random name; its address is that name and a random key. Each
//! rank connects to every other rank's socket and presents that rank's key, and each rank
//! answers every connection that presents its own key with its segment's descriptor
//! (`SCM_RIGHTS`), as the shared-memory links do (see [`super::shm`]): nothing has a name in
//! `/dev/shm`, so nothing stays behind whatever kills the job, and a stranger without the key
//! gets nothing. A rank on another host, or in another network namespace, cannot reach the
//! socket: [`HostMemory::complete`] then says no, and the caller agrees with every rank whether
//! to use the memory at all.
//!
//! **Who writes what.** The bytes are read and written by several processes; it is the
//! caller's protocol, barriers between the ranks, that keeps a range from being written while
//! another rank reads it. A broken protocol can corrupt values, never addresses: every range
//! is checked against the mapping, and a segment cannot shrink under us.

use std::io::{ErrorKind, Read, Write};
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::shm::random_name_with;
use super::PeersMemory;
use crate::error::{Error, Result};
use crate::sys::{self, Mapping};
use crate::sys::{poll, poll_fd, POLL_IN};

/// Bytes of an [`Exposed::address`]: the socket's random name, then the key.
pub const ADDRESS_LEN: usize = 32;
const NAME_PREFIX: &str = "ferrovod-host";

/// This rank's segment and the socket that hands it out, before the exchange.
#[derive(Debug)]
pub struct Exposed {
    fd: OwnedFd,
    map: Arc<Mapping>,
    listener: UnixListener,
    address: [u8; ADDRESS_LEN],
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mapping({} bytes)", self.len())
    }
}

/// The socket named by the first 16 bytes of an address.
fn socket_addr(address: &[u8]) -> std::io::Result<UnixAddr> {
    let token: &[u8; 16] = address[..16].try_into().expect("addresses are checked");
    UnixAddr::from_abstract_name(random_name_with(NAME_PREFIX, token).as_bytes())
}

impl Exposed {
    /// A new zeroed segment of `len` bytes (pages are allocated as they are first touched)
    /// and the socket that will hand it to the other ranks.
    pub fn new(len: usize) -> Result<Exposed> {
        let mut address = [0u8; ADDRESS_LEN];
        getrandom::fill(&mut address).map_err(|e| Error::Io(format!("getrandom: {e}")))?;
        // Inherited by a fork: torch tensors view this memory, and a data-loader worker's
        // copies of them must not point at unmapped pages.
        let (fd, map) = Mapping::create(super::shm::NAME_PREFIX, len.max(1), true)
            .map_err(|e| Error::Io(format!("host memory segment of {len} bytes: {e}")))?;
        let listener = socket_addr(&address)
            .and_then(|a| UnixListener::bind_addr(&a))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .map_err(|e| Error::Io(format!("host memory: binding a Unix socket: {e}")))?;
        Ok(Exposed {
            fd,
            map: Arc::new(map),
            listener,
            address,
        })
    }

    /// What the other ranks need to map this segment.
    pub fn address(&self) -> [u8; ADDRESS_LEN] {
        self.address
    }

    /// Maps the segment of every other rank whose address (`addresses[r]`, in rank order;
    /// this rank is `rank`) it can reach, handing this rank's to each rank that asks, within
    /// `timeout`. Every rank passes the same addresses. Unreachable ranks are left unmapped
    /// (see [`HostMemory::complete`]); errors are only malformed addresses.
    pub fn share(
        self,
        addresses: &[Vec<u8>],
        rank: usize,
        timeout: Duration,
    ) -> Result<HostMemory> {
        if rank >= addresses.len() {
            return Err(Error::InvalidArgument(format!(
                "host memory: rank {rank} of {} addresses",
                addresses.len()
            )));
        }
        if let Some((r, a)) = addresses
            .iter()
            .enumerate()
            .find(|(_, a)| a.len() != ADDRESS_LEN)
        {
            return Err(Error::InvalidArgument(format!(
                "host memory: rank {r}'s address has {} bytes, not {ADDRESS_LEN}",
                a.len()
            )));
        }
        let deadline = Instant::now() + timeout;
        let len = self.map.len();
        // Connect first: a connection completes in the listener's backlog, so every rank can
        // then serve the others before it waits for its own answers.
        let mut asked = Vec::new();
        for (p, a) in addresses.iter().enumerate().filter(|&(p, _)| p != rank) {
            let sock = socket_addr(a).and_then(|addr| UnixStream::connect_addr(&addr));
            match sock.and_then(|mut s| s.write_all(&a[16..]).map(|()| s)) {
                Ok(s) => asked.push((p, s)),
                Err(e) => log::debug!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: no host memory of rank {p}: {e}"
                ),
            }
        }
        // Reachability is symmetric (one host, one network namespace), so as many ranks ask
        // as this rank asked.
        self.answer_all(asked.len(), deadline)?;
        let mut segments: Vec<Option<Arc<Mapping>>> = vec![None; addresses.len()];
        segments[rank] = Some(self.map.clone());
        for (p, s) in asked {
            match receive(&s, len, deadline) {
                Ok(map) => segments[p] = Some(Arc::new(map)),
                Err(why) => log::warn!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: no host memory of rank {p}: {why}"
                ),
            }
        }
        Ok(HostMemory {
            rank,
            len,
            segments,
        })
    }

    /// This segment alone, as rank `rank` of `n` whose other segments are not mapped: memory
    /// that only collectives through the engine reduce, where the ranks do not share it.
    pub fn alone(self, rank: usize, n: usize) -> HostMemory {
        let mut segments = vec![None; n.max(rank + 1)];
        let len = self.map.len();
        segments[rank] = Some(self.map);
        HostMemory {
            rank,
            len,
            segments,
        }
    }

    /// Hands this segment to each rank of the host that asks for it ([`fetch`]) until
    /// `askers` have had it or `deadline` passes, and returns it. One segment for all ranks
    /// costs each rank one exchange, where [`Exposed::share`] costs each `n - 1`.
    pub(super) fn serve(self, askers: usize, deadline: Instant) -> Arc<Mapping> {
        if let Err(e) = self.answer_all(askers, deadline) {
            log::warn!(target: crate::LOG_TARGET, "host memory: serving stopped: {e}");
        }
        self.map
    }

    /// Answers the ranks that ask for this segment until `askers` have had it or `deadline`
    /// passes.
    fn answer_all(&self, askers: usize, deadline: Instant) -> Result<()> {
        let len = self.map.len();
        let mut served = 0;
        while served < askers {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut fds = [poll_fd(&self.listener, POLL_IN)];
            poll(&mut fds, Some(left))?;
            loop {
                match self.listener.accept() {
                    Ok((s, _)) => served += usize::from(self.answer(s, len)),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        }
        Ok(())
    }

    /// Sends this segment's descriptor on `s` if it presents the key; whether it did.
    fn answer(&self, mut s: UnixStream, len: usize) -> bool {
        let mut key = [0u8; ADDRESS_LEN - 16];
        // The asker writes its key right after connecting; a stranger gets a bounded wait.
        let presented = s.set_nonblocking(false).is_ok()
            && s.set_read_timeout(Some(Duration::from_secs(1))).is_ok()
            && s.read_exact(&mut key).is_ok();
        presented
            && key[..] == self.address[16..]
            && sys::send_with_fd(&s, &(len as u64).to_le_bytes(), &self.fd).is_ok()
    }
}

/// Maps the segment of `len` bytes another rank of this host exposed at `address` (its
/// [`Exposed::address`]) and hands out with [`Exposed::serve`].
pub(super) fn fetch(
    address: &[u8],
    len: usize,
    deadline: Instant,
) -> std::result::Result<Mapping, String> {
    if address.len() != ADDRESS_LEN {
        return Err(format!(
            "an address of {} bytes, not {ADDRESS_LEN}",
            address.len()
        ));
    }
    let mut s = socket_addr(address)
        .and_then(|a| UnixStream::connect_addr(&a))
        .map_err(|e| e.to_string())?;
    s.write_all(&address[16..]).map_err(|e| e.to_string())?;
    receive(&s, len, deadline)
}

/// Waits on `s` for a peer's answer: its segment's length and descriptor, mapped.
fn receive(s: &UnixStream, len: usize, deadline: Instant) -> std::result::Result<Mapping, String> {
    let mut got = [0u8; 8];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err("no answer in time".into());
        }
        let mut fds = [poll_fd(s, POLL_IN)];
        poll(&mut fds, Some(left)).map_err(|e| e.to_string())?;
        match sys::recv_with_fd(s, &mut got) {
            Ok((8, Some(fd))) => {
                let theirs = u64::from_le_bytes(got) as usize;
                if theirs != len {
                    return Err(format!("its segment has {theirs} bytes, this one {len}"));
                }
                return Mapping::open(fd, len, true).map_err(|e| e.to_string());
            }
            Ok((n, _)) => return Err(format!("a malformed answer ({n} bytes)")),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The segments of the ranks of one host (see the module doc), this rank's among them.
#[derive(Debug)]
pub struct HostMemory {
    rank: usize,
    len: usize,
    segments: Vec<Option<Arc<Mapping>>>,
}

impl HostMemory {
    /// This rank's index among the segments.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Bytes of each segment.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the segments are empty (never: a segment has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Which ranks' segments are mapped here.
    pub fn mapped(&self) -> Vec<bool> {
        self.segments.iter().map(Option::is_some).collect()
    }

    /// Whether every rank's segment is mapped here.
    pub fn complete(&self) -> bool {
        self.segments.iter().all(Option::is_some)
    }

    /// Rank `r`'s segment: its first byte and length, valid while the returned handle lives.
    pub fn segment(&self, r: usize) -> Option<Segment> {
        self.segments.get(r)?.clone().map(|map| Segment { map })
    }

    /// This rank's segment alone, the others unmapped (see [`Exposed::alone`]).
    pub fn alone(mut self) -> HostMemory {
        for (r, seg) in self.segments.iter_mut().enumerate() {
            if r != self.rank {
                *seg = None;
            }
        }
        self
    }

    /// Runs `f` over `range` of this rank's segment (writable), whether or not the others are
    /// mapped; `InvalidArgument` when the range is outside the segment. As for
    /// [`HostMemory::with_range`], the caller's protocol keeps other ranks from writing it.
    pub fn with_own<T>(
        &self,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> Result<T>,
    ) -> Result<T> {
        self.with_peer(self.rank, range, f)
    }

    /// Runs `f` over `range` of rank `r`'s segment (writable); `InvalidArgument` when it is not
    /// mapped here or the range is outside it. Writing another rank's bytes is the caller's
    /// protocol's business: each rank its own part, with a meeting before anyone reads them
    /// (the one copy of a sharded update's parameters).
    pub fn with_peer<T>(
        &self,
        r: usize,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8]) -> Result<T>,
    ) -> Result<T> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::InvalidArgument(format!(
                "host memory: bytes {range:?} of a {}-byte segment",
                self.len
            )));
        }
        let Some(Some(map)) = self.segments.get(r) else {
            return Err(Error::InvalidArgument(format!(
                "host memory: rank {r}'s segment is not mapped here"
            )));
        };
        let mut bytes = map.bytes_mut(range.start, range.len());
        f(&mut bytes)
    }

    /// Runs `f` over `range` of this rank's segment (writable) and of every other rank's (a
    /// [`PeersMemory`] whose offsets count from `range.start`); `InvalidArgument` when the range
    /// is outside the segments or a segment is not mapped. The caller's protocol must keep the
    /// other ranks from writing those ranges meanwhile (they may read this rank's).
    pub fn with_range<T>(
        &self,
        range: Range<usize>,
        f: impl FnOnce(&mut [u8], &Others<'_>) -> Result<T>,
    ) -> Result<T> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::InvalidArgument(format!(
                "host memory: bytes {range:?} of a {}-byte segment",
                self.len
            )));
        }
        let maps: Vec<&Arc<Mapping>> = self.segments.iter().flatten().collect();
        if maps.len() != self.segments.len() {
            return Err(Error::InvalidArgument(
                "host memory: not every rank's segment is mapped".into(),
            ));
        }
        let (lo, n) = (range.start, range.len());
        // The loan serialises `with_range` within the process: it is the one `&mut` to this
        // rank's bytes. Other ranks only read them meanwhile (the caller's protocol).
        let mut own = maps[self.rank].bytes_mut(lo, n);
        // Another rank's bytes are only read here, and the caller's protocol keeps that rank
        // from writing them meanwhile.
        let others: Vec<&[u8]> = maps
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != self.rank)
            .map(|(_, m)| m.bytes(lo, n))
            .collect();
        f(
            &mut own,
            &Others {
                rank: self.rank,
                others,
            },
        )
    }
}

/// The other ranks' bytes of one range of host memory, for a collective that writes its
/// result into this rank's range: that range is the destination, and not lent here.
#[derive(Debug)]
pub struct Others<'a> {
    rank: usize,
    /// Every rank's but this one's, in rank order.
    others: Vec<&'a [u8]>,
}

impl PeersMemory for Others<'_> {
    fn size(&self) -> usize {
        self.others.len() + 1
    }

    fn bytes(&self, r: usize, range: Range<usize>) -> &[u8] {
        assert!(
            r != self.rank,
            "rank {r}'s own bytes are the collective's destination"
        );
        &self.others[super::index_among_others(self.rank, r)][range]
    }
}

/// One rank's segment, kept mapped while this handle lives.
#[derive(Debug, Clone)]
pub struct Segment {
    map: Arc<Mapping>,
}

impl Segment {
    /// The first byte of the segment.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// Bytes in the segment.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the segment is empty (never).
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share_among(n: usize, len: usize) -> Vec<HostMemory> {
        let exposed: Vec<Exposed> = (0..n).map(|_| Exposed::new(len).unwrap()).collect();
        let addrs: Vec<Vec<u8>> = exposed.iter().map(|e| e.address().to_vec()).collect();
        let handles: Vec<_> = exposed
            .into_iter()
            .enumerate()
            .map(|(r, e)| {
                let a = addrs.clone();
                std::thread::spawn(move || e.share(&a, r, Duration::from_secs(10)).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn a_buffer_lent_from_a_segment_stays_inside_it_and_keeps_it_mapped() {
        use crate::engine::TensorBuf;
        let mem = share_among(1, 64).pop().unwrap();
        let seg = mem.segment(0).unwrap();
        assert!(TensorBuf::in_segment(seg.clone(), 60..65).is_err());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 9..8;
        assert!(TensorBuf::in_segment(seg.clone(), backwards).is_err());
        let whole = TensorBuf::in_segment(seg.clone(), 0..64).unwrap();
        let mut part = TensorBuf::in_segment(seg, 16..24).unwrap();
        assert!(whole.contains_at(&part, 16) && !whole.contains_at(&part, 15));
        assert!(whole.overlaps(&part) && !whole.same_memory(&part));
        drop(mem); // the buffers alone keep the segment mapped now
        part.as_mut_slice().copy_from_slice(&[7; 8]);
        assert_eq!(&whole.as_slice()[15..25], &[0, 7, 7, 7, 7, 7, 7, 7, 7, 0]);
    }

    #[test]
    fn every_rank_sees_every_segment() {
        let mems = share_among(3, 4096);
        for m in &mems {
            assert!(m.complete());
            assert_eq!(m.segment(m.rank()).unwrap().len(), 4096);
            m.with_range(0..1, |own, _| {
                own[0] = 10 + m.rank() as u8;
                Ok(())
            })
            .unwrap();
        }
        for m in &mems {
            m.with_range(0..1, |own, others| {
                assert_eq!(own[0], 10 + m.rank() as u8);
                assert_eq!(others.size(), 3);
                let seen: Vec<u8> = (0..3)
                    .map(|r| {
                        if r == m.rank() {
                            own[0]
                        } else {
                            others.bytes(r, 0..1)[0]
                        }
                    })
                    .collect();
                assert_eq!(seen, vec![10, 11, 12]);
                Ok(())
            })
            .unwrap();
            assert!(m.with_range(4000..4097, |_, _| Ok(())).is_err());
        }
    }

    #[test]
    fn a_segment_alone_is_this_ranks_own_bytes_and_nothing_else() {
        let mut mems = share_among(2, 64).into_iter();
        let shared = mems.next().unwrap();
        let alone = shared.alone();
        assert_eq!(alone.mapped(), vec![true, false]);
        assert!(alone.segment(1).is_none());
        assert!(alone.with_range(0..8, |_, _| Ok(())).is_err());
        alone
            .with_own(8..16, |own| {
                own.copy_from_slice(&[5; 8]);
                Ok(())
            })
            .unwrap();
        alone
            .with_own(0..16, |own| {
                assert_eq!(own[..8], [0; 8]);
                assert_eq!(own[8..], [5; 8]);
                Ok(())
            })
            .unwrap();
        assert!(alone.with_own(60..65, |_| Ok(())).is_err());
        let solo = Exposed::new(32).unwrap().alone(2, 3);
        assert_eq!(solo.mapped(), vec![false, false, true]);
        assert_eq!(solo.rank(), 2);
        let len = solo.with_own(0..32, |own| Ok(own.len())).unwrap();
        assert_eq!(len, 32);
    }

    #[test]
    fn an_unreachable_rank_is_left_unmapped_and_bad_addresses_are_refused() {
        let e = Exposed::new(64).unwrap();
        let mut stranger = [7u8; ADDRESS_LEN].to_vec();
        stranger[0] = 0;
        let addrs = vec![e.address().to_vec(), stranger];
        let m = e.share(&addrs, 0, Duration::from_millis(200)).unwrap();
        assert_eq!(m.mapped(), vec![true, false]);
        assert!(!m.complete());
        assert!(m.with_range(0..8, |_, _| Ok(())).is_err());
        let e = Exposed::new(64).unwrap();
        let err = e
            .share(&[vec![1, 2, 3]], 0, Duration::from_millis(10))
            .unwrap_err();
        assert!(err.to_string().contains("not 32"), "{err}");
    }

    #[test]
    fn a_wrong_key_gets_no_descriptor() {
        let e = Exposed::new(64).unwrap();
        let mut wrong = e.address().to_vec();
        wrong[20] ^= 1;
        let other = Exposed::new(64).unwrap();
        let addrs = vec![wrong, other.address().to_vec()];
        // Rank 1 asks rank 0 with the wrong key: rank 0 (not running `share`) would refuse;
        // here rank 0 serves through `answer` directly.
        let t = std::thread::spawn(move || other.share(&addrs, 1, Duration::from_millis(300)));
        // Its connection, once made (the listener does not block).
        let (s, _) = loop {
            match e.listener.accept() {
                Ok(x) => break x,
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        assert!(!e.answer(s, 64));
        let m = t.join().unwrap().unwrap();
        assert_eq!(m.mapped(), vec![false, true]);
    }
}
