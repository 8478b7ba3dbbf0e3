//! A pair's board: one record per side, after the segment's header, where each side posts
//! the op it is about to run (a descriptor and its payload) and counters of the ops it has
//! taken and finished, so that the ranks of one host can agree on an op and read each other's
//! inputs in place without anyone in between. Its user keeps the protocol of the words.

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
/// A side's record: a page of words and descriptor, then the payload.
pub(super) const BOARD_SIDE: usize = PAGE + BOARD_DATA_BYTES;
pub(super) const BOARD: usize = HEADER;
/// Offset of a board word (`BoardWord as usize` lines into a side's record).
const fn off_board(side: usize, word: BoardWord) -> usize {
    BOARD + side * BOARD_SIDE + LINE * word as usize
}
/// The descriptor: its length word, then its bytes up to the end of the record's first page.
const OFF_DESC_LEN: usize = LINE * 6;
const OFF_DESC: usize = LINE * 6 + 8;
/// Largest descriptor a board record holds.
pub const BOARD_DESC_BYTES: usize = PAGE - OFF_DESC;
const _: () = assert!(LINE * (BoardWord::Rows as usize + 1) <= OFF_DESC_LEN);

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

    /// Bytes `range` of the peer's payload, read where they lie: valid from the peer's
    /// `Offer` (seen with `Acquire`) until this side publishes a `Done` past that offer.
    pub(crate) fn peer_data(&self, range: Range<usize>) -> &[u8] {
        assert!(range.start <= range.end && range.end <= BOARD_DATA_BYTES);
        self.map.bytes(
            BOARD + (1 - self.side) * BOARD_SIDE + PAGE + range.start,
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
