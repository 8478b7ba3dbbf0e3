//! The fast path across hosts: a job with one rank per host agrees on a blocking allreduce
//! by posts over connections of their own ([`crate::transport::fast_links`]) instead of the
//! coordinator, one trip of the data between every pair instead of the negotiation's round
//! trip to rank 0 and then the data's.
//!
//! **Offers and answers.** Slots are taken as on one host (every op of the global set takes
//! the next). A rank that offers slot `s` posts its offer (descriptor and pre-scaled input) to
//! every peer and waits for every peer's post of `s`: the peer's own offer of `s`, or its
//! *decline*, which a peer that did not offer `s` sends as the answer to this offer, as soon
//! as it sees the offer (while it takes its own slots, while its caller waits, or from its
//! engine thread, which watches these connections while idle). A rank that declines sends
//! nothing unless asked, so jobs whose ops never qualify pay nothing for the fast path. Every
//! rank that offered `s` sees the same posts (every peer's offer or decline), so all decide
//! alike: when all offered the same descriptor each reduces every offer in rank order itself
//! (the same bits on every rank); otherwise each hands its op to the engine, which matches it
//! or says what disagreed, as for any op.
//!
//! **Why this cannot hang where the engine would not** is the argument of the one-host path:
//! a rank offers only with nothing of its own in the engine, so every peer will take slot `s`
//! with its next ops whatever this rank does, and then posts its offer or, having declined,
//! answers as soon as it reads the offer.
//!
//! **Closing.** A rank that joins, shuts down or fails posts *closed* with the first slot it
//! did not take: every slot it has not offered counts as declined, and a rank that reads it
//! closes its own fast path too (no slot could be fast again). A connection that ends without
//! it is a peer that died: an offer waiting on it fails naming the rank, as the engine would.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::collective::host_memory as peers;
use crate::error::{Error, Result};
use crate::spin::Spin;
use crate::sys::wait_readable;
use crate::transport::fast_links::{FastLinks, Inbound, Post, PostKind};
use crate::transport::PeersMemory;
use crate::types::Reduction;

use super::{FastPath, Outcome, Scratch};
use crate::engine::OpSpec;

/// How long one wait on the peers' connections lasts before the failure, shutdown and
/// interrupt checks.
const SLEEP_SLICE: Duration = Duration::from_millis(20);
/// The largest allreduce (bytes per rank) the fast path across hosts takes, below
/// `FERROVOD_FAST_PATH_BYTES`: each offer is copied out of the socket and reduced from there,
/// where the engine receives into the output, and above this size that measured no faster
/// than the engine (64 KiB on 2 ranks: 97 and 214 us against 71 and 153, two sittings).
pub(crate) const MAX_BYTES: usize = 16 << 10;
/// The longest job the fast path across hosts takes: each offer is posted to every peer, so
/// what a rank sends per op grows with the job.
pub(crate) const MAX_RANKS: usize = 16;

/// Every rank's offer of the slot: this rank's own input, the peers' payloads as they came.
struct Gathered<'a> {
    rank: usize,
    own: &'a [u8],
    theirs: &'a [Vec<u8>],
}

impl PeersMemory for Gathered<'_> {
    fn size(&self) -> usize {
        self.theirs.len()
    }

    fn bytes(&self, r: usize, range: std::ops::Range<usize>) -> &[u8] {
        if r == self.rank {
            &self.own[range]
        } else {
            &self.theirs[r][range]
        }
    }
}

/// What a look at a peer's posts found.
enum Seen {
    Post(Post),
    Closed,
    Gone,
    /// Nothing yet: the descriptors to wait on, and whether the peer's connection has come.
    Nothing(Vec<RawFd>, bool),
}

impl FastPath {
    /// Offers an allreduce across hosts (see the module doc); `sc` holds its descriptor and
    /// its pre-scaled input.
    pub(super) fn offer_across(
        &self,
        links: &FastLinks,
        op: &mut OpSpec,
        sc: &Scratch,
        stop: &dyn Fn() -> bool,
    ) -> Result<Outcome> {
        let slot = {
            let mut st = self.state.lock();
            if st.closed || st.busy || self.outstanding.load(Ordering::Acquire) != 0 {
                return Ok(Outcome::Ineligible);
            }
            let slot = st.posted;
            st.posted += 1;
            st.busy = true;
            st.offering = Some(slot);
            slot
        };
        let result = self.exchange_across(links, op, slot, sc, stop);
        {
            let mut st = self.state.lock();
            st.busy = false;
            st.offering = None;
        }
        self.took_slot();
        self.count(result)
    }

