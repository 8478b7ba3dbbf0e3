//! Offer records and boards: a part per rank of one segment that every rank of a one-host job
//! maps. The fast path writes in its part the op it offers (a descriptor, the payload's rows,
//! the payload) once for all its peers to read in place, and the words by which the ranks agree
//! on ops and sleep: its *board*.
//!
//! **One segment for the host.** The first rank makes it and hands it to each other rank
//! ([`super::host_memory`]'s `serve` and `fetch`): a rank makes one exchange and one mapping at
//! start, not one per peer (at 512 ranks on one host, the exchanges of a segment per rank took
//! 3.4 s of the job's 8.8 s start). The ranks that mapped it count themselves on the first
//! rank's board, which then says whether all did, so every rank uses the records or none does.
//!
//! **Why one record per rank, not one per pair.** Every word a rank publishes (the slots it
//! has taken, those it will not read again, the split allreduce's `Reduced`) is the same for
//! all its peers. Written to a board per pair, an offer was written `n - 1` times (on 16 ranks
//! a 64 KiB allreduce wrote 960 KiB per rank and op, half of what the whole op moved through
//! memory), each word `n - 1` times and each bell rung `n - 1` times; and the fast path needed a
//! shared-memory pair with every rank of the host from the start. Here each is written once,
//! a ring is one store and at most one wake-up, and the fast path needs no pair at all.
//!
//! **Two records per rank**, used by slot parity: an offer of slot `s` goes to record `s % 2`,
//! marked with `s`, so a rank can post its next offer while a peer still reads its last one.
//! With one record every offer waited until every peer had finished reading the previous one:
//! when ranks outnumber cores that is one more turn on a core per rank and op, for every rank.
//! The caller's protocol (the boards' `Posted` and `Done` words) says when a record may be
//! read and rewritten; a peer's words are untrusted here: lengths are range-checked.
//!
//! **Sleeping.** A rank's board has a bell (bumped after every change of its words; its low
//! half is the futex word peers sleep on) and a count of the peers asleep on it. A sleeper
//! counts itself in, issues a `SeqCst` fence and checks its condition once more before it
//! blocks; a ringer bumps the bell, issues a `SeqCst` fence and wakes every sleeper if the
//! count is not zero. Either the sleeper sees the new words or the ringer sees the count, so no
//! wake-up is lost, and a rank whose peers are all awake rings without a system call. A peer
//! that dies is not seen here: the engine learns it from the control connections and fails
//! the fast path (see `engine::fast`).

use std::ops::Range;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::host_memory::{fetch, Exposed};
use crate::sys::{self, Mapping};

const PAGE: usize = 4096;
/// Each board word has a 128-byte line of its own (two cache lines: adjacent-line prefetch),
/// so a peer polling one word does not slow the writer of another.
const LINE: usize = 128;

/// The words of a rank's board.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BoardWord {
    /// Slots this rank has taken (`u64::MAX`: never again).
    Posted = 0,
    /// Slots below this one this rank will never read again.
    Done = 1,
    /// Changes with every store above; its low 32 bits are the futex word peers sleep on.
    Bell = 2,
    /// Peers asleep on this rank's bell (written by them).
    Sleepers = 3,
    /// Slots whose split allreduce this rank has reduced its segment of (in its record).
    Reduced = 4,
    /// Ranks that mapped the segment (on the first rank's board, at start).
    Joined = 5,
    /// Whether every rank mapped it: 1 yes, 2 no, 0 not yet said (the first rank's board).
    Verdict = 6,
}
const _: () = assert!(LINE * (BoardWord::Verdict as usize + 1) <= PAGE);

/// The board comes first in a rank's part, then its two records.
const RECORDS: usize = PAGE;
/// Payload bytes a record holds: the fast path's largest op.
pub const OFFER_DATA_BYTES: usize = 64 << 10;
/// A record: a page holding the offer's slot, the descriptor's length, the payload's rows and
/// the descriptor, then the payload, then the result area (where a split allreduce leaves the
/// segment this rank reduced, at the segment's place in the tensor).
const RECORD: usize = PAGE + 2 * OFFER_DATA_BYTES;
const RESULT: usize = PAGE + OFFER_DATA_BYTES;
/// Bytes of a rank's part of the segment: its board and its two records.
const PART: usize = RECORDS + 2 * RECORD;
/// 1 + the slot of the offer the record holds (0: none yet).
const OFF_OFFER: usize = 0;
const OFF_DESC_LEN: usize = 8;
const OFF_ROWS: usize = 16;
const OFF_DESC: usize = 24;
/// Largest descriptor a record holds.
pub const OFFER_DESC_BYTES: usize = PAGE - OFF_DESC;

