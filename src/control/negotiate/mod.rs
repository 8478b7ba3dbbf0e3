//! The coordinator's negotiation state machine (no I/O: messages in, messages out), run by
//! rank 0's coordinator thread for every process set.
//!
//! Protocol, in the spirit of Horovod's controller:
//! a) Each rank's engine sends the coordinator every new submission as soon as it is queued:
//!    a full [`Request`] the first time a name is seen with given parameters, afterwards only
//!    its response-cache id ([`Submit::Cached`]).
//! b) The coordinator keeps, per process set, a table name → the request of each member rank.
//!    A name is *ready* when every member has submitted it (on the global set, ranks that
//!    called `join()` count as submitted and contribute zeros to allreduces).
//! c) A ready name is validated: same kind, dtypes, shapes (allgather/alltoall: same trailing
//!    dims), reduce op, root, scale factors. Disagreement becomes an error response naming the
//!    tensor and which ranks sent what; every member raises it. A name whose submissions were
//!    all cache hits is identical to an already validated request and skips validation.
//! d) Ready allreduces with the same op and scale factors are fused into one response up to the
//!    fusion threshold. Responses are sent to every member of the set in one global order;
//!    every engine executes them in the order received, so ranks in several sets never
//!    deadlock (the order is a total order shared by all).
//! e) A rank that leaves (`shutdown`) or dies is announced to every rank; requests waiting on
//!    it fail at once, naming it.
//! f) Ops whose names share a base (`allreduce.grad` and `broadcast.grad`, see
//!    [`Op::base`](super::message::Op::base)) reach the coordinator one at a time from each
//!    rank, in the order the rank called them, so every op pending under a base is each rank's same one. When every
//!    member has sent its op under a base and they are not one name, the ranks disagree on it:
//!    all of those ops fail on every rank, naming the base, the ranks and what each sent.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use crate::error::Error;

use super::message::{FromCoordinator, Response, Submit, ToCoordinator};

mod books;
mod inspect;
mod respond;
mod sets;

use books::{set_limit, Pending, SetState};
use respond::{build_response, can_fuse, error_response, gone_error, kinds_disagree};

/// How a rank went away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gone {
    /// Clean `shutdown()`.
    Left,
    /// Its connection closed or broke.
    Died,
    /// A peer saw it make no progress for the timeout.
    Stalled,
}

/// What `gone` records for a rank that shut down cleanly.
const LEFT: &str = "shut down";

/// Messages to send: (destination global ranks, ascending, message). Ranks that get the same
/// message share one entry: the answer to a global op is the same for every rank, and the
/// root should not build it once per rank.
pub type Outbox = Vec<(Vec<usize>, FromCoordinator)>;

/// Coordinator state for the whole job.
pub struct Negotiator {
    size: usize,
    sets: HashMap<u32, SetState>,
    next_set_id: u32,
    next_cache_id: u64,
    joined: Vec<bool>,
    last_joined: usize,
    gone: Vec<Option<String>>,
    /// Some rank joined or went since the last join ended: a name may then be ready (or fail)
    /// before every member submitted it, and readiness takes a scan of the set.
    joined_or_gone: bool,
    set_ops: Vec<VecDeque<ToCoordinator>>,
    /// Sets being registered by their members alone ([`ToCoordinator::AddMemberSet`]): the
    /// members that have asked so far.
    /// Keyed by the set's ranks and time limit.
    member_sets: HashMap<(Vec<usize>, u64), Vec<usize>>,
    fusion_threshold: usize,
    cache_capacity: usize,
    /// Ready responses not yet sent (released by [`Negotiator::flush`]).
    ready: Vec<Response>,
    /// (name, bytes) of every global-set tensor flushed, for the autotuner (when recording).
    emitted: Option<Vec<(String, usize)>>,
}

impl Negotiator {
    /// A negotiator for `size` ranks with the given process sets (besides the global one,
    /// which gets id 0; these get ids 1, 2, ...).
    pub fn new(
        size: usize,
        process_sets: &[Vec<usize>],
        fusion_threshold: usize,
        cache_capacity: usize,
    ) -> Self {
        let mut sets = HashMap::new();
        sets.insert(0, SetState::new((0..size).collect()));
        let mut next_set_id = 1;
        for ranks in process_sets {
            sets.insert(next_set_id, SetState::new(ranks.clone()));
            next_set_id += 1;
        }
        Negotiator {
            size,
            sets,
            next_set_id,
            next_cache_id: 1,
            joined: vec![false; size],
            last_joined: 0,
            gone: vec![None; size],
            joined_or_gone: false,
            set_ops: vec![VecDeque::new(); size],
            member_sets: HashMap::new(),
            fusion_threshold,
            cache_capacity,
            ready: Vec::new(),
            emitted: None,
        }
    }

