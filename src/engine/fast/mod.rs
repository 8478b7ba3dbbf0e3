//! The fast path: a blocking allreduce, broadcast, allgather, reducescatter or evenly split
//! alltoall of a small tensor, agreed and carried out by the ranks themselves through shared
//! memory, without the coordinator.
//!
//! **Why.** Through the engine a 4-byte allreduce costs about 10 µs on two ranks: the request
//! goes to the coordinator, the answer comes back, and only then do the ranks exchange data,
//! each step a hand-over between threads or processes. Open MPI takes 1.3 µs for the same op.
//! When every rank is on one host, the ranks can instead show each other what they are about
//! to reduce and go ahead when all show the same op.
//!
//! **Slots.** Every op a rank submits in the global process set takes the next *slot*
//! (0, 1, 2, …): a blocking op of those kinds that qualifies *offers* (it
//! writes its descriptor and its pre-scaled input into its offer record for the slot's
//! parity, marked as the offer of that slot ([`crate::transport::offers`]: written once, read
//! by every peer where it lies), then publishes `Posted = slot + 1` on its board there),
//! any other op *declines* (it publishes only `Posted`). An offering rank
//! waits until every peer has posted that slot; the slot is fast when every rank offered the
//! same descriptor (kind, name, dtype, shape, reduction, root, scale factors), and then each
//! rank sums all inputs in rank order itself, so every rank gets the same bits (a broadcast's
//! root offers its tensor, the others copy it; an allgather's rows travel beside the
//! descriptor, and each rank concatenates; a reducescatter's rank sums its own rows of every
//! input, in rank order, and an alltoall's rank copies its block of every input; an allreduce
//! whose inputs add up to [`data::SPLIT_READ_BYTES`] is split: each rank reduces one segment and
//! the others copy it from its record, after one more meeting, the `Reduced` word). Otherwise
//! every offering
//! rank hands its op to the engine as usual (the slot is spent either way), where the
//! coordinator matches it, or reports what disagreed, as for any op. Every rank decides from
//! the same published records, so all decide alike.
//!
//! **Why this cannot hang where the engine would not.** A rank offers only when it has no op
//! in the engine. Then every global op it completed was submitted by every other rank as
//! well, each taking one slot, so every peer has taken at least as many slots as this rank
//! and has nothing of this rank's left to wait for: the peer's next op, whatever it is,
//! posts the slot this rank waits on. Join and shutdown post `u64::MAX` (never again:
//! after a join, slot counts would differ, so the fast path stays off for the job).
//!
//! **Reuse.** A rank has two offer records and offers slot `s` in record `s % 2`. A record is
//! rewritten only once every peer has said (its `Done` word) that it will not read the offer
//! it holds: a rank's `Done` is its `Posted`, except while its own fast op is reading, when it
//! stays at that op's slot. So a rank that finished slot `s` offers `s + 1` at once, however
//! far a peer is from reading its offer of `s` (a peer that posted `s` has finished `s - 1`,
//! which is all record `(s + 1) % 2` held): when ranks outnumber cores, that saves every rank
//! a turn on a core per op.
//!
//! **Waiting** spins for `FERROVOD_SPIN_US` (yielding the core), then sleeps on the peer's
//! bell (a futex in its segment; the sleepers' count and fences of
//! [`OfferRecords::ring`]/[`OfferRecords::sleep`] lose no wake-up). A wait longer than the
//! stall-check time is logged, naming the missing rank.
//!
//! **A peer that dies** is learned by the engine, not here: its control connection hangs up,
//! the coordinator tells every rank (`RankFailed`), and the engine fails the fast path with
//! that verdict, which a waiting op returns within one sleep slice. The fast path holds
//! nothing per peer (no pair, no descriptor), so a host of many ranks needs shared-memory
//! pairs only where the engine's algorithms move data.
//!
//! This file holds the slots and the offers, which decide whether an op is fast; `data.rs` what
//! a fast op computes from the offers, `wait.rs` how every meeting waits on a peer.

