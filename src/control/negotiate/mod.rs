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
//!    [`shared_base`]) reach the coordinator one at a time from each rank, in the order the
//!    rank called them, so every op pending under a base is each rank's same one. When every
//!    member has sent its op under a base and they are not one name, the ranks disagree on it:
//!    all of those ops fail on every rank, naming the base, the ranks and what each sent.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::types::OpKind;

use super::message::{FromCoordinator, Request, Response, Submit, ToCoordinator};
use super::names::shared_base;

mod respond;
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

struct Pending {
    /// Members of the op's set.
    members: usize,
    /// Which members submitted, a bit each in set order.
    got_bits: Vec<u64>,
    /// Members whose request is in.
    got: usize,
    /// The one request every submission so far shares (a cached op's members all submit the
    /// cache's own): a pointer for the op, not one per rank, at the root of a large job.
    shared: Option<Arc<Request>>,
    /// Each member's request, once two submissions differ (a full request among cached
    /// ones, or two full ones): what validation compares.
    each: Option<Vec<Option<Arc<Request>>>>,
    /// (global rank, reason) of members that refused the op (see [`Submit::Rejected`]).
    rejected: Vec<(usize, String)>,
    all_cached: bool,
    /// When the first rank submitted it (the stall inspector's clock).
    since: Instant,
    /// When the stall inspector last warned about it.
    warned: Option<Instant>,
}

impl Pending {
    fn new(members: usize) -> Pending {
        Pending {
            members,
            got_bits: vec![0; members.div_ceil(64)],
            got: 0,
            shared: None,
            each: None,
            rejected: Vec::new(),
            all_cached: true,
            since: Instant::now(),
            warned: None,
        }
    }

    /// Whether the member at set index `idx` submitted.
    fn has(&self, idx: usize) -> bool {
        self.got_bits[idx / 64] & (1 << (idx % 64)) != 0
    }

    /// Records the submission of the member at `idx` (which has not submitted), its request
    /// `req`, cloned only when the op does not hold it already.
    fn put(&mut self, idx: usize, req: &Arc<Request>) {
        self.got_bits[idx / 64] |= 1 << (idx % 64);
        self.got += 1;
        if let Some(each) = self.each.as_mut() {
            each[idx] = Some(req.clone());
            return;
        }
        match &self.shared {
            None => self.shared = Some(req.clone()),
            Some(s) if Arc::ptr_eq(s, req) => {}
            Some(s) => {
                let s = s.clone();
                let mut each: Vec<Option<Arc<Request>>> = (0..self.members)
                    .map(|i| self.has(i).then(|| s.clone()))
                    .collect();
                each[idx] = Some(req.clone());
                self.each = Some(each);
            }
        }
    }

    /// The request of the member at `idx`, if it submitted.
    fn request(&self, idx: usize) -> Option<&Arc<Request>> {
        match &self.each {
            Some(each) => each[idx].as_ref(),
            None => self.shared.as_ref().filter(|_| self.has(idx)),
        }
    }

    /// A submitted request (the op has at least one).
    fn first(&self) -> Request {
        Request::clone(self.any())
    }

    fn any(&self) -> &Arc<Request> {
        let any = match &self.each {
            Some(each) => each.iter().flatten().next(),
            None => self.shared.as_ref(),
        };
        any.expect("a pending op has a submission")
    }
}

struct SetState {
    ranks: Vec<usize>,
    /// How long an op of this set may wait for members that have not submitted it before it
    /// fails on those that have (torch's group timeout); `None`: the engine's stall limit.
    timeout: Option<Duration>,
    table: HashMap<String, Pending>,
    /// Shared base name → the names pending under it (see [`shared_base`]): one, unless
    /// ranks disagree.
    bases: HashMap<String, Vec<String>>,
    /// How many bases have more than one name: while none has, no submission looks at them.
    contested: usize,
    /// name → (cache id, validated request); `by_id` is its inverse.
    cache: HashMap<String, (u64, Arc<Request>)>,
    by_id: HashMap<u64, String>,
    lru: Lru,
}

