//! Offer records: a small segment per rank of a one-host job, mapped by every other rank
//! ([`super::host_memory`]'s segments), where the fast path writes the op it offers (a
//! descriptor, the payload's rows, the payload) once for all its peers to read in place.
//!
//! **Why not on the pairs' boards.** An offer written to every pair's board is written
//! `n - 1` times: on 16 ranks a 64 KiB allreduce wrote 960 KiB per rank and op, half of what
//! the whole op moved through memory. Here it is written once. The pairs' boards keep the
//! words the ranks agree and sleep on.
//!
//! **Two records per rank**, used by slot parity: an offer of slot `s` goes to record `s % 2`,
//! marked with `s`, so a rank can post its next offer while a peer still reads its last one.
//! With one record every offer waited until every peer had finished reading the previous one:
//! when ranks outnumber cores that is one more turn on a core per rank and op, for every rank.
//! The caller's protocol (the boards' `Posted` and `Done` words) says when a record may be
//! read and rewritten; a peer's words are untrusted here: lengths are range-checked.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::host_memory::HostMemory;
use super::sys::Mapping;

const PAGE: usize = 4096;
/// Payload bytes a record holds: the fast path's largest op.
pub const OFFER_DATA_BYTES: usize = 64 << 10;
/// A record: a page holding the offer's slot, the descriptor's length, the payload's rows and
/// the descriptor, then the payload, then the result area (where a split allreduce leaves the
/// segment this rank reduced, at the segment's place in the tensor).
const RECORD: usize = PAGE + 2 * OFFER_DATA_BYTES;
const RESULT: usize = PAGE + OFFER_DATA_BYTES;
/// Bytes of a rank's segment: its two records.
pub const OFFER_SEGMENT_BYTES: usize = 2 * RECORD;
/// 1 + the slot of the offer the record holds (0: none yet).
const OFF_OFFER: usize = 0;
const OFF_DESC_LEN: usize = 8;
const OFF_ROWS: usize = 16;
const OFF_DESC: usize = 24;
/// Largest descriptor a record holds.
pub const OFFER_DESC_BYTES: usize = PAGE - OFF_DESC;

/// Offset of the record an offer of `slot` uses.
const fn record(slot: u64) -> usize {
    (slot % 2) as usize * RECORD
}

/// Every rank's offer records as this rank sees them: its own (written only by this rank's
/// fast path, under its lock) and the others' (read only).
pub struct OfferRecords {
    rank: usize,
    maps: Vec<Arc<Mapping>>,
}

impl std::fmt::Debug for OfferRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OfferRecords")
            .field("rank", &self.rank)
            .field("ranks", &self.maps.len())
            .finish()
    }
}

impl OfferRecords {
    /// The records of `memory` (segments of [`OFFER_SEGMENT_BYTES`], one per rank of the job),
    /// or `None` unless every rank's segment is mapped here.
    pub fn new(memory: HostMemory) -> Option<OfferRecords> {
        let rank = memory.rank();
        if memory.len() != OFFER_SEGMENT_BYTES {
            return None;
        }
        let maps = memory
            .into_mappings()
            .into_iter()
            .collect::<Option<Vec<_>>>()?;
        Some(OfferRecords { rank, maps })
    }

    /// Writes this rank's offer of `slot`: its descriptor, payload and the payload's rows
    /// (before it publishes `Posted`, whose release makes them visible).
    pub(crate) fn write_offer(&self, slot: u64, desc: &[u8], data: &[u8], rows: u64) {
        assert!(desc.len() <= OFFER_DESC_BYTES && data.len() <= OFFER_DATA_BYTES);
        let map = &self.maps[self.rank];
        let base = record(slot);
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
        self.maps[r]
            .atomic(record(slot) + OFF_OFFER)
            .load(Ordering::Relaxed)
            == slot + 1
    }

    /// Whether rank `r`'s descriptor of `slot` equals `desc` (read once
    /// [`OfferRecords::offered`] said so).
    pub(crate) fn same_desc(&self, r: usize, slot: u64, desc: &[u8], scratch: &mut [u8]) -> bool {
        let map = &self.maps[r];
        let base = record(slot);
        let len = map.atomic(base + OFF_DESC_LEN).load(Ordering::Relaxed);
        if len != desc.len() as u64 || desc.len() > scratch.len() {
            return false;
        }
        map.read(base + OFF_DESC, &mut scratch[..desc.len()]);
        scratch[..desc.len()] == *desc
    }

    /// The rows of rank `r`'s payload of `slot` (an allgather's first dimension), unchecked.
    pub(crate) fn rows(&self, r: usize, slot: u64) -> u64 {
        self.maps[r]
            .atomic(record(slot) + OFF_ROWS)
            .load(Ordering::Relaxed)
    }

    /// Writes `bytes` at `at` of this rank's result area of `slot` (before it publishes
    /// `Reduced`, whose release makes them visible).
    pub(crate) fn write_result(&self, slot: u64, at: usize, bytes: &[u8]) {
        assert!(at + bytes.len() <= OFFER_DATA_BYTES);
        self.maps[self.rank].write(record(slot) + RESULT + at, bytes);
    }

    /// Bytes `range` of rank `r`'s result area of `slot`: valid from its `Reduced` past
    /// `slot` until this rank publishes a `Done` past it.
    pub(crate) fn result(&self, r: usize, slot: u64, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= OFFER_DATA_BYTES);
        self.maps[r].bytes(record(slot) + RESULT + range.start, range.len())
    }

    /// Bytes `range` of rank `r`'s payload of `slot`, read where they lie: valid from its
    /// offer of `slot` until this rank publishes a `Done` past it.
    pub(crate) fn data(&self, r: usize, slot: u64, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= OFFER_DATA_BYTES);
        self.maps[r].bytes(record(slot) + PAGE + range.start, range.len())
    }
}