mod across;
mod data;
mod wait;

pub(crate) use across::MAX_RANKS as MAX_ACROSS_RANKS;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::collective::reduce::{check_reducible, scale};
use crate::error::{Error, Result};
use crate::transport::fast_links::{FastLinks, PostKind};
use crate::transport::offers::{BoardWord, OfferRecords, OFFER_DATA_BYTES, OFFER_DESC_BYTES};
use crate::types::{OpKind, ReduceOp};

use super::tensor::TensorBuf;
use super::OpSpec;

/// What became of an op offered to the fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Reduced: the output holds the result.
    Done,
    /// Its slot is spent and it was not fast: submit it to the engine without a slot.
    Declined,
    /// Not an op for the fast path (or not now): submit it as usual.
    Ineligible,
}

struct State {
    /// Slots taken.
    posted: u64,
    /// 1 + the slot of the latest offer in each record (0: none).
    last_offer: [u64; 2],
    /// A fast op of this rank is between its offer and its `Done`.
    busy: bool,
    /// The slot of that op, across hosts (its peers' offers of it are not to be answered).
    offering: Option<u64>,
    closed: bool,
}

/// Buffers of the one fast op at a time (allocated once).
struct Scratch {
    desc: Vec<u8>,
    peer_desc: Vec<u8>,
    own: Vec<u8>,
}

/// One rank's side of the fast path.
pub struct FastPath {
    rank: usize,
    size: usize,
    /// Every rank's board and offer records (`None` with one rank, where the ranks span hosts,
    /// or where they could not be mapped: this rank then only ever declines).
    records: Option<OfferRecords>,
    /// The connections of the fast path across hosts, in a job of one rank per host
    /// ([`across`]); such a job has no `records`.
    across: Option<FastLinks>,
    /// Whether `records` (or `across`) reach every other rank (or there is none).
    complete: bool,
    /// Offers read across hosts may need an answer (see [`FastPath::answer_soon`]).
    answer_due: AtomicBool,
    /// When a caller last took a slot across hosts, in microseconds from `born`.
    last_slot_us: AtomicU64,
    born: std::time::Instant,
    max_bytes: usize,
    spin: Duration,
    stall: Option<Duration>,
    /// Ops in the engine that have not completed.
    outstanding: Arc<AtomicUsize>,
    /// A timeline is being written: ops go through the engine so that they appear in it.
    timeline: AtomicBool,
    closing: AtomicBool,
    /// This rank takes no more slots (it closed, or a peer across hosts did).
    off: AtomicBool,
    /// The engine's failure: every later op gets it, as through the engine.
    failed: Mutex<Option<Error>>,
    /// Ops reduced here, and offers that went to the engine after all.
    taken: AtomicU64,
    declined: AtomicU64,
    state: Mutex<State>,
    scratch: Mutex<Scratch>,
}

impl std::fmt::Debug for FastPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FastPath")
            .field("rank", &self.rank)
            .field("complete", &self.complete)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

impl FastPath {
    /// `records`: every rank's board and offer records; `across`: in a job of one rank per
    /// host instead, the connections with every other rank; `max_bytes` 0 turns offering off
    /// (the rank still takes its slots, and answers, so that peers never wait on it).
    pub(crate) fn new(
        rank: usize,
        size: usize,
        records: Option<OfferRecords>,
        across: Option<FastLinks>,
        max_bytes: usize,
        spin: Duration,
        stall: Option<Duration>,
    ) -> FastPath {
        let complete = size == 1
            || records.as_ref().is_some_and(|r| r.size() == size)
            || across.as_ref().is_some_and(|l| l.size() == size);
        FastPath {
            rank,
            size,
            records,
            across,
            complete,
            answer_due: AtomicBool::new(false),
            last_slot_us: AtomicU64::new(0),
            born: std::time::Instant::now(),
            max_bytes: max_bytes.min(OFFER_DATA_BYTES),
            spin,
            stall,
            outstanding: Arc::new(AtomicUsize::new(0)),
            timeline: AtomicBool::new(false),
            closing: AtomicBool::new(false),
            off: AtomicBool::new(false),
            failed: Mutex::new(None),
            taken: AtomicU64::new(0),
            declined: AtomicU64::new(0),
            state: Mutex::new(State {
                posted: 0,
                last_offer: [0; 2],
                busy: false,
                offering: None,
                closed: false,
            }),
            scratch: Mutex::new(Scratch {
                desc: Vec::with_capacity(OFFER_DESC_BYTES),
                peer_desc: vec![0; OFFER_DESC_BYTES],
                own: Vec::new(),
            }),
        }
    }

