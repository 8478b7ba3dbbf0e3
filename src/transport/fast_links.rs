//! Connections for the fast path across hosts ([`crate::engine::fast`]): in a job with one rank
//! per host, each rank tells the others what it offers for a slot, and answers the offers of
//! slots it declined, over connections of their own.
//!
//! **One connection per direction and pair**, as point-to-point messages have: a rank dials its
//! connection to a peer the first time it posts to it, and reads the peer's posts from the
//! connection the peer dialled, which this rank's acceptor hands over ([`FastLinks::arrived`]).
//! No two ranks ever race for one connection. Both are authenticated and introduced as the
//! data links are ([`super::dial`]).
//!
//! **Posts.** A post is a 24-byte header (magic, kind, slot, the descriptor's and the
//! payload's lengths) and then the descriptor and the payload, written with one `write`: an
//! *offer* (a rank's descriptor and input for the slot), a *decline* (the answer to an offer
//! of a slot this rank did not offer), or *closed* (this rank never offers again: every slot
//! it has not offered counts as declined). A rank's posts to a peer need not come in slot
//! order, because answers go out when the offer is seen: received posts wait in a queue per
//! peer until the fast path takes the one of the slot it wants ([`Inbound::take`]).
//!
//! Reads never block: [`Inbound::pump`] takes what the connections hold. The fast path pumps
//! while it waits for an offer's answers, and the engine thread does when a connection turns
//! readable ([`Inbound::fds`]), so a rank whose caller is busy elsewhere still answers.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::offers::{OFFER_DATA_BYTES, OFFER_DESC_BYTES};
use crate::error::{Error, Result};
use crate::sys::{poll, poll_fd, POLL_OUT};

const MAGIC: u32 = u32::from_le_bytes(*b"FVFP");
const HEADER: usize = 24;
/// How long a closing rank tries to tell a peer that it closed: a peer that reads nothing
/// (it is gone, or stuck) must not hold up a shutdown.
const CLOSE_WRITE: Duration = Duration::from_secs(1);

/// What a post says about its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostKind {
    /// The sender offers the slot: the descriptor and payload are its offer.
    Offer = 1,
    /// The sender did not offer the slot (its answer to this rank's offer).
    Decline = 2,
    /// The sender never offers again; its slot field is the first slot it did not take.
    Closed = 3,
}

impl PostKind {
    fn from_u32(v: u32) -> Option<PostKind> {
        match v {
            1 => Some(PostKind::Offer),
            2 => Some(PostKind::Decline),
            3 => Some(PostKind::Closed),
            _ => None,
        }
    }
}

/// One post received from a peer.
#[derive(Debug)]
pub struct Post {
    /// The slot it is about.
    pub slot: u64,
    /// What it says about the slot.
    pub kind: PostKind,
    /// An offer's descriptor (empty otherwise).
    pub desc: Vec<u8>,
    /// An offer's payload (empty otherwise).
    pub data: Vec<u8>,
}

/// The receiving side of one peer's connection.
#[derive(Default)]
struct Peer {
    stream: Option<TcpStream>,
    /// Bytes read but not yet parsed into posts.
    buf: Vec<u8>,
    posts: VecDeque<Post>,
    /// The connection ended (without a closed post: the peer is gone).
    eof: bool,
    /// The slot of the peer's closed post, once it came.
    closed: Option<u64>,
}

/// The connections of a rank with every peer for the fast path across hosts (see the module
/// doc); cheap to clone.
#[derive(Clone)]
pub struct FastLinks(Arc<Inner>);

struct Inner {
    rank: usize,
    size: usize,
    addrs: Arc<[SocketAddr]>,
    secret: Arc<[u8]>,
    timeout: Duration,
    /// This rank's connections to each peer, dialled on the first post.
    out: Mutex<Vec<Option<TcpStream>>>,
    inbound: Mutex<Inbound>,
    /// Connections the acceptor took, until the next pump moves them in.
    arrived: Arc<Mutex<Vec<Option<TcpStream>>>>,
    /// Rung when a connection arrives, so that the engine thread adds it to what it watches.
    on_arrival: Mutex<Option<Box<dyn Fn() + Send + Sync>>>,
    /// The descriptors of every peer's connection that came and has not ended: what the
    /// engine thread watches, whoever holds the posts meanwhile.
    watch: Arc<Mutex<Vec<RawFd>>>,
}

impl std::fmt::Debug for FastLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastLinks")
            .field("rank", &self.0.rank)
            .finish()
    }
}

