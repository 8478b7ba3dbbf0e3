//! A pair's board: one area per side, after the segment's header, where each side posts
//! the op it is about to run (a descriptor and its payload) and counters of the ops it has
//! taken and finished, so that the ranks of one host can agree on an op and read each other's
//! inputs in place without anyone in between. Its user keeps the protocol of the words.
//!
//! A side has two records, used by slot parity: an offer of slot `s` goes to record `s % 2`,
//! so a side can post its next offer while a peer still reads its last one. With one record
//! every offer waited until every peer had finished reading the previous one: when ranks
//! outnumber cores that is one more turn on a core per rank and op, for every rank.

use std::ops::Range;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{off_closed, ShmLink, HEADER, LINE, PAGE};
use crate::bootstrap::net::{poll, poll_fd};
use crate::error::Result;
use crate::transport::sys;

/// Payload bytes one side of a pair's board holds: the fast path's largest op.
pub const BOARD_DATA_BYTES: usize = 64 << 10;
/// A record: a page holding the descriptor's length, the payload's rows and the descriptor,
/// then the payload.
const RECORD: usize = PAGE + BOARD_DATA_BYTES;
/// A side's area: a page of words, then its two records.
pub(super) const BOARD_SIDE: usize = PAGE + 2 * RECORD;
pub(super) const BOARD: usize = HEADER;
/// Offset of a board word (`BoardWord as usize` lines into a side's area).
const fn off_board(side: usize, word: BoardWord) -> usize {
    BOARD + side * BOARD_SIDE + LINE * word as usize
}
/// Offset of the record a side's offer of `slot` uses.
const fn off_record(side: usize, slot: u64) -> usize {
    BOARD + side * BOARD_SIDE + PAGE + (slot % 2) as usize * RECORD
}
/// 1 + the slot of the offer the record holds (0: none yet).
const OFF_OFFER: usize = 0;
const OFF_DESC_LEN: usize = 8;
const OFF_ROWS: usize = 16;
const OFF_DESC: usize = 24;
/// Largest descriptor a board record holds.
pub const BOARD_DESC_BYTES: usize = PAGE - OFF_DESC;
const _: () = assert!(LINE * (BoardWord::Waiting as usize + 1) <= PAGE);

/// The words of a side's board record, each on its own line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BoardWord {
    /// Slots this side has taken (`u64::MAX`: never again).
    Posted = 0,
    /// Slots below this one this side will never read again.
    Done = 1,
    /// Changes with every store above; its low 32 bits are the futex word peers sleep on.
    Bell = 2,
    /// This side sleeps on the other side's bell.
    Waiting = 3,
}

impl ShmLink {
    /// This pair's board: usable from any thread, alive as long as the view even after the
    /// link is dropped.
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

    /// Writes this rank's offer of `slot`: its descriptor, payload and the payload's rows
    /// (before it publishes `Posted`, whose release makes them visible).
    pub(crate) fn write_offer(&self, slot: u64, desc: &[u8], data: &[u8], rows: u64) {
        assert!(desc.len() <= BOARD_DESC_BYTES && data.len() <= BOARD_DATA_BYTES);
        let base = off_record(self.side, slot);
        self.map
            .atomic(base + OFF_OFFER)
            .store(slot + 1, Ordering::Relaxed);
        self.map.write(base + OFF_DESC, desc);
        self.map
            .atomic(base + OFF_DESC_LEN)
            .store(desc.len() as u64, Ordering::Relaxed);
        self.map
            .atomic(base + OFF_ROWS)
            .store(rows, Ordering::Relaxed);
        self.map.write(base + PAGE, data);
    }

    /// Whether the peer offered `slot` (read after its `Posted` past `slot` was seen with
    /// `Acquire`). The record stays until this side's `Done` passes `slot`, so a peer already
    /// posting its next offer does not hide this one.
    pub(crate) fn peer_offered(&self, slot: u64) -> bool {
        self.map
            .atomic(off_record(1 - self.side, slot) + OFF_OFFER)
            .load(Ordering::Relaxed)
            == slot + 1
    }

    /// Whether the peer's descriptor of `slot` equals `desc` (read once [`BoardView::peer_offered`] said so).
    pub(crate) fn same_desc(&self, slot: u64, desc: &[u8], scratch: &mut [u8]) -> bool {
        let base = off_record(1 - self.side, slot);
        let len = self.map.atomic(base + OFF_DESC_LEN).load(Ordering::Relaxed);
        if len != desc.len() as u64 || desc.len() > scratch.len() {
            return false;
        }
        self.map.read(base + OFF_DESC, &mut scratch[..desc.len()]);
        scratch[..desc.len()] == *desc
    }

    /// The rows of the peer's payload of `slot` (an allgather's first dimension), unchecked.
    pub(crate) fn peer_rows(&self, slot: u64) -> u64 {
        self.map
            .atomic(off_record(1 - self.side, slot) + OFF_ROWS)
            .load(Ordering::Relaxed)
    }

    /// Bytes `range` of the peer's payload of `slot`, read where they lie: valid from the
    /// peer's `Offer` of `slot` (seen with `Acquire`) until this side publishes a `Done` past
    /// it.
    pub(crate) fn peer_data(&self, slot: u64, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= BOARD_DATA_BYTES);
        self.map.bytes(
            off_record(1 - self.side, slot) + PAGE + range.start,
            range.len(),
        )
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