    /// The counter of this rank's ops in the engine (handles decrement it on completion).
    pub(crate) fn outstanding(&self) -> &Arc<AtomicUsize> {
        &self.outstanding
    }

    /// (ops reduced on the fast path, offers that went to the engine after all).
    pub fn stats(&self) -> (u64, u64) {
        (
            self.taken.load(Ordering::Relaxed),
            self.declined.load(Ordering::Relaxed),
        )
    }

    /// Ops go through the engine while a timeline is written.
    pub(crate) fn set_timeline(&self, on: bool) {
        self.timeline.store(on, Ordering::Relaxed);
    }

    fn publish(&self, word: BoardWord, value: u64) {
        if let Some(records) = &self.records {
            records.mine(word).store(value, Ordering::Release);
        }
    }

    fn ring(&self) {
        if let Some(records) = &self.records {
            records.ring();
        }
    }

    /// The other ranks.
    fn peers(&self) -> impl Iterator<Item = usize> {
        let rank = self.rank;
        (0..self.size).filter(move |&r| r != rank)
    }

    /// Takes a slot for an op that goes to the engine.
    pub(crate) fn decline(&self) {
        let mut st = self.state.lock();
        if st.closed {
            return;
        }
        st.posted += 1;
        self.publish(BoardWord::Posted, st.posted);
        if !st.busy {
            self.publish(BoardWord::Done, st.posted);
        }
        drop(st);
        self.ring();
        // Offers of this slot already read are answered now; those still on their way, when
        // they are read.
        if let Some(links) = &self.across {
            self.took_slot();
            self.answer_soon(links);
        }
    }

