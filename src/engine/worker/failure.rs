//! How the worker fails: the error it gives every pending op, made as specific as what it has
//! heard allows (a verdict on its way from the coordinator, a rank that left or stalled), and
//! the next op under a name's base that a failed one lets through.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{SetWaiter, Worker};
use crate::control::message::{FromCoordinator, Request, ToCoordinator};
use crate::error::Error;
use crate::sys::wait_readable;

impl Worker {
    /// After a data-plane failure: the coordinator knows which process really died (a peer
    /// that merely reacted to the death also drops its links). A stall this rank saw itself
    /// is reported first, so that every rank learns who stopped. Then wait briefly for the
    /// coordinator's verdict.
    pub(super) fn diagnose(&mut self, err: Error) -> Error {
        if let Error::Timeout { what, .. } = &err {
            if let Some(rank) = crate::error::rank_named_in(what) {
                self.send(ToCoordinator::Stalled {
                    rank,
                    detail: err.to_string(),
                });
            }
        }
        if !matches!(err, Error::PeerLost { .. } | Error::Timeout { .. }) {
            return err;
        }
        let deadline = Instant::now() + Duration::from_millis(1500);
        while Instant::now() < deadline {
            let _ = wait_readable(&[self.control.fd()], Duration::from_millis(50));
            let (verdict, open) = self.verdict_in_flight();
            if let Some(verdict) = verdict {
                return verdict;
            }
            if !open {
                break;
            }
        }
        err
    }

    /// A `RankFailed` verdict already received but not yet read, if any, and whether the
    /// connection is still open. Only for a rank that is failing anyway: other messages read
    /// here are dropped.
    pub(super) fn verdict_in_flight(&mut self) -> (Option<Error>, bool) {
        let open = matches!(self.control.fill(), Ok(true));
        while let Ok(Some(frame)) = self.control.next_frame() {
            match FromCoordinator::decode(&frame) {
                Ok(FromCoordinator::RankFailed {
                    rank,
                    detail,
                    stalled,
                }) => return (Some(self.verdict(rank, detail, stalled)), open),
                Ok(m @ FromCoordinator::PathClosed { .. }) => {
                    self.on_message(m);
                    return (self.path_closed.take(), open);
                }
                _ => {}
            }
        }
        (None, open)
    }

    /// The error for the coordinator's verdict on `rank`.
    pub(super) fn verdict(&self, rank: usize, detail: String, stalled: bool) -> Error {
        if stalled {
            Error::Timeout {
                what: format!("rank {rank} stopped making progress: {detail}"),
                after: self.timeout,
            }
        } else {
            Error::PeerLost { rank, detail }
        }
    }

    /// Marks the engine failed: every pending and future op gets `err`, and links are closed
    /// so peers blocked on this rank fail fast too.
    pub(super) fn fail(&mut self, err: Error) {
        if self.failed.is_none() {
            // The fast path first: a peer waiting there on this rank then sees it decline
            // and asks the engine, which names the rank that really died, instead of
            // blaming this one when its links close.
            self.shared.fast.fail(err.clone());
            if let Some(m) = &self.shared.messenger {
                m.fail(err.clone());
            }
            self.transport.abort();
            self.failed = Some(err.clone());
        }
        self.fail_all(err);
    }

    /// `request`'s op completed here: the next op under its shared base, if one waits, goes
    /// to the coordinator (see [`Op::base`](crate::control::message::Op::base)).
    pub(super) fn next_under_base(&mut self, request: &Request) {
        let Some(base) = request.base() else {
            return;
        };
        let key = (request.set_id, base.to_string());
        match self.bases.get_mut(&key).map(VecDeque::pop_front) {
            Some(Some(next)) => self.send(ToCoordinator::Submit(vec![next])),
            Some(None) => drop(self.bases.remove(&key)),
            None => {}
        }
    }

    pub(super) fn fail_all(&mut self, err: Error) {
        self.bases.clear();
        for (_, e) in self.pending.drain() {
            e.handle.complete(Err(err.clone()));
        }
        if let Some(h) = self.join.take() {
            h.complete(Err(err.clone()));
        }
        for w in self.set_waiters.drain(..) {
            match w {
                SetWaiter::Add(_, _, tx) => drop(tx.send(Err(err.clone()))),
                SetWaiter::Remove(_, tx) => drop(tx.send(Err(err.clone()))),
            }
        }
    }
}