    /// Ranks in the job.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The members of process set `id`, if it exists.
    pub fn members(&self, id: u32) -> Option<&[usize]> {
        self.sets.get(&id).map(|s| s.ranks.as_slice())
    }

    /// Whether ranks other than `rank` can still negotiate anything without it: a process set,
    /// or one being registered, that `rank` is not a member of. Without one, every op left
    /// needs `rank`, so once it has shut down nothing more can be agreed here.
    pub fn serves_without(&self, rank: usize) -> bool {
        self.sets.values().any(|s| !s.ranks.contains(&rank))
            || self
                .member_sets
                .keys()
                .any(|(ranks, _)| !ranks.contains(&rank))
    }

    /// Changes the fusion threshold (autotune).
    pub fn set_fusion_threshold(&mut self, bytes: usize) {
        self.fusion_threshold = bytes;
    }

    /// Starts recording flushed tensors for [`Negotiator::take_emitted`].
    pub fn record_emitted(&mut self) {
        self.emitted.get_or_insert_with(Vec::new);
    }

    /// Stops recording (and drops what was recorded).
    pub fn stop_recording_emitted(&mut self) {
        self.emitted = None;
    }

    /// (name, bytes) of the global-set tensors flushed since the last call.
    pub fn take_emitted(&mut self) -> Vec<(String, usize)> {
        self.emitted
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Whether responses are waiting to be flushed.
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Handles one message from global rank `from`.
    pub fn handle(&mut self, from: usize, msg: ToCoordinator, out: &mut Outbox) {
        match msg {
            ToCoordinator::Hello { .. } => {}
            ToCoordinator::Submit(subs) => {
                for sub in subs {
                    self.submit(from, sub, out);
                }
            }
            ToCoordinator::Join => {
                self.joined[from] = true;
                self.joined_or_gone = true;
                self.last_joined = from;
                if self.fail_join() {
                    return;
                }
                if self.live_ranks().all(|r| self.joined[r]) {
                    self.end_join(None);
                } else {
                    let names: Vec<String> = self.sets[&0].table.keys().cloned().collect();
                    for name in names {
                        self.check_ready(0, &name);
                    }
                }
            }
            m @ (ToCoordinator::AddSet { .. } | ToCoordinator::RemoveSet { .. }) => {
                self.set_ops[from].push_back(m);
                self.process_set_ops(out);
            }
            ToCoordinator::AddMemberSet { ranks, timeout_ms } => {
                self.add_member_set(from, ranks, timeout_ms, out)
            }
            ToCoordinator::Leave => self.rank_gone(from, Gone::Left, LEFT.into(), out),
            ToCoordinator::Stalled { rank, detail } if rank < self.size => self.rank_gone(
                rank,
                Gone::Stalled,
                format!("{detail} (seen by rank {from})"),
                out,
            ),
            ToCoordinator::Stalled { .. } => {}
            // A node unpacks these before anything reaches the negotiator.
            ToCoordinator::Relayed(_)
            | ToCoordinator::Lost { .. }
            | ToCoordinator::CachedBelow { .. } => {}
        }
    }

    /// Records that `rank` is gone (cleanly or not) and fails everything waiting on it.
    pub fn rank_gone(&mut self, rank: usize, how: Gone, detail: String, out: &mut Outbox) {
        if self.gone[rank].is_some() {
            return;
        }
        let clean = how == Gone::Left;
        if !clean {
            log::warn!(target: crate::LOG_TARGET, "rank {rank} is gone: {detail}");
        }
        self.gone[rank] = Some(if clean { LEFT.into() } else { detail.clone() });
        self.joined_or_gone = true;
        let notice = if clean {
            FromCoordinator::RankLeft { rank }
        } else {
            FromCoordinator::RankFailed {
                rank,
                detail: detail.clone(),
                stalled: how == Gone::Stalled,
            }
        };
        out.push((self.live_ranks().collect(), notice));
        // Names waiting on `rank` can no longer complete: `check_ready` fails them, naming it.
        let waiting: Vec<(u32, String)> = self
            .sets
            .iter()
            .filter(|(_, set)| set.set_rank(rank).is_some())
            .flat_map(|(&id, set)| set.table.keys().map(move |name| (id, name.clone())))
            .collect();
        for (id, name) in waiting {
            self.check_ready(id, &name);
        }
        self.fail_join();
        self.process_set_ops(out);
        // A set its members register alone cannot form without this one.
        let stuck: Vec<(Vec<usize>, u64)> = self
            .member_sets
            .keys()
            .filter(|(ranks, _)| ranks.contains(&rank))
            .cloned()
            .collect();
        for key in stuck {
            let asked = self.member_sets.remove(&key).unwrap_or_default();
            let (ranks, timeout_ms) = key;
            out.push((asked, self.set_without(ranks, timeout_ms, rank)));
        }
    }

    /// Sends every ready response to the members of its set, in order.
    pub fn flush(&mut self, out: &mut Outbox) {
        let ready = std::mem::take(&mut self.ready);
        if let Some(log) = self.emitted.as_mut() {
            for r in ready.iter().filter(|r| r.set_id == 0 && r.error.is_none()) {
                for i in &r.items {
                    log.push((i.request.name.clone(), i.request.nbytes()));
                }
            }
        }
        let mut fused: Vec<Response> = Vec::with_capacity(ready.len());
        for resp in ready {
            if let Some(last) = fused.last_mut() {
                if can_fuse(last, &resp, self.fusion_threshold) {
                    last.items.extend(resp.items);
                    continue;
                }
            }
            fused.push(resp);
        }
        // One message per destination keeps the number of frames (and wake-ups) low, and
        // ranks that get the same responses (every rank, for the global set's ops) share it.
        if fused.iter().all(|r| r.set_id == 0) {
            if !fused.is_empty() {
                out.push((
                    self.live_ranks().collect(),
                    FromCoordinator::Responses(fused),
                ));
            }
            return;
        }
        let mut per_rank: Vec<Vec<usize>> = vec![Vec::new(); self.size];
        for (k, resp) in fused.iter().enumerate() {
            match self.sets.get(&resp.set_id) {
                Some(s) => s.ranks.iter().for_each(|&r| per_rank[r].push(k)),
                None => per_rank.iter_mut().for_each(|ks| ks.push(k)),
            }
        }
        let mut groups: BTreeMap<Vec<usize>, Vec<usize>> = BTreeMap::new();
        for (r, ks) in per_rank.into_iter().enumerate() {
            if !ks.is_empty() && self.gone[r].is_none() {
                groups.entry(ks).or_default().push(r);
            }
        }
        for (ks, ranks) in groups {
            let rs = ks.iter().map(|&k| fused[k].clone()).collect();
            out.push((ranks, FromCoordinator::Responses(rs)));
        }
    }

    /// A relay's claim that every rank of `ranks` (members of set `set_id`, ascending)
    /// submitted the cached op `id`: as their `Submit::Cached` each, at the cost of one
    /// submission and a pointer per rank.
    pub fn claim_cached(&mut self, ranks: &[usize], set_id: u32, id: u64, out: &mut Outbox) {
        let Some(set) = self.sets.get_mut(&set_id) else {
            // Each rank is answered that its set does not exist, as for its own submission.
            for &r in ranks {
                self.submit(r, Submit::Cached { set_id, id }, out);
            }
            return;
        };
        let Some(req) = set.cached(id) else {
            out.push((ranks.to_vec(), FromCoordinator::CacheMiss { set_id, id }));
            return;
        };
        let name = req.name.clone();
        let SetState {
            ranks: members,
            table,
            ..
        } = set;
        let mut fresh = false;
        let p = table.entry(name.clone()).or_insert_with(|| {
            fresh = true;
            Pending::new(members.len())
        });
        for r in ranks {
            // A relay claims only members; a second copy is dropped, as in `submit`.
            // A set of every rank holds rank r at index r.
            let idx = match members.get(*r) {
                Some(m) if m == r => Ok(*r),
                _ => members.binary_search(r),
            };
            if let Ok(idx) = idx {
                if !p.has(idx) {
                    p.put(idx, &req);
                }
            }
        }
        if p.got == 0 {
            table.remove(&name);
            return;
        }
        if fresh {
            set.note_base(&req);
        }
        self.check_ready(set_id, &name);
    }

    fn submit(&mut self, from: usize, sub: Submit, out: &mut Outbox) {
        let mut rejected = None;
        let (request, cached) = match sub {
            Submit::Full(req) => (Arc::new(req), false),
            Submit::Rejected { request, reason } => {
                rejected = Some(reason);
                (Arc::new(request), false)
            }
            Submit::Cached { set_id, id } => {
                match self.sets.get_mut(&set_id).and_then(|s| s.cached(id)) {
                    Some(req) => (req, true),
                    None => {
                        out.push((vec![from], FromCoordinator::CacheMiss { set_id, id }));
                        return;
                    }
                }
            }
        };
        let set_id = request.set_id;
        let name = request.name.clone();
        let Some(set) = self.sets.get_mut(&set_id) else {
            self.ready.push(error_response(
                Arc::unwrap_or_clone(request),
                Error::InvalidArgument(String::new()).kind_code(),
                format!("process set {set_id} does not exist or has been removed"),
            ));
            return;
        };
        let Some(idx) = set.set_rank(from) else {
            let msg = format!("rank {from} is not a member of process set {set_id}");
            self.ready.push(error_response(
                Arc::unwrap_or_clone(request),
                Error::InvalidArgument(String::new()).kind_code(),
                msg,
            ));
            return;
        };
        let n = set.ranks.len();
        let mut fresh = false;
        let p = set.table.entry(name.clone()).or_insert_with(|| {
            fresh = true;
            Pending::new(n)
        });
        if p.has(idx) {
            // The engine refuses duplicates before they get here; a second copy is a bug or a
            // hostile peer: drop it rather than corrupt the table.
            return;
        }
        p.put(idx, &request);
        p.all_cached &= cached;
        if let Some(reason) = rejected {
            p.rejected.push((from, reason));
        }
        if fresh {
            set.note_base(&request);
        }
        self.check_ready(set_id, &name);
    }

    fn check_ready(&mut self, set_id: u32, name: &str) {
        if self.check_base(set_id, name) {
            return;
        }
        let set = self.sets.get_mut(&set_id).expect("caller checked the set");
        let Some(p) = set.table.get(name) else {
            return;
        };
        // Without a join or a loss, only the last member's submission can make the name
        // ready: every other one costs a count, not a scan of the set (N scans of N members
        // per op at the root).
        if p.got < set.ranks.len() && !self.joined_or_gone {
            return;
        }
        // A name every member submitted is complete: the scans below are for joins and losses.
        if p.got < set.ranks.len() {
            let joined = &self.joined;
            // A member that has gone will never submit: fail the name now, naming it.
            let missing_gone = set.ranks.iter().enumerate().find_map(|(i, &g)| {
                if p.has(i) {
                    return None;
                }
                self.gone[g].as_ref().map(|d| (g, d.clone()))
            });
            if let Some((g, detail)) = missing_gone {
                let p = set.take(name).expect("present above");
                let request = p.first();
                let (code, why) = gone_error(g, &detail, "");
                let msg = format!(
                    "{} of tensor '{name}' cannot complete: {why}",
                    request.kind.name()
                );
                self.ready.push(error_response(request, code, msg));
                return;
            }
            let complete = set
                .ranks
                .iter()
                .enumerate()
                .all(|(i, &g)| p.has(i) || (set_id == 0 && joined[g]));
            if !complete {
                return;
            }
        }
        let p = set.take(name).expect("present above");
        // Every member submitted unless some joined: no scan for the ranks that did not.
        let joined_ranks: Vec<usize> = if p.got == set.ranks.len() {
            Vec::new()
        } else {
            set.ranks
                .iter()
                .enumerate()
                .filter(|&(i, _)| !p.has(i))
                .map(|(_, &g)| g)
                .collect()
        };
        let resp = build_response(
            set_id,
            set,
            p,
            joined_ranks,
            self.cache_capacity,
            &mut self.next_cache_id,
        );
        self.ready.push(resp);
    }

    /// Fails the ops pending under `name`'s shared base when there are several and every
    /// member has sent one (see f) in the module doc). Returns whether it did.
    fn check_base(&mut self, set_id: u32, name: &str) -> bool {
        let set = self.sets.get_mut(&set_id).expect("caller checked the set");
        if set.contested == 0 {
            return false;
        }
        let Some(req) = set.table.get(name).map(|p| p.any().clone()) else {
            return false;
        };
        let Some(base) = req.base() else {
            return false;
        };
        let Some(names) = set.bases.get(base).filter(|n| n.len() > 1) else {
            return false;
        };
        let pending: Vec<&Pending> = names.iter().map(|n| &set.table[n]).collect();
        // Each rank has one op at most under a base here: the counts add up to the members.
        let mut complete = pending.iter().map(|p| p.got).sum::<usize>() == set.ranks.len();
        if !complete && self.joined_or_gone && set_id == 0 {
            complete = set
                .ranks
                .iter()
                .enumerate()
                .all(|(i, &g)| self.joined[g] || pending.iter().any(|p| p.has(i)));
        }
        if !complete {
            return false;
        }
        let base = base.to_string();
        let names = set.bases.remove(&base).expect("present above");
        set.contested -= 1;
        let ops: Vec<Pending> = names
            .iter()
            .map(|n| set.table.remove(n).expect("listed under its base"))
            .collect();
        let resp = kinds_disagree(set_id, &set.ranks, &base, ops);
        self.ready.push(resp);
        true
    }
}

#[cfg(test)]
mod tests;