/// Every peer's received posts (see [`FastLinks::inbound`]).
pub struct Inbound {
    rank: usize,
    peers: Vec<Peer>,
    /// [`Inner::watch`], from which a connection that ends is taken.
    watch: Arc<Mutex<Vec<RawFd>>>,
    /// [`Inner::arrived`], which every pump first moves in.
    arrived: Arc<Mutex<Vec<Option<TcpStream>>>>,
    /// Posts parsed so far (a reader that pumped while it wrote looks again).
    received: u64,
}

impl FastLinks {
    pub(super) fn new(
        rank: usize,
        size: usize,
        addrs: Arc<[SocketAddr]>,
        secret: Arc<[u8]>,
        timeout: Duration,
    ) -> FastLinks {
        let watch = Arc::new(Mutex::new(Vec::new()));
        let arrived = Arc::new(Mutex::new((0..size).map(|_| None).collect()));
        FastLinks(Arc::new(Inner {
            rank,
            size,
            addrs,
            secret,
            timeout,
            out: Mutex::new((0..size).map(|_| None).collect()),
            inbound: Mutex::new(Inbound {
                rank,
                peers: (0..size).map(|_| Peer::default()).collect(),
                received: 0,
                watch: watch.clone(),
                arrived: Arc::clone(&arrived),
            }),
            arrived,
            on_arrival: Mutex::new(None),
            watch,
        }))
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.0.size
    }

    /// Calls `f` whenever the acceptor hands a connection over.
    pub fn set_on_arrival(&self, f: Box<dyn Fn() + Send + Sync>) {
        *self.0.on_arrival.lock() = Some(f);
    }

    /// The acceptor's hand-over of `peer`'s connection.
    pub(super) fn arrived(&self, peer: usize, stream: TcpStream) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        self.0.watch.lock().push(stream.as_raw_fd());
        self.0.arrived.lock()[peer] = Some(stream);
        if let Some(f) = &*self.0.on_arrival.lock() {
            f();
        }
    }

    /// Posts to `peer`, dialling its connection first if this is the first post. While the
    /// connection is full it reads the peers' posts into `inbound` (when the caller holds
    /// them), so that two ranks posting to each other at once never both wait on a full
    /// connection; a closed post gives up after a second, for a peer that reads nothing more.
    pub fn post(
        &self,
        peer: usize,
        kind: PostKind,
        slot: u64,
        desc: &[u8],
        data: &[u8],
        mut inbound: Option<&mut Inbound>,
    ) -> Result<()> {
        let mut bytes = Vec::with_capacity(HEADER + desc.len() + data.len());
        bytes.extend_from_slice(&MAGIC.to_le_bytes());
        bytes.extend_from_slice(&(kind as u32).to_le_bytes());
        bytes.extend_from_slice(&slot.to_le_bytes());
        bytes.extend_from_slice(&(desc.len() as u32).to_le_bytes());
        bytes.extend_from_slice(&(data.len() as u32).to_le_bytes());
        bytes.extend_from_slice(desc);
        bytes.extend_from_slice(data);
        let mut out = self.0.out.lock();
        if out[peer].is_none() {
            let deadline = Instant::now() + self.0.timeout;
            let s = super::dial::connect_fast(
                (self.0.rank, self.0.size),
                (peer, self.0.addrs[peer]),
                &self.0.secret,
                deadline,
            )?;
            s.set_nonblocking(true)?;
            out[peer] = Some(s);
        }
        let s = out[peer].as_mut().expect("dialled above");
        let lost = |e: std::io::Error| Error::PeerLost {
            rank: peer,
            detail: format!("its fast-path connection failed: {e}"),
        };
        let give_up = (kind == PostKind::Closed).then(|| Instant::now() + CLOSE_WRITE);
        let mut sent = 0;
        while sent < bytes.len() {
            match s.write(&bytes[sent..]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if give_up.is_some_and(|t| Instant::now() >= t) {
                        return Ok(());
                    }
                    if let Some(inbound) = inbound.as_deref_mut() {
                        inbound.pump()?;
                    }
                    let mut fds = [poll_fd(&*s, POLL_OUT)];
                    let _ = poll(&mut fds, Some(Duration::from_millis(1)));
                }
                Err(e) => {
                    out[peer] = None;
                    return Err(lost(e));
                }
            }
        }
        Ok(())
    }

    /// Whether this rank's connection to `peer` is made (it has posted to it).
    pub fn connected(&self, peer: usize) -> bool {
        self.0.out.lock()[peer].is_some()
    }

    /// The descriptors on which peers' posts arrive (every connection that came and has not
    /// ended), whoever is reading them.
    pub fn watched(&self) -> Vec<RawFd> {
        self.0.watch.lock().clone()
    }

    /// Every peer's received posts, for the one thread that reads them at a time.
    pub fn inbound(&self) -> MutexGuard<'_, Inbound> {
        self.0.inbound.lock()
    }

    /// [`FastLinks::inbound`], unless another thread is reading.
    pub fn try_inbound(&self) -> Option<MutexGuard<'_, Inbound>> {
        self.0.inbound.try_lock()
    }
}