    /// Never offers again and lets peers stop waiting on this rank (join, shutdown). A fast
    /// op of this rank still waiting fails with `Shutdown`.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
        self.stop_taking_part();
    }

    /// Takes no more slots and offers no more: what [`FastPath::close`] does beyond failing
    /// this rank's waits, and all a rank does when a peer across hosts has closed (no slot
    /// could be fast again, but this rank's own offer still waiting is answered as usual).
    fn stop_taking_part(&self) {
        self.off.store(true, Ordering::Release);
        let mut st = self.state.lock();
        if st.closed {
            return;
        }
        st.closed = true;
        self.publish(BoardWord::Posted, u64::MAX);
        if !st.busy {
            self.publish(BoardWord::Done, u64::MAX);
        }
        if let Some(links) = &self.across {
            // Best effort, to the peers this rank has posted to (a peer that is gone learns
            // nothing, and needs nothing); others that offer later are answered so when their
            // offer is read ([`FastPath::answer`]).
            for r in self.peers() {
                if links.connected(r) {
                    let _ = links.post(r, PostKind::Closed, st.posted, &[], &[], None);
                }
            }
        }
        drop(st);
        self.ring();
    }

    /// The engine failed with `err`: later offers fail with it, and peers stop waiting on
    /// this rank.
    pub(crate) fn fail(&self, err: Error) {
        self.failed.lock().get_or_insert(err);
        self.close();
    }

    /// Whether the path takes ops at all: every rank on this host (or one rank on each host),
    /// a size limit, no timeline, not closed.
    fn on(&self) -> bool {
        self.complete
            && self.max_bytes > 0
            && !self.timeline.load(Ordering::Relaxed)
            && !self.off.load(Ordering::Relaxed)
    }

    /// The tensor of `op` if it is an op the fast path takes.
    fn eligible<'a>(&self, op: &'a OpSpec) -> Option<&'a TensorBuf> {
        if !self.on() || op.set_id != 0 || op.tensors.len() != 1 {
            return None;
        }
        // Across hosts only allreduces, the small op a training step waits on.
        if self.across.is_some()
            && (op.kind != OpKind::Allreduce || op.tensors[0].meta.nbytes() > across::MAX_BYTES)
        {
            return None;
        }
        let t = &op.tensors[0];
        let n = t.meta.nbytes();
        let host = |b: &TensorBuf| !matches!(b, TensorBuf::Device { .. });
        let out_ok = match (op.kind, t.output.as_ref()) {
            (OpKind::Allreduce, Some(out)) => {
                check_reducible(t.meta.dtype, op.op).is_ok() && host(out) && out.len() == n
            }
            (OpKind::Broadcast, Some(out)) => op.root < self.size && host(out) && out.len() == n,
            // The gathered tensor is allocated here, once every rank's row count is known.
            (OpKind::Allgather, None) => !t.meta.shape.is_empty(),
            // Other reductions, and dims that do not split, are the engine's to refuse.
            (OpKind::Reducescatter, None) => {
                matches!(op.op, ReduceOp::Sum | ReduceOp::Average)
                    && check_reducible(t.meta.dtype, op.op).is_ok()
                    && !t.meta.shape.is_empty()
            }
            (OpKind::Alltoall, None) => {
                op.splits.is_empty() && t.meta.shape.first().is_some_and(|&d| d % self.size == 0)
            }
            _ => false,
        };
        (out_ok && host(&t.input) && t.input.len() == n && n <= self.max_bytes).then_some(&t.input)
    }

    /// The largest tensor, in bytes, that an op offered now could take this path with; 0
    /// when the path is off (several ranks on some host of a job that spans hosts, a timeline
    /// written, stalled ops failed, this rank closed). Across hosts only allreduces of at most
    /// 16 KiB are taken. A front end that may hold an op back until it is waited for, to offer
    /// it then, asks this first.
    pub fn max_bytes(&self) -> usize {
        if self.on() && !self.closing.load(Ordering::Relaxed) {
            if self.across.is_some() {
                self.max_bytes.min(across::MAX_BYTES)
            } else {
                self.max_bytes
            }
        } else {
            0
        }
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Offers a blocking op of one host tensor (see the module's notes; anything else is
    /// `Ineligible`). `Err`: a peer died or this rank shut down while waiting; the op did not
    /// happen.
    pub fn offer(&self, op: &mut OpSpec) -> Result<Outcome> {
        self.offer_or(op, &|| false)
    }

    /// [`FastPath::offer`] that gives up with `Interrupted` when `stop` says so, asked between
    /// sleeps while the op waits on a peer (a signal for the caller's thread). A slot already
    /// taken stays taken and this rank's offer stays readable: the peers complete the op
    /// without this rank's result, as they would with a rank that died after offering.
    pub fn offer_or(&self, op: &mut OpSpec, stop: &dyn Fn() -> bool) -> Result<Outcome> {
        if let Some(e) = &*self.failed.lock() {
            return Err(e.clone());
        }
        let Some(input) = self.eligible(op) else {
            return Ok(Outcome::Ineligible);
        };
        let mut guard = self.scratch.lock();
        let sc = &mut *guard;
        sc.desc.clear();
        describe(op, &mut sc.desc);
        if sc.desc.len() > OFFER_DESC_BYTES {
            return Ok(Outcome::Ineligible);
        }
        let dtype = op.tensors[0].meta.dtype;
        let rows = op.tensors[0].meta.shape.first().copied().unwrap_or(1) as u64;
        sc.own.clear();
        let copied = offers_a_copy(op);
        // A broadcast's payload is the root's alone; the others offer only the descriptor.
        if copied && (op.kind != OpKind::Broadcast || op.root == self.rank) {
            crate::sys::copy::extend(&mut sc.own, input.as_slice());
            if matches!(op.kind, OpKind::Allreduce | OpKind::Reducescatter) {
                scale(dtype, &mut sc.own, op.prescale)?;
            }
        }
        if let Some(links) = &self.across {
            return self.offer_across(links, op, sc, stop);
        }
        let payload = if copied {
            &sc.own[..]
        } else {
            input.as_slice()
        };
        let mut st = self.state.lock();
        if st.closed || st.busy || self.outstanding.load(Ordering::Acquire) != 0 {
            return Ok(Outcome::Ineligible);
        }
        // Nobody may still be reading the offer last written to this slot's record.
        let slot = st.posted;
        let last = st.last_offer[(slot % 2) as usize];
        for r in self.peers() {
            self.wait(r, &op.name, stop, |b| {
                b.theirs(r, BoardWord::Done).load(Ordering::Acquire) >= last
            })?;
        }
        if let Some(records) = &self.records {
            records.write_offer(slot, &sc.desc, payload, rows);
        }
        st.posted = slot + 1;
        st.last_offer[(slot % 2) as usize] = slot + 1;
        st.busy = true;
        self.publish(BoardWord::Posted, slot + 1);
        drop(st);
        self.ring();

        let result = self.decide_and_reduce(op, slot, sc, stop);
        let mut st = self.state.lock();
        st.busy = false;
        let done = if st.closed { u64::MAX } else { st.posted };
        self.publish(BoardWord::Done, done);
        drop(st);
        self.ring();
        self.count(result)
    }

    /// Counts an offer's outcome in [`FastPath::stats`] and hands it back.
    fn count(&self, result: Result<Outcome>) -> Result<Outcome> {
        match result {
            Ok(Outcome::Done) => self.taken.fetch_add(1, Ordering::Relaxed),
            _ => self.declined.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    /// Every rank's offer records, which a complete fast path (the only one that offers) has.
    fn peer_records(&self) -> &OfferRecords {
        self.records
            .as_ref()
            .expect("complete: every peer's records")
    }
}

/// Whether this rank offers a copy of its input rather than the input as it lies: an
/// allreduce's or broadcast's output may be its input (in place), which the reduction then
/// writes while reading this rank's offer, and a pre-scaled reduction offers its input
/// scaled. The other ops write a new buffer.
fn offers_a_copy(op: &OpSpec) -> bool {
    match op.kind {
        OpKind::Allreduce | OpKind::Broadcast => true,
        OpKind::Reducescatter => op.prescale != 1.0,
        _ => false,
    }
}

/// The bytes every rank's offer must match: kind, reduction, root, dtype, shape, scale
/// factors, name.
fn describe(op: &OpSpec, out: &mut Vec<u8>) {
    let meta = &op.tensors[0].meta;
    out.push(op.kind as u8);
    out.push(op.op as u8);
    out.extend_from_slice(&(op.root as u64).to_le_bytes());
    out.push(meta.dtype as u8);
    out.extend_from_slice(&(meta.shape.len() as u32).to_le_bytes());
    // An allgather's first dimension may differ per rank: it travels in `Rows`.
    let skip = usize::from(op.kind == OpKind::Allgather);
    for d in &meta.shape[skip.min(meta.shape.len())..] {
        out.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    out.extend_from_slice(&op.prescale.to_bits().to_le_bytes());
    out.extend_from_slice(&op.postscale.to_bits().to_le_bytes());
    out.extend_from_slice(op.name.as_bytes());
}