/// Offset of rank `r`'s part of the segment.
const fn part(r: usize) -> usize {
    r * PART
}

/// Offset of the record rank `r`'s offer of `slot` uses.
const fn record(r: usize, slot: u64) -> usize {
    part(r) + RECORDS + (slot % 2) as usize * RECORD
}

/// Every rank's board and offer records as this rank sees them: its own (written only by this
/// rank's fast path, under its lock, but for the count of sleepers) and the others' (read
/// only, but for that count).
pub struct OfferRecords {
    rank: usize,
    size: usize,
    map: Arc<Mapping>,
}

impl std::fmt::Debug for OfferRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OfferRecords")
            .field("rank", &self.rank)
            .field("ranks", &self.size)
            .finish()
    }
}

impl OfferRecords {
    /// Bytes of the segment that holds `size` ranks' boards and records (pages are allocated
    /// as they are first touched: each rank touches its board, and its records as it offers).
    pub fn segment_bytes(size: usize) -> usize {
        size * PART
    }

    /// The records of a host's `size` ranks, or `None` on every rank alike. The first rank
    /// passes the segment it made (`made`, of [`OfferRecords::segment_bytes`]) and hands it
    /// to the others, which fetch it from its `address`; the first rank then says on its
    /// board whether all of them mapped it, by `deadline` (the others wait a little longer
    /// for its word).
    pub fn form(
        rank: usize,
        size: usize,
        made: Option<Exposed>,
        address: &[u8],
        deadline: Instant,
    ) -> Option<OfferRecords> {
        let len = Self::segment_bytes(size);
        if rank == 0 {
            let map = made?.serve(size - 1, deadline);
            let records = OfferRecords { rank, size, map };
            let joined = records.mine(BoardWord::Joined);
            while joined.load(Ordering::Acquire) < (size - 1) as u64 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(500));
            }
            let all = joined.load(Ordering::Acquire) == (size - 1) as u64;
            records.publish_verdict(if all { 1 } else { 2 });
            return all.then_some(records);
        }
        let map = match fetch(address, len, deadline) {
            Ok(map) => Arc::new(map),
            Err(why) => {
                log::warn!(
                    target: crate::LOG_TARGET,
                    "rank {rank}: no fast-path records from rank 0: {why}"
                );
                return None;
            }
        };
        let records = OfferRecords { rank, size, map };
        records
            .theirs(0, BoardWord::Joined)
            .fetch_add(1, Ordering::AcqRel);
        let verdict = || {
            records
                .theirs(0, BoardWord::Verdict)
                .load(Ordering::Acquire)
        };
        let late = deadline + Duration::from_secs(10);
        while verdict() == 0 && Instant::now() < late {
            records.sleep(0, || verdict() != 0, Duration::from_millis(20));
        }
        (verdict() == 1).then_some(records)
    }

    fn publish_verdict(&self, verdict: u64) {
        self.mine(BoardWord::Verdict)
            .store(verdict, Ordering::Release);
        self.ring();
    }

    /// The number of ranks.
    pub(crate) fn size(&self) -> usize {
        self.size
    }

    /// One of this rank's board words.
    pub(crate) fn mine(&self, w: BoardWord) -> &AtomicU64 {
        self.theirs(self.rank, w)
    }

    /// One of rank `r`'s board words.
    pub(crate) fn theirs(&self, r: usize, w: BoardWord) -> &AtomicU64 {
        self.map.atomic(part(r) + LINE * w as usize)
    }

    /// The low half of rank `r`'s bell, as a futex word.
    fn bell_word(&self, r: usize) -> &AtomicU32 {
        self.map.atomic32(part(r) + LINE * BoardWord::Bell as usize)
    }

    /// Bumps this rank's bell after its words changed and wakes the peers asleep on it. The
    /// `SeqCst` fence pairs with the one in [`OfferRecords::sleep`].
    pub(crate) fn ring(&self) {
        self.mine(BoardWord::Bell).fetch_add(1, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.mine(BoardWord::Sleepers).load(Ordering::Relaxed) != 0 {
            sys::futex_wake(self.bell_word(self.rank));
        }
    }

    /// Sleeps until rank `r` rings (or `timeout`), unless `ready` turns true once this rank
    /// has counted itself among `r`'s sleepers.
    pub(crate) fn sleep(&self, r: usize, ready: impl Fn() -> bool, timeout: Duration) {
        let seen = self.bell_word(r).load(Ordering::Acquire);
        let sleepers = self.theirs(r, BoardWord::Sleepers);
        sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if !ready() {
            sys::futex_wait(self.bell_word(r), seen, timeout);
        }
        sleepers.fetch_sub(1, Ordering::Relaxed);
    }

    /// Writes this rank's offer of `slot`: its descriptor, payload and the payload's rows
    /// (before it publishes `Posted`, whose release makes them visible).
    pub(crate) fn write_offer(&self, slot: u64, desc: &[u8], data: &[u8], rows: u64) {
        assert!(desc.len() <= OFFER_DESC_BYTES && data.len() <= OFFER_DATA_BYTES);
        let map = &self.map;
        let base = record(self.rank, slot);
        map.atomic(base + OFF_OFFER)
            .store(slot + 1, Ordering::Relaxed);
        map.write(base + OFF_DESC, desc);
        map.atomic(base + OFF_DESC_LEN)
            .store(desc.len() as u64, Ordering::Relaxed);
        map.atomic(base + OFF_ROWS).store(rows, Ordering::Relaxed);
        map.write(base + PAGE, data);
    }

    /// Whether rank `r` offered `slot` (read after its `Posted` past `slot` was seen with
    /// `Acquire`). The record stays until this rank's `Done` passes `slot`, so a peer already
    /// posting its next offer does not hide this one.
    pub(crate) fn offered(&self, r: usize, slot: u64) -> bool {
        self.map
            .atomic(record(r, slot) + OFF_OFFER)
            .load(Ordering::Relaxed)
            == slot + 1
    }

    /// Whether rank `r`'s descriptor of `slot` equals `desc` (read once
    /// [`OfferRecords::offered`] said so).
    pub(crate) fn same_desc(&self, r: usize, slot: u64, desc: &[u8], scratch: &mut [u8]) -> bool {
        let map = &self.map;
        let base = record(r, slot);
        let len = map.atomic(base + OFF_DESC_LEN).load(Ordering::Relaxed);
        if len != desc.len() as u64 || desc.len() > scratch.len() {
            return false;
        }
        map.read(base + OFF_DESC, &mut scratch[..desc.len()]);
        scratch[..desc.len()] == *desc
    }

    /// The rows of rank `r`'s payload of `slot` (an allgather's first dimension), unchecked.
    pub(crate) fn rows(&self, r: usize, slot: u64) -> u64 {
        self.map
            .atomic(record(r, slot) + OFF_ROWS)
            .load(Ordering::Relaxed)
    }

    /// Writes `bytes` at `at` of this rank's result area of `slot` (before it publishes
    /// `Reduced`, whose release makes them visible).
    pub(crate) fn write_result(&self, slot: u64, at: usize, bytes: &[u8]) {
        assert!(at + bytes.len() <= OFFER_DATA_BYTES);
        self.map.write(record(self.rank, slot) + RESULT + at, bytes);
    }

    /// Bytes `range` of rank `r`'s result area of `slot`: valid from its `Reduced` past
    /// `slot` until this rank publishes a `Done` past it.
    pub(crate) fn result(&self, r: usize, slot: u64, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= OFFER_DATA_BYTES);
        self.map
            .bytes(record(r, slot) + RESULT + range.start, range.len())
    }

    /// Bytes `range` of rank `r`'s payload of `slot`, read where they lie: valid from its
    /// offer of `slot` until this rank publishes a `Done` past it.
    pub(crate) fn data(&self, r: usize, slot: u64, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= OFFER_DATA_BYTES);
        self.map
            .bytes(record(r, slot) + PAGE + range.start, range.len())
    }
}