    fn exchange_across(
        &self,
        links: &FastLinks,
        op: &mut OpSpec,
        slot: u64,
        sc: &Scratch,
        stop: &dyn Fn() -> bool,
    ) -> Result<Outcome> {
        {
            // Posted while reading: peers post their offers to this rank at the same time.
            let mut inbound = links.inbound();
            for r in self.peers() {
                links.post(
                    r,
                    PostKind::Offer,
                    slot,
                    &sc.desc,
                    &sc.own,
                    Some(&mut inbound),
                )?;
            }
        }
        // Every peer's post of the slot is taken, whatever the first ones said, so that none
        // is left behind to be answered as stale.
        let mut fast = true;
        let mut theirs = vec![Vec::new(); self.size];
        for r in self.peers() {
            match self.await_post(links, r, slot, &op.name, stop)? {
                Some(Post {
                    kind: PostKind::Offer,
                    desc,
                    data,
                    ..
                }) if desc == sc.desc && data.len() == sc.own.len() => theirs[r] = data,
                _ => fast = false,
            }
        }
        if !fast {
            return Ok(Outcome::Declined);
        }
        let t = &mut op.tensors[0];
        let red = Reduction::over(t.meta.dtype, op.op, op.postscale, self.size);
        let out = t
            .output
            .as_mut()
            .expect("checked by eligible")
            .as_mut_slice();
        let gathered = Gathered {
            rank: self.rank,
            own: &sc.own,
            theirs: &theirs,
        };
        peers::reduce_in_rank_order(&gathered, None, 0, red, out)?;
        Ok(Outcome::Done)
    }

    /// Peer `r`'s post of `slot`: `None` when it closed without offering it. Meanwhile
    /// answers every peer's offers of slots this rank declined.
    fn await_post(
        &self,
        links: &FastLinks,
        r: usize,
        slot: u64,
        name: &str,
        stop: &dyn Fn() -> bool,
    ) -> Result<Option<Post>> {
        let start = Instant::now();
        let mut spin = Spin::new(self.spin);
        let mut warned = false;
        loop {
            // Read before the look: a close that another thread made on reading this peer's
            // closed post is then seen as that post, not as this rank shutting down.
            let closing = self.closing.load(Ordering::Acquire);
            let seen = {
                let mut inbound = links.inbound();
                let pumped = inbound.pump();
                self.answer(links, &mut inbound);
                pumped.map(|()| match inbound.take(r, slot) {
                    Some(post) => Seen::Post(post),
                    None if inbound.closed(r).is_some() => Seen::Closed,
                    None if inbound.gone(r) => Seen::Gone,
                    None => Seen::Nothing(inbound.fds(), inbound.has_connection(r)),
                })
            };
            self.settle(links);
            let (fds, arrived) = match seen? {
                Seen::Post(post) => return Ok(Some(post)),
                Seen::Closed => return Ok(None),
                Seen::Gone => {
                    return Err(Error::PeerLost {
                        rank: r,
                        detail: format!(
                            "its fast-path connection closed while allreduce '{name}' waited \
                             for its offer"
                        ),
                    })
                }
                Seen::Nothing(fds, arrived) => (fds, arrived),
            };
            if let Some(e) = &*self.failed.lock() {
                return Err(e.clone());
            }
            if closing {
                return Err(Error::Shutdown(format!(
                    "ferrovod shut down while allreduce '{name}' waited for rank {r}"
                )));
            }
            if spin.yield_core() {
                continue;
            }
            if stop() {
                return Err(Error::Interrupted(format!("'{name}' waited for rank {r}")));
            }
            // Until the peer's connection has come, its arrival is not among the descriptors:
            // look again soon.
            let slice = if arrived {
                SLEEP_SLICE
            } else {
                Duration::from_millis(1)
            };
            let _ = wait_readable(&fds, slice);
            self.warn_if_stalled(&mut warned, start, name, r);
        }
    }