impl Inbound {
    /// Moves in the connections the acceptor took since the last pump.
    fn adopt(&mut self) {
        let mut arrived = self.arrived.lock();
        for (peer, slot) in arrived.iter_mut().enumerate() {
            if let Some(s) = slot.take() {
                // A connection made again (after a failed one) replaces the old one.
                if let Some(old) = &self.peers[peer].stream {
                    let fd = old.as_raw_fd();
                    self.watch.lock().retain(|&w| w != fd);
                }
                self.peers[peer] = Peer {
                    stream: Some(s),
                    ..Peer::default()
                };
            }
        }
    }

    /// Reads what every peer's connection holds (those the acceptor took since the last pump
    /// included) and parses it into posts. A connection that ended marks its peer
    /// [`Inbound::gone`]; a post that does not parse is an error.
    pub fn pump(&mut self) -> Result<()> {
        self.adopt();
        for (r, p) in self.peers.iter_mut().enumerate() {
            if r == self.rank || p.eof {
                continue;
            }
            let Some(s) = p.stream.as_mut() else {
                continue;
            };
            let mut chunk = [0u8; 16 << 10];
            loop {
                match s.read(&mut chunk) {
                    Ok(n) if n > 0 => p.buf.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    // Ended (or failed): nothing more will come, and its descriptor, always
                    // readable now, is watched no more.
                    _ => {
                        p.eof = true;
                        let fd = s.as_raw_fd();
                        self.watch.lock().retain(|&w| w != fd);
                        break;
                    }
                }
            }
            self.received += parse(r, p)?;
        }
        Ok(())
    }

    /// How many posts have been parsed so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The descriptors to watch for posts (each peer whose connection came and is open).
    pub fn fds(&self) -> Vec<RawFd> {
        self.peers
            .iter()
            .filter(|p| !p.eof)
            .filter_map(|p| p.stream.as_ref().map(|s| s.as_raw_fd()))
            .collect()
    }

    /// Whether `peer`'s connection has come.
    pub fn has_connection(&self, peer: usize) -> bool {
        self.peers[peer].stream.is_some()
    }

    /// Takes `peer`'s post of `slot`, if it came.
    pub fn take(&mut self, peer: usize, slot: u64) -> Option<Post> {
        let posts = &mut self.peers[peer].posts;
        let at = posts.iter().position(|p| p.slot == slot)?;
        posts.remove(at)
    }

    /// `peer`'s offers of slots below `below`, except `keep`, taken out of its queue.
    pub fn stale_offers(&mut self, peer: usize, below: u64, keep: Option<u64>) -> Vec<u64> {
        let mut slots = Vec::new();
        self.peers[peer].posts.retain(|p| {
            let stale = p.kind == PostKind::Offer && p.slot < below && Some(p.slot) != keep;
            if stale {
                slots.push(p.slot);
            }
            !stale
        });
        slots
    }

    /// The first slot `peer` did not take before it closed, once its closed post came.
    pub fn closed(&self, peer: usize) -> Option<u64> {
        self.peers[peer].closed
    }

    /// Whether `peer`'s connection ended without its closed post: the peer is gone.
    pub fn gone(&self, peer: usize) -> bool {
        let p = &self.peers[peer];
        p.eof && p.closed.is_none()
    }
}

/// Parses the complete posts in `p.buf` into `p.posts`; how many.
fn parse(peer: usize, p: &mut Peer) -> Result<u64> {
    let mut at = 0;
    let mut count = 0;
    while p.buf.len() - at >= HEADER {
        let h = &p.buf[at..at + HEADER];
        let word = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let magic = word(0);
        let kind = PostKind::from_u32(word(4));
        let slot = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        let (desc_len, data_len) = (word(16) as usize, word(20) as usize);
        let Some(kind) = kind.filter(|_| {
            magic == MAGIC && desc_len <= OFFER_DESC_BYTES && data_len <= OFFER_DATA_BYTES
        }) else {
            return Err(Error::Decode(format!(
                "rank {peer} sent a fast-path post that does not parse"
            )));
        };
        let end = at + HEADER + desc_len + data_len;
        if p.buf.len() < end {
            break;
        }
        let desc = p.buf[at + HEADER..at + HEADER + desc_len].to_vec();
        let data = p.buf[at + HEADER + desc_len..end].to_vec();
        if kind == PostKind::Closed {
            p.closed = Some(slot);
        } else {
            p.posts.push_back(Post {
                slot,
                kind,
                desc,
                data,
            });
        }
        at = end;
        count += 1;
    }
    p.buf.drain(..at);
    Ok(count)
}
