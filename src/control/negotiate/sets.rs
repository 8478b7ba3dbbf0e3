//! Process sets made and removed while the job runs: requests to add or remove a set, sets
//! registered by their members alone, and the ops that must wait until no set is busy.

use super::respond::gone_error;
use super::{set_limit, Negotiator, Outbox, SetState};
use crate::control::message::{FromCoordinator, Response, ToCoordinator};
use crate::types::OpKind;

impl Negotiator {
    /// Whether `ranks` cannot be a process set of this job: empty, out of range, or not sorted
    /// and distinct.
    fn bad_set_ranks(&self, ranks: &[usize]) -> bool {
        ranks.is_empty()
            || ranks.iter().any(|&r| r >= self.size)
            || ranks.windows(2).any(|w| w[0] >= w[1])
    }

    /// The answer to asking for set `ranks` (limited to `timeout_ms`), one of whose members,
    /// `gone`, has gone.
    pub(super) fn set_without(
        &self,
        ranks: Vec<usize>,
        timeout_ms: u64,
        gone: usize,
    ) -> FromCoordinator {
        let (_, why) = gone_error(gone, self.gone[gone].as_deref().unwrap_or_default(), "");
        FromCoordinator::SetAdded {
            result: Err(format!("process set {ranks:?} cannot be made: {why}")),
            ranks,
            timeout_ms,
        }
    }

    /// `from` asks for the set of `ranks` among its members alone, its stalled ops failing
    /// after `timeout_ms` (0: the engine's limit): it is made (or found) once every member
    /// has asked, and only they are told its id.
    pub(super) fn add_member_set(
        &mut self,
        from: usize,
        ranks: Vec<usize>,
        timeout_ms: u64,
        out: &mut Outbox,
    ) {
        let answer = |ranks, result| FromCoordinator::SetAdded {
            ranks,
            timeout_ms,
            result,
        };
        if self.bad_set_ranks(&ranks) || !ranks.contains(&from) {
            let result = Err(format!(
                "invalid process set ranks {ranks:?} (asked by rank {from}, which must be one \
                 of them)"
            ));
            out.push((vec![from], answer(ranks, result)));
            return;
        }
        let limited = set_limit(timeout_ms);
        let existing = self
            .sets
            .iter()
            .find(|(_, s)| s.ranks == ranks && s.timeout == limited);
        if let Some((&id, _)) = existing {
            out.push((vec![from], answer(ranks, Ok(id))));
            return;
        }
        if let Some(&gone) = ranks.iter().find(|&&r| self.gone[r].is_some()) {
            out.push((vec![from], self.set_without(ranks, timeout_ms, gone)));
            return;
        }
        let key = (ranks, timeout_ms);
        let asked = self.member_sets.entry(key.clone()).or_default();
        if !asked.contains(&from) {
            asked.push(from);
        }
        if asked.len() < key.0.len() {
            return;
        }
        self.member_sets.remove(&key);
        let (ranks, timeout_ms) = key;
        let id = self.next_set_id;
        self.next_set_id += 1;
        self.sets
            .insert(id, SetState::limited(ranks.clone(), timeout_ms));
        out.push((ranks.clone(), answer(ranks, Ok(id))));
    }

    /// A `join()` needs every rank: once one has gone without joining, the ranks that joined
    /// would wait forever. Fails their join, naming it, and returns whether it did.
    pub(super) fn fail_join(&mut self) -> bool {
        let Some(gone) = (0..self.size).find(|&r| self.gone[r].is_some() && !self.joined[r]) else {
            return false;
        };
        if !self.live_ranks().any(|r| self.joined[r]) {
            return false;
        }
        let detail = self.gone[gone].clone().unwrap_or_default();
        let (code, why) = gone_error(gone, &detail, " without joining");
        self.end_join(Some((code, format!("join() cannot complete: {why}"))));
        true
    }

    /// Answers every rank's `join()` (with `error`, or the last rank to join) and starts the
    /// next round of joins.
    pub(super) fn end_join(&mut self, error: Option<(u8, String)>) {
        self.joined.iter_mut().for_each(|j| *j = false);
        self.joined_or_gone = self.gone.iter().any(Option::is_some);
        self.ready.push(Response {
            set_id: 0,
            kind: OpKind::Join,
            items: Vec::new(),
            joined: Vec::new(),
            last_joined: self.last_joined,
            error,
        });
    }

    /// Names of set `id` submitted and not yet answered (some ranks wait on them), if any.
    fn busy_set(&self, id: u32) -> Option<Vec<String>> {
        let set = self.sets.get(&id)?;
        let mut names: Vec<String> = set.table.keys().cloned().collect();
        for r in self.ready.iter().filter(|r| r.set_id == id) {
            names.extend(r.items.iter().map(|i| i.request.name.clone()));
        }
        names.sort();
        (!names.is_empty()).then_some(names)
    }

    pub(super) fn process_set_ops(&mut self, out: &mut Outbox) {
        loop {
            let live: Vec<usize> = self.live_ranks().collect();
            if live.is_empty() || live.iter().any(|&r| self.set_ops[r].is_empty()) {
                return;
            }
            let ops: Vec<ToCoordinator> = live
                .iter()
                .map(|&r| self.set_ops[r].pop_front().expect("checked non-empty"))
                .collect();
            let first = ops[0].clone();
            let agree = ops.iter().all(|o| *o == first);
            let reply = match (&first, agree) {
                (ToCoordinator::AddSet { ranks }, true) => {
                    let result = if self.bad_set_ranks(ranks) {
                        Err(format!("invalid process set ranks {ranks:?}"))
                    } else if let Some((id, _)) = self.sets.iter().find(|(_, s)| &s.ranks == ranks)
                    {
                        Err(format!(
                            "a process set with ranks {ranks:?} already exists (id {id})"
                        ))
                    } else {
                        let id = self.next_set_id;
                        self.next_set_id += 1;
                        self.sets.insert(id, SetState::new(ranks.clone()));
                        Ok(id)
                    };
                    FromCoordinator::SetAdded {
                        ranks: ranks.clone(),
                        timeout_ms: 0,
                        result,
                    }
                }
                (ToCoordinator::RemoveSet { id }, true) => {
                    let result = match self.busy_set(*id) {
                        Some(names) => Err(format!(
                            "process set {id} cannot be removed while ops on it are pending: \
                             {names:?}; synchronize them first"
                        )),
                        None => Ok(*id != 0 && self.sets.remove(id).is_some()),
                    };
                    FromCoordinator::SetRemoved { id: *id, result }
                }
                (ToCoordinator::AddSet { ranks }, false) => FromCoordinator::SetAdded {
                    ranks: ranks.clone(),
                    timeout_ms: 0,
                    result: Err(
                        "ranks disagree on add_process_set/remove_process_set: every rank must \
                         call them with the same arguments in the same order"
                            .into(),
                    ),
                },
                (ToCoordinator::RemoveSet { id }, false) => FromCoordinator::SetRemoved {
                    id: *id,
                    result: Err(
                        "ranks disagree on add_process_set/remove_process_set: every rank must \
                         call them with the same arguments in the same order"
                            .into(),
                    ),
                },
                _ => unreachable!("only set operations are queued"),
            };
            out.push((live, reply));
        }
    }
}
