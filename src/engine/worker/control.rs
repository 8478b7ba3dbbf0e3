//! The worker's side of its control connection: submissions up to its node, and what comes
//! back down (responses, a rank's departure, set changes, stall verdicts) turned into work or
//! failures.

use super::{SetWaiter, Worker};
use crate::control::message::{FromCoordinator, Request, Submit, ToCoordinator};
use crate::error::Error;

impl Worker {
    pub(super) fn send(&mut self, msg: ToCoordinator) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.control.send(&msg.encode(), self.timeout) {
            self.control_failed(e);
        }
    }

    /// Writes submissions the coordinator could not take yet. Returns whether any went out.
    pub(super) fn flush_control(&mut self) -> bool {
        if self.failed.is_some() || !self.control.has_output() {
            return false;
        }
        match self.control.flush(self.timeout) {
            Ok(moved) => moved,
            Err(e) => {
                self.control_failed(e);
                true
            }
        }
    }

    /// Fails the worker after sending to the coordinator failed with `e`.
    fn control_failed(&mut self, e: Error) {
        // The coordinator may have told us why before it closed (a Unix socket fails the
        // write at once, before we have read that): its verdict names the real cause.
        if let (Some(verdict), _) = self.verdict_in_flight() {
            self.fail(verdict);
            return;
        }
        let e = self.control_closed(e);
        self.fail(e);
    }

    /// The error for a control connection that closed or broke with `e`: what the node said
    /// before it went, if anything, else that the path to the coordinator is gone.
    fn control_closed(&mut self, e: Error) -> Error {
        if let Some(why) = self.path_closed.take() {
            return why;
        }
        if self.coordinator_left {
            return Error::Shutdown(
                "rank 0 has shut down, so this job cannot run collectives any more".into(),
            );
        }
        coordinator_lost(e, self.control.peer)
    }

    /// Reads and handles control messages. Returns whether anything happened.
    pub(super) fn read_control(&mut self) -> bool {
        if !self.control_open {
            return false;
        }
        let open = self.control.fill();
        if !matches!(open, Ok(true)) {
            // A closed socket polls readable forever: stop watching it, or the loop spins.
            self.control_open = false;
        }
        let mut any = false;
        loop {
            match self.control.next_frame() {
                Ok(Some(frame)) => {
                    any = true;
                    match FromCoordinator::decode(&frame) {
                        Ok(msg) => self.on_message(msg),
                        Err(e) => {
                            self.fail(Error::Decode(format!("from the coordinator: {e}")));
                            return true;
                        }
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    self.fail(e);
                    return true;
                }
            }
        }
        match open {
            Ok(true) => {}
            Ok(false) | Err(_) => {
                if self.failed.is_none() {
                    let e = self.control_closed(match open {
                        Err(e) => e,
                        _ => Error::Io("connection closed".into()),
                    });
                    self.fail(e);
                }
                any = true;
            }
        }
        any
    }

    pub(super) fn on_message(&mut self, msg: FromCoordinator) {
        match msg {
            FromCoordinator::Responses(rs) => {
                if let Some(t) = self.timeline.as_ref().filter(|t| t.mark_cycles) {
                    t.mark("CYCLE_START");
                }
                for r in rs {
                    if !self.shutdown_requested {
                        self.drain_queue();
                    }
                    self.execute(r);
                }
            }
            FromCoordinator::CacheMiss { set_id, id } => {
                let key = self
                    .cache
                    .iter()
                    .find(|(_, (cid, _))| *cid == id)
                    .map(|(k, _)| k.clone());
                if let Some(key) = key {
                    self.cache.remove(&key);
                    if key.0 == set_id {
                        if let Some(entry) = self.pending.get(&key) {
                            let req = entry.request.clone();
                            self.send(ToCoordinator::Submit(vec![Submit::Full(req)]));
                        }
                    }
                }
            }
            FromCoordinator::SetAdded {
                ranks,
                timeout_ms,
                result,
            } => {
                if let Ok(id) = result {
                    self.sets.insert(id, ranks.clone());
                    self.shared.sets.lock().insert(id, ranks.clone());
                }
                let asked = self.set_waiters.iter().position(
                    |w| matches!(w, SetWaiter::Add(r, t, _) if *r == ranks && *t == timeout_ms),
                );
                if let Some(SetWaiter::Add(_, _, tx)) =
                    asked.and_then(|i| self.set_waiters.remove(i))
                {
                    let _ = tx.send(result.map_err(Error::InvalidArgument));
                }
            }
            FromCoordinator::SetRemoved { id, result } => {
                if result == Ok(true) {
                    self.sets.remove(&id);
                    self.shared.sets.lock().remove(&id);
                    self.cache.retain(|(s, _), _| *s != id);
                }
                let asked = self
                    .set_waiters
                    .iter()
                    .position(|w| matches!(w, SetWaiter::Remove(i, _) if *i == id));
                if let Some(SetWaiter::Remove(_, tx)) =
                    asked.and_then(|i| self.set_waiters.remove(i))
                {
                    let _ = tx.send(result.map_err(Error::InvalidArgument));
                }
            }
            FromCoordinator::Ready => {}
            FromCoordinator::RankLeft { rank } => {
                if rank == 0 {
                    self.coordinator_left = true;
                }
            }
            FromCoordinator::RankFailed {
                rank,
                detail,
                stalled,
            } => {
                let e = self.verdict(rank, detail, stalled);
                self.fail(e);
            }
            FromCoordinator::PathClosed {
                rank,
                clean,
                detail,
            } => {
                self.path_closed = Some(if clean {
                    Error::Shutdown(format!(
                        "rank {rank} has shut down and this rank's control path ran through \
                         it, so this job cannot run collectives any more"
                    ))
                } else {
                    Error::PeerLost {
                        rank,
                        detail: format!(
                            "this rank's control path to the coordinator ran through it: {detail}"
                        ),
                    }
                });
            }
            // Only a node gets batches to pass down.
            FromCoordinator::Down(_) => {}
        }
    }

    /// Remembers a cache id the coordinator assigned.
    pub(super) fn remember(&mut self, request: &Request, id: u64) {
        if self.cache_capacity == 0 {
            return;
        }
        if self.cache.len() >= self.cache_capacity {
            // Any victim is correct: a stale id is answered with CacheMiss and resent in full.
            if let Some(k) = self.cache.keys().next().cloned() {
                self.cache.remove(&k);
            }
        }
        self.cache.insert(
            (request.set_id, request.name.clone()),
            (id, request.clone()),
        );
    }
}

/// The error for a broken control connection to the node of rank `node`.
fn coordinator_lost(e: Error, node: usize) -> Error {
    let detail = match e {
        Error::PeerLost { detail, .. } => detail,
        other => other.to_string(),
    };
    let to = if node == 0 {
        "the coordinator on rank 0".to_string()
    } else {
        format!("its control node on rank {node}")
    };
    Error::PeerLost {
        rank: node,
        detail: format!("lost the connection to {to} ({detail})"),
    }
}