/// A set's own stall limit from its wire form (milliseconds; 0: none, the engine's applies).
fn set_limit(timeout_ms: u64) -> Option<Duration> {
    (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms))
}

impl SetState {
    fn new(ranks: Vec<usize>) -> Self {
        SetState::limited(ranks, 0)
    }

    /// A set whose stalled ops fail after `timeout_ms` (0: the engine's stall limit).
    fn limited(ranks: Vec<usize>, timeout_ms: u64) -> Self {
        SetState {
            ranks,
            timeout: set_limit(timeout_ms),
            table: HashMap::new(),
            bases: HashMap::new(),
            contested: 0,
            cache: HashMap::new(),
            by_id: HashMap::new(),
            lru: Lru::default(),
        }
    }
    /// The validated request cached under `id` (marked as just used), if the set holds it.
    fn cached(&mut self, id: u64) -> Option<Arc<Request>> {
        let req = self.cache.get(self.by_id.get(&id)?)?.1.clone();
        self.lru.touch(id);
        Some(req)
    }

    fn set_rank(&self, global: usize) -> Option<usize> {
        self.ranks.binary_search(&global).ok()
    }

    /// Records that `request`'s name is pending (its first submission), under its shared base
    /// if it has one.
    fn note_base(&mut self, request: &Request) {
        let Some(base) = shared_base(request.kind, &request.name) else {
            return;
        };
        // Every member's submission comes here: no allocation but the op's first.
        match self.bases.get_mut(base) {
            Some(names) if names.contains(&request.name) => {}
            Some(names) => {
                names.push(request.name.clone());
                self.contested += usize::from(names.len() == 2);
            }
            None => drop(
                self.bases
                    .insert(base.to_string(), vec![request.name.clone()]),
            ),
        }
    }