    /// Answers every peer's offers of slots this rank took without offering, and closes this
    /// rank's fast path once a peer has closed its own.
    pub(super) fn answer(&self, links: &FastLinks, inbound: &mut Inbound) {
        let (posted, offering, closed) = {
            let st = self.state.lock();
            (st.posted, st.offering, st.closed)
        };
        let mut peer_closed = false;
        // Posting may read more posts (while a connection is full): answer until a pass has
        // read none.
        let mut seen = u64::MAX;
        while seen != inbound.received() {
            seen = inbound.received();
            for r in self.peers() {
                // A peer that cannot be told is gone: its offer fails on its own side.
                if closed {
                    // Closed, this rank takes no more slots: every offer, of any slot but the one
                    // of its own offer still waiting, is answered with that.
                    if !inbound.stale_offers(r, u64::MAX, offering).is_empty() {
                        let _ = links.post(r, PostKind::Closed, posted, &[], &[], Some(inbound));
                    }
                } else {
                    for s in inbound.stale_offers(r, posted, offering) {
                        let _ = links.post(r, PostKind::Decline, s, &[], &[], Some(inbound));
                    }
                }
                peer_closed |= inbound.closed(r).is_some();
            }
        }
        if peer_closed && !closed {
            self.stop_taking_part();
        }
    }

    /// Reads and answers the peers' posts unless another thread is at them (see the module
    /// doc): what the engine thread runs when their connections turn readable, and a caller
    /// waiting in the engine between its checks.
    pub(crate) fn service(&self) {
        let Some(links) = &self.across else {
            return;
        };
        // A caller offering reads the posts itself, and may sleep on these very connections
        // until they turn readable: a post read here would leave it asleep.
        if self.state.lock().offering.is_some() {
            return;
        }
        if let Some(mut inbound) = links.try_inbound() {
            // A post that does not parse is the offer's to report, when it waits on that peer.
            let _ = inbound.pump();
            self.answer(links, &mut inbound);
        }
        self.settle(links);
    }

    /// Answers the offers already read, now if no other thread reads the posts, else through
    /// that thread, which settles once it lets them go: a slot declined while another thread
    /// pumped is never left unanswered.
    pub(super) fn answer_soon(&self, links: &FastLinks) {
        self.answer_due.store(true, Ordering::SeqCst);
        self.settle(links);
    }

    /// Runs the answers asked for by [`FastPath::answer_soon`] until none is due, unless
    /// another thread holds the posts (it settles after).
    fn settle(&self, links: &FastLinks) {
        while self.answer_due.load(Ordering::SeqCst) {
            let Some(mut inbound) = links.try_inbound() else {
                return;
            };
            self.answer_due.store(false, Ordering::SeqCst);
            self.answer(links, &mut inbound);
        }
    }

    /// Whether a caller of this rank is offering across hosts (and reads the posts itself), or
    /// took a slot less than `within` ago: in a loop of fast ops a peer's next offer usually
    /// comes before this rank's, and its caller takes it, where the engine thread woken for it
    /// would cost both a thread switch per op.
    pub(crate) fn offering(&self, within: Duration) -> bool {
        if self.across.is_none() {
            return false;
        }
        if self.state.lock().offering.is_some() {
            return true;
        }
        let last = self.last_slot_us.load(Ordering::Relaxed);
        let now = self.born.elapsed().as_micros() as u64;
        now.saturating_sub(last) < within.as_micros() as u64
    }

    /// Notes that a caller took a slot now (see [`FastPath::offering`]).
    pub(super) fn took_slot(&self) {
        if self.across.is_some() {
            let now = self.born.elapsed().as_micros() as u64;
            self.last_slot_us.store(now, Ordering::Relaxed);
        }
    }

    /// The descriptors on which the peers' posts arrive (none without the fast path across
    /// hosts).
    pub(crate) fn link_fds(&self) -> Vec<RawFd> {
        self.across
            .as_ref()
            .map(FastLinks::watched)
            .unwrap_or_default()
    }
}
