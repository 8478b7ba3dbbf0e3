//! A pair's board: a page of words per side, after the segment's header, where each side
//! posts counters of the ops it has taken and finished and rings the other, so that the ranks
//! of one host can agree on an op (whose offer lies in [`crate::transport::offers`]) without
//! anyone in between. Its user keeps the protocol of the words.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{off_closed, ShmLink, HEADER, LINE, PAGE};
use crate::bootstrap::net::{poll, poll_fd};
use crate::error::Result;
use crate::transport::sys;

/// A side's area: a page of words.
pub(super) const BOARD_SIDE: usize = PAGE;
pub(super) const BOARD: usize = HEADER;
/// Offset of a board word (`BoardWord as usize` lines into a side's area).
const fn off_board(side: usize, word: BoardWord) -> usize {
    BOARD + side * BOARD_SIDE + LINE * word as usize
}
const _: () = assert!(LINE * (BoardWord::Reduced as usize + 1) <= PAGE);

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
    /// Slots whose split allreduce this side has reduced its segment of (in its offer record).
    Reduced = 4,
}

impl ShmLink {
    /// This pair's board: usable from any thread, alive as long as the view even after the
    /// link is dropped.
    pub(crate) fn board(&self) -> Result<BoardView> {
        Ok(BoardView {
            peer: self.peer,
            side: self.side,
            map: self.map.clone(),
            hangup: self.doorbell.clone(),
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
    /// The pair's doorbell, only ever polled for hang-up here (never read: the link owns the
    /// wake-up bytes).
    hangup: Arc<UnixStream>,
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