    /// Takes the op pending under `name` out of the table (and out of its base's names).
    fn take(&mut self, name: &str) -> Option<Pending> {
        let p = self.table.remove(name)?;
        let req = p.any();
        if let Some(base) = shared_base(req.kind, &req.name) {
            if let Some(names) = self.bases.get_mut(base) {
                let before = names.len();
                names.retain(|n| n != name);
                self.contested -= usize::from(before >= 2 && names.len() < 2);
                if names.is_empty() {
                    self.bases.remove(base);
                }
            }
        }
        Some(p)
    }
}

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

    /// Whether `ranks` cannot be a process set of this job: empty, out of range, or not sorted
    /// and distinct.
    fn bad_set_ranks(&self, ranks: &[usize]) -> bool {
        ranks.is_empty()
            || ranks.iter().any(|&r| r >= self.size)
            || ranks.windows(2).any(|w| w[0] >= w[1])
    }

    /// The answer to asking for set `ranks` (limited to `timeout_ms`), one of whose members,
    /// `gone`, has gone.
    fn set_without(&self, ranks: Vec<usize>, timeout_ms: u64, gone: usize) -> FromCoordinator {
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
    fn add_member_set(
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
    fn fail_join(&mut self) -> bool {
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
    fn end_join(&mut self, error: Option<(u8, String)>) {
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

    /// The stall inspector. With `check`, names some ranks submitted more than `check` ago
    /// and others did not are reported (once per `check` interval each) in Horovod's words,
    /// listing for every missing rank the tensors it has not submitted. Names stalled longer
    /// than their set's limit (its own, else `shutdown`) fail on every rank that submitted
    /// them. Returns the warning to log, if any.
    pub fn inspect(
        &mut self,
        now: Instant,
        check: Option<Duration>,
        shutdown: Option<Duration>,
    ) -> Option<String> {
        let mut missing: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        let mut doomed: Vec<(u32, String, Duration)> = Vec::new();
        let mut shutting = false;
        for (&set_id, set) in self.sets.iter_mut() {
            let limit = set.timeout.or(shutdown);
            for (name, p) in set.table.iter_mut() {
                let age = now.saturating_duration_since(p.since);
                if let Some(limit) = limit.filter(|&l| age >= l) {
                    doomed.push((set_id, name.clone(), limit));
                }
                let Some(check) = check.filter(|&c| age >= c) else {
                    continue;
                };
                if p.warned
                    .is_some_and(|w| now.saturating_duration_since(w) < check)
                {
                    continue;
                }
                p.warned = Some(now);
                let label = if set_id == 0 {
                    name.clone()
                } else {
                    format!("{name} (process set {set_id})")
                };
                for (i, &g) in set.ranks.iter().enumerate() {
                    if !(p.has(i) || (set_id == 0 && self.joined[g])) {
                        missing.entry(g).or_default().push(label.clone());
                    }
                }
                shutting |= shutdown.is_some();
            }
        }
        for (set_id, name, limit) in doomed {
            let set = self.sets.get_mut(&set_id).expect("listed above");
            let p = set.take(&name).expect("listed above");
            let absent: Vec<usize> = set
                .ranks
                .iter()
                .enumerate()
                .filter(|&(i, _)| !p.has(i))
                .map(|(_, &g)| g)
                .collect();
            let request = p.first();
            let msg = if set.timeout.is_some() {
                // Torch's group timeout; torch's users look for "timeout" in what it raises.
                format!(
                    "{} of tensor '{name}' failed: ranks {absent:?} did not submit it within \
                     the process group's timeout of {limit:?}",
                    request.kind.name(),
                )
            } else {
                format!(
                    "{} of tensor '{name}' stalled for more than {:.0} s: ranks {absent:?} never \
                     submitted it, so ferrovod gives up on it \
                     (FERROVOD_STALL_SHUTDOWN_TIME_SECONDS)",
                    request.kind.name(),
                    limit.as_secs_f64()
                )
            };
            let code = Error::Timeout {
                what: String::new(),
                after: Duration::ZERO,
            }
            .kind_code();
            self.ready.push(error_response(request, code, msg));
        }
        // Only a check fills `missing`.
        let (Some(check), false) = (check, missing.is_empty()) else {
            return None;
        };
        let mut text = format!(
            "One or more tensors were submitted to be reduced, gathered or broadcasted by \
             subset of ranks and are waiting for remainder of ranks for more than {:.0} seconds. \
             This may indicate that different ranks are trying to submit different tensors or \
             that only subset of ranks is submitting tensors, which will cause deadlock.\n\
             Missing ranks:",
            check.as_secs_f64()
        );
        for (rank, names) in &missing {
            let shown: Vec<&str> = names.iter().take(6).map(String::as_str).collect();
            let more = if names.len() > 6 { " ..." } else { "" };
            text.push_str(&format!("\n{rank}: [{}]{more}", shown.join(", ")));
        }
        if shutting {
            text.push_str(&format!(
                "\nTensors stalled for longer than {:.0} s fail on every rank.",
                shutdown.unwrap_or_default().as_secs_f64()
            ));
        }
        Some(text)
    }

    fn live_ranks(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(|&r| self.gone[r].is_none())
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
        let Some(base) = shared_base(req.kind, &req.name) else {
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

    fn process_set_ops(&mut self, out: &mut Outbox) {
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

/// Cache ids by last use. Every cached op touches its id twice (its submission, its
/// response), so a touch must not cost a pass over the cache: a model with a thousand
/// gradients made the old queue scan a thousand ids per op on rank 0.
#[derive(Default)]
struct Lru {
    /// use tick → id, oldest first.
    by_tick: BTreeMap<u64, u64>,
    /// id → its tick in `by_tick`.
    tick_of: HashMap<u64, u64>,
    next_tick: u64,
}

impl Lru {
    /// Marks `id` (new or known) as used last.
    fn touch(&mut self, id: u64) {
        self.remove(id);
        self.by_tick.insert(self.next_tick, id);
        self.tick_of.insert(id, self.next_tick);
        self.next_tick += 1;
    }

    fn remove(&mut self, id: u64) {
        if let Some(t) = self.tick_of.remove(&id) {
            self.by_tick.remove(&t);
        }
    }

    /// Takes the least recently used id.
    fn pop_oldest(&mut self) -> Option<u64> {
        let (_, id) = self.by_tick.pop_first()?;
        self.tick_of.remove(&id);
        Some(id)
    }
}

#[cfg(test)]
mod tests;
