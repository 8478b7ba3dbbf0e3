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

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::error::Error;
use crate::types::OpKind;

use super::message::{DeviceKind, FromCoordinator, Item, Request, Response, Submit, ToCoordinator};

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

/// Messages to send: (destination global rank, message).
pub type Outbox = Vec<(usize, FromCoordinator)>;

struct Pending {
    reqs: Vec<Option<Request>>,
    /// (global rank, reason) of members that refused the op (see [`Submit::Rejected`]).
    rejected: Vec<(usize, String)>,
    all_cached: bool,
    /// When the first rank submitted it (the stall inspector's clock).
    since: Instant,
    /// When the stall inspector last warned about it.
    warned: Option<Instant>,
}

struct SetState {
    ranks: Vec<usize>,
    table: HashMap<String, Pending>,
    /// name → (cache id, validated request); `by_id` is its inverse.
    cache: HashMap<String, (u64, Request)>,
    by_id: HashMap<u64, String>,
    lru: Lru,
}

impl SetState {
    fn new(ranks: Vec<usize>) -> Self {
        SetState {
            ranks,
            table: HashMap::new(),
            cache: HashMap::new(),
            by_id: HashMap::new(),
            lru: Lru::default(),
        }
    }
    fn set_rank(&self, global: usize) -> Option<usize> {
        self.ranks.binary_search(&global).ok()
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
    set_ops: Vec<VecDeque<ToCoordinator>>,
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
            set_ops: vec![VecDeque::new(); size],
            fusion_threshold,
            cache_capacity,
            ready: Vec::new(),
            emitted: None,
        }
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
            ToCoordinator::Leave => self.rank_gone(from, Gone::Left, LEFT.into(), out),
            ToCoordinator::Stalled { rank, detail } if rank < self.size => self.rank_gone(
                rank,
                Gone::Stalled,
                format!("{detail} (seen by rank {from})"),
                out,
            ),
            ToCoordinator::Stalled { .. } => {}
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
        let notice = if clean {
            FromCoordinator::RankLeft { rank }
        } else {
            FromCoordinator::RankFailed {
                rank,
                detail: detail.clone(),
                stalled: how == Gone::Stalled,
            }
        };
        for r in self.live_ranks().collect::<Vec<_>>() {
            out.push((r, notice.clone()));
        }
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
        // One message per destination keeps the number of frames (and wake-ups) low.
        let mut per_rank: HashMap<usize, Vec<Response>> = HashMap::new();
        for resp in fused {
            let members: Vec<usize> = match self.sets.get(&resp.set_id) {
                Some(s) => s.ranks.clone(),
                None => (0..self.size).collect(),
            };
            for r in members {
                if self.gone[r].is_none() {
                    per_rank.entry(r).or_default().push(resp.clone());
                }
            }
        }
        let mut ranks: Vec<usize> = per_rank.keys().copied().collect();
        ranks.sort_unstable();
        for r in ranks {
            let rs = per_rank.remove(&r).expect("key listed above");
            out.push((r, FromCoordinator::Responses(rs)));
        }
    }

    /// The stall inspector. Names some ranks submitted more than `check` ago and others did
    /// not are reported (once per `check` interval each) in Horovod's words, listing for every
    /// missing rank the tensors it has not submitted; with `shutdown`, names stalled that long
    /// fail on every rank. Returns the warning to log, if any.
    pub fn inspect(
        &mut self,
        now: Instant,
        check: Duration,
        shutdown: Option<Duration>,
    ) -> Option<String> {
        let mut missing: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        let mut doomed: Vec<(u32, String)> = Vec::new();
        let mut shutting = false;
        for (&set_id, set) in self.sets.iter_mut() {
            for (name, p) in set.table.iter_mut() {
                let age = now.saturating_duration_since(p.since);
                if age < check {
                    continue;
                }
                if shutdown.is_some_and(|limit| age >= limit) {
                    doomed.push((set_id, name.clone()));
                }
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
                    if p.reqs[i].is_none() && !(set_id == 0 && self.joined[g]) {
                        missing.entry(g).or_default().push(label.clone());
                    }
                }
                shutting |= shutdown.is_some();
            }
        }
        for (set_id, name) in doomed {
            let set = self.sets.get_mut(&set_id).expect("listed above");
            let p = set.table.remove(&name).expect("listed above");
            let absent: Vec<usize> = set
                .ranks
                .iter()
                .enumerate()
                .filter(|&(i, _)| p.reqs[i].is_none())
                .map(|(_, &g)| g)
                .collect();
            let request = p.reqs.into_iter().flatten().next().expect("non-empty");
            let msg = format!(
                "{} of tensor '{name}' stalled for more than {:.0} s: ranks {absent:?} never \
                 submitted it, so ferrovod gives up on it (FERROVOD_STALL_SHUTDOWN_TIME_SECONDS)",
                request.kind.name(),
                shutdown
                    .expect("doomed only with a shutdown time")
                    .as_secs_f64()
            );
            let code = Error::Timeout {
                what: String::new(),
                after: Duration::ZERO,
            }
            .kind_code();
            self.ready.push(error_response(request, code, msg));
        }
        if missing.is_empty() {
            return None;
        }
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

    fn submit(&mut self, from: usize, sub: Submit, out: &mut Outbox) {
        let mut rejected = None;
        let (request, cached) = match sub {
            Submit::Full(req) => (req, false),
            Submit::Rejected { request, reason } => {
                rejected = Some(reason);
                (request, false)
            }
            Submit::Cached { set_id, id } => {
                let hit = self.sets.get_mut(&set_id).and_then(|s| {
                    let name = s.by_id.get(&id)?;
                    let req = s.cache.get(name)?.1.clone();
                    s.lru.touch(id);
                    Some(req)
                });
                match hit {
                    Some(req) => (req, true),
                    None => {
                        out.push((from, FromCoordinator::CacheMiss { set_id, id }));
                        return;
                    }
                }
            }
        };
        let set_id = request.set_id;
        let name = request.name.clone();
        let Some(set) = self.sets.get_mut(&set_id) else {
            self.ready.push(error_response(
                request,
                Error::InvalidArgument(String::new()).kind_code(),
                format!("process set {set_id} does not exist or has been removed"),
            ));
            return;
        };
        let Some(idx) = set.set_rank(from) else {
            let msg = format!("rank {from} is not a member of process set {set_id}");
            self.ready.push(error_response(
                request,
                Error::InvalidArgument(String::new()).kind_code(),
                msg,
            ));
            return;
        };
        let n = set.ranks.len();
        let p = set.table.entry(name.clone()).or_insert_with(|| Pending {
            reqs: vec![None; n],
            rejected: Vec::new(),
            all_cached: true,
            since: Instant::now(),
            warned: None,
        });
        if p.reqs[idx].is_some() {
            // The engine refuses duplicates before they get here; a second copy is a bug or a
            // hostile peer: drop it rather than corrupt the table.
            return;
        }
        p.reqs[idx] = Some(request);
        p.all_cached &= cached;
        if let Some(reason) = rejected {
            p.rejected.push((from, reason));
        }
        self.check_ready(set_id, &name);
    }

    fn check_ready(&mut self, set_id: u32, name: &str) {
        let set = self.sets.get_mut(&set_id).expect("caller checked the set");
        let Some(p) = set.table.get(name) else {
            return;
        };
        let joined = &self.joined;
        // A member that has gone will never submit: fail the name now, naming it.
        let missing_gone = set.ranks.iter().enumerate().find_map(|(i, &g)| {
            if p.reqs[i].is_some() {
                return None;
            }
            self.gone[g].as_ref().map(|d| (g, d.clone()))
        });
        if let Some((g, detail)) = missing_gone {
            let p = set.table.remove(name).expect("present above");
            let request = p.reqs.into_iter().flatten().next().expect("non-empty");
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
            .all(|(i, &g)| p.reqs[i].is_some() || (set_id == 0 && joined[g]));
        if !complete {
            return;
        }
        let p = set.table.remove(name).expect("present above");
        let joined_ranks: Vec<usize> = set
            .ranks
            .iter()
            .enumerate()
            .filter(|&(i, _)| p.reqs[i].is_none())
            .map(|(_, &g)| g)
            .collect();
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
                    let bad = ranks.is_empty()
                        || ranks.iter().any(|&r| r >= self.size)
                        || ranks.windows(2).any(|w| w[0] >= w[1]);
                    let result = if bad {
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
            for r in live {
                out.push((r, reply.clone()));
            }
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

fn plain_item(request: Request) -> Item {
    Item {
        request,
        cache_id: None,
        first_dims: Vec::new(),
        split_matrix: Vec::new(),
    }
}

/// The error code and reason for what waits on `rank`, gone with `detail` (what `gone`
/// records); `clean` is appended to the reason of a clean shutdown.
fn gone_error(rank: usize, detail: &str, clean: &str) -> (u8, String) {
    if detail == LEFT {
        (
            Error::Shutdown(String::new()).kind_code(),
            format!("rank {rank} has shut down{clean}"),
        )
    } else {
        let lost = Error::PeerLost {
            rank,
            detail: String::new(),
        };
        (lost.kind_code(), format!("rank {rank} failed: {detail}"))
    }
}

/// Every member's error for an op some refused: who refused it and why, the ranks that gave
/// the same reason together, so that every rank learns the reason from the one that had it.
fn rejection_message(request: &Request, rejected: &[(usize, String)]) -> String {
    let mut by_reason: Vec<(&str, Vec<usize>)> = Vec::new();
    for (rank, reason) in rejected {
        match by_reason.iter_mut().find(|(r, _)| r == reason) {
            Some((_, ranks)) => ranks.push(*rank),
            None => by_reason.push((reason, vec![*rank])),
        }
    }
    let parts: Vec<String> = by_reason
        .into_iter()
        .map(|(reason, mut ranks)| {
            ranks.sort_unstable();
            match ranks.as_slice() {
                [one] => format!("rank {one} rejected it: {reason}"),
                many => format!("ranks {many:?} rejected it: {reason}"),
            }
        })
        .collect();
    format!(
        "{} of tensor '{}' failed on every rank: {}",
        request.kind.name(),
        request.name,
        parts.join("; ")
    )
}

fn error_response(request: Request, code: u8, message: String) -> Response {
    Response {
        set_id: request.set_id,
        kind: request.kind,
        items: vec![plain_item(request)],
        joined: Vec::new(),
        last_joined: 0,
        error: Some((code, message)),
    }
}

fn can_fuse(a: &Response, b: &Response, threshold: usize) -> bool {
    if a.error.is_some()
        || b.error.is_some()
        || a.kind != OpKind::Allreduce
        || b.kind != OpKind::Allreduce
    {
        return false;
    }
    if a.set_id != b.set_id || a.joined != b.joined {
        return false;
    }
    let (ra, rb) = (&a.items[0].request, &b.items[0].request);
    // Host and device tensors run on different communicators: never in one response.
    let same = ra.op == rb.op
        && ra.prescale == rb.prescale
        && ra.postscale == rb.postscale
        && ra.device == rb.device;
    let bytes: usize = a.items.iter().map(|i| i.request.nbytes()).sum::<usize>() + rb.nbytes();
    same && bytes <= threshold
}

/// Validates the requests of a ready name and builds its response.
fn build_response(
    set_id: u32,
    set: &mut SetState,
    p: Pending,
    joined: Vec<usize>,
    capacity: usize,
    next_cache_id: &mut u64,
) -> Response {
    let submitted: Vec<(usize, &Request)> = p
        .reqs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| r.as_ref().map(|r| (set.ranks[i], r)))
        .collect();
    let base = submitted[0].1.clone();
    let name = base.name.clone();
    let fail = |code: u8, msg: String| error_response(base.clone(), code, msg);
    let mismatch = Error::Mismatch {
        name: String::new(),
        message: String::new(),
    }
    .kind_code();
    let invalid = Error::InvalidArgument(String::new()).kind_code();

    if !p.rejected.is_empty() {
        return fail(invalid, rejection_message(&base, &p.rejected));
    }
    if !p.all_cached {
        if let Some(msg) = validate(&name, &submitted) {
            return fail(mismatch, msg);
        }
    }
    if !joined.is_empty() && base.kind != OpKind::Allreduce {
        let what = match base.kind {
            OpKind::Allgather => "Allgather is not supported with Join at this time. Specify sparse_as_dense=True if using DistributedOptimizer",
            OpKind::Alltoall => "Alltoall is not supported with Join at this time.",
            OpKind::Reducescatter => "Reducescatter is not supported with Join at this time.",
            OpKind::Barrier => "Barrier is not supported with Join at this time.",
            _ => "Broadcast is not supported with Join at this time.",
        };
        return fail(
            invalid,
            format!("{what} (tensor '{name}', joined ranks {joined:?})"),
        );
    }
    if !joined.is_empty() && base.device == DeviceKind::Cuda {
        return fail(
            invalid,
            format!(
                "join() is not supported with CUDA tensors on the NCCL path: ranks {joined:?} \
                 have joined, so they have no device memory to contribute to '{name}'"
            ),
        );
    }
    if base.kind == OpKind::Broadcast && set.set_rank(base.root).is_none() {
        return fail(
            invalid,
            format!(
                "broadcast of '{name}': root rank {} is not in process set {set_id}",
                base.root
            ),
        );
    }
    let first_dims = if base.kind == OpKind::Allgather {
        (0..base.tensors.len())
            .map(|t| {
                p.reqs
                    .iter()
                    .map(|r| {
                        r.as_ref()
                            .map_or(0, |r| r.tensors[t].shape.first().copied().unwrap_or(0))
                    })
                    .collect()
            })
            .collect()
    } else {
        Vec::new()
    };
    let split_matrix = if base.kind == OpKind::Alltoall {
        p.reqs
            .iter()
            .flat_map(|r| r.as_ref().map(|r| r.splits.clone()).unwrap_or_default())
            .collect()
    } else {
        Vec::new()
    };
    let cache_id = if capacity > 0 && base.cacheable() {
        match set.cache.get(&name) {
            Some((id, req)) if *req == base => {
                let id = *id;
                set.lru.touch(id);
                Some(id)
            }
            _ => {
                if let Some((old, _)) = set.cache.remove(&name) {
                    set.by_id.remove(&old);
                    set.lru.remove(old);
                }
                while set.cache.len() >= capacity {
                    let Some(victim) = set.lru.pop_oldest() else {
                        break;
                    };
                    if let Some(n) = set.by_id.remove(&victim) {
                        set.cache.remove(&n);
                    }
                }
                let id = *next_cache_id;
                *next_cache_id += 1;
                set.cache.insert(name.clone(), (id, base.clone()));
                set.by_id.insert(id, name.clone());
                set.lru.touch(id);
                Some(id)
            }
        }
    } else {
        None
    };
    Response {
        set_id,
        kind: base.kind,
        items: vec![Item {
            request: base,
            cache_id,
            first_dims,
            split_matrix,
        }],
        joined,
        last_joined: 0,
        error: None,
    }
}

/// Groups ranks by the value `f` gives and describes the disagreement, or `None` if all agree.
fn disagreement<T: PartialEq + std::fmt::Display>(
    what: &str,
    submitted: &[(usize, &Request)],
    f: impl Fn(&Request) -> T,
) -> Option<String> {
    let mut groups: Vec<(T, Vec<usize>)> = Vec::new();
    for &(rank, r) in submitted {
        let v = f(r);
        match groups.iter_mut().find(|(g, _)| *g == v) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((v, vec![rank])),
        }
    }
    if groups.len() <= 1 {
        return None;
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(v, ranks)| {
            let who = if ranks.len() == 1 {
                format!("rank {}", ranks[0])
            } else {
                format!("ranks {ranks:?}")
            };
            format!("{who} sent {v}")
        })
        .collect();
    Some(format!("Mismatched {what}: {}", parts.join(", ")))
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

fn validate(name: &str, submitted: &[(usize, &Request)]) -> Option<String> {
    let with_name = |m: String| format!("{m} (tensor '{name}')");
    if let Some(m) = disagreement("operations", submitted, |r| r.kind.name()) {
        return Some(with_name(m));
    }
    if let Some(m) = disagreement("number of tensors in the group", submitted, |r| {
        r.tensors.len()
    }) {
        return Some(with_name(m));
    }
    let kind = submitted[0].1.kind;
    for t in 0..submitted[0].1.tensors.len() {
        let tn = |m: String| {
            if submitted[0].1.tensors.len() > 1 {
                format!("{m} (tensor '{name}', group member {t})")
            } else {
                with_name(m)
            }
        };
        if let Some(m) = disagreement("data types", submitted, |r| r.tensors[t].dtype.name()) {
            return Some(tn(m));
        }
        let m = match kind {
            OpKind::Allreduce | OpKind::Broadcast | OpKind::Reducescatter => {
                disagreement(&format!("{} tensor shapes", kind.name()), submitted, |r| {
                    shape_str(&r.tensors[t].shape)
                })
            }
            OpKind::Allgather | OpKind::Alltoall => {
                if let Some(m) = disagreement(
                    &format!("{} tensor ranks (number of dimensions)", kind.name()),
                    submitted,
                    |r| r.tensors[t].shape.len(),
                ) {
                    Some(m)
                } else {
                    disagreement(
                        &format!("{} tensor shapes beyond the first dimension", kind.name()),
                        submitted,
                        |r| shape_str(r.tensors[t].shape.get(1..).unwrap_or(&[])),
                    )
                }
            }
            _ => None,
        };
        if let Some(m) = m {
            return Some(tn(m));
        }
    }
    // After dtypes and shapes, which say more when they differ too.
    if let Some(m) = disagreement("devices", submitted, |r| r.device.name()) {
        return Some(with_name(format!(
            "{m}; a CUDA tensor runs on NCCL only where ferrovod finds NCCL and a working CUDA \
             driver, and is staged through host memory elsewhere: give every rank the same \
             setup"
        )));
    }
    match kind {
        OpKind::Allreduce | OpKind::Reducescatter => {
            if let Some(m) = disagreement("reduction operations", submitted, |r| r.op.name()) {
                return Some(with_name(m));
            }
            if let Some(m) = disagreement("prescale and/or postscale factors", submitted, |r| {
                format!("({}, {})", r.prescale, r.postscale)
            }) {
                return Some(with_name(m));
            }
        }
        OpKind::Broadcast => {
            if let Some(m) = disagreement("BROADCAST root ranks", submitted, |r| r.root) {
                return Some(with_name(m));
            }
        }
        OpKind::Alltoall => {
            let n = submitted.len();
            if let Some(&(rank, r)) = submitted.iter().find(|(_, r)| r.splits.len() != n) {
                return Some(with_name(format!(
                    "ALLTOALL splits of rank {rank} have {} entries, expected one per rank of the set ({n})",
                    r.splits.len()
                )));
            }
        }
        _ => {}
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::message::TensorMeta;
    use crate::types::{DType, ReduceOp};

    fn req(name: &str, dtype: DType, shape: &[usize]) -> Request {
        Request {
            set_id: 0,
            name: name.into(),
            kind: OpKind::Allreduce,
            op: ReduceOp::Sum,
            root: 0,
            prescale: 1.0,
            postscale: 1.0,
            tensors: vec![TensorMeta {
                dtype,
                shape: shape.to_vec(),
            }],
            splits: vec![],
            device: DeviceKind::Host,
        }
    }

    fn responses(out: &Outbox, to: usize) -> Vec<Response> {
        out.iter()
            .filter(|(r, _)| *r == to)
            .flat_map(|(_, m)| match m {
                FromCoordinator::Responses(rs) => rs.clone(),
                _ => vec![],
            })
            .collect()
    }

    #[test]
    fn ready_only_when_every_rank_submitted_in_any_order() {
        let mut n = Negotiator::new(3, &[], 1 << 20, 16);
        let mut out = Vec::new();
        n.handle(
            0,
            ToCoordinator::Submit(vec![Submit::Full(req("a", DType::F32, &[4]))]),
            &mut out,
        );
        n.handle(
            1,
            ToCoordinator::Submit(vec![Submit::Full(req("b", DType::F32, &[4]))]),
            &mut out,
        );
        n.handle(
            1,
            ToCoordinator::Submit(vec![Submit::Full(req("a", DType::F32, &[4]))]),
            &mut out,
        );
        n.flush(&mut out);
        assert!(responses(&out, 0).is_empty());
        n.handle(
            2,
            ToCoordinator::Submit(vec![Submit::Full(req("a", DType::F32, &[4]))]),
            &mut out,
        );
        n.flush(&mut out);
        let r = responses(&out, 2);
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].items[0].request.name, "a");
        assert!(r[0].error.is_none());
    }

    #[test]
    fn mismatch_names_tensor_and_ranks() {
        let mut n = Negotiator::new(3, &[], 1 << 20, 16);
        let mut out = Vec::new();
        n.handle(
            0,
            ToCoordinator::Submit(vec![Submit::Full(req("w", DType::F32, &[4]))]),
            &mut out,
        );
        n.handle(
            1,
            ToCoordinator::Submit(vec![Submit::Full(req("w", DType::I32, &[4]))]),
            &mut out,
        );
        n.handle(
            2,
            ToCoordinator::Submit(vec![Submit::Full(req("w", DType::F32, &[4]))]),
            &mut out,
        );
        n.flush(&mut out);
        for rank in 0..3 {
            let r = responses(&out, rank);
            let (_, msg) = r[0].error.clone().expect("error response");
            assert!(
                msg.contains("'w'")
                    && msg.contains("ranks [0, 2] sent float32")
                    && msg.contains("rank 1 sent int32"),
                "{msg}"
            );
        }
    }

    #[test]
    fn cached_submissions_replay_and_fuse() {
        let mut n = Negotiator::new(2, &[], 1 << 20, 16);
        let mut out = Vec::new();
        for r in 0..2 {
            n.handle(
                r,
                ToCoordinator::Submit(vec![Submit::Full(req("x", DType::F32, &[4]))]),
                &mut out,
            );
        }
        n.flush(&mut out);
        let id = responses(&out, 0)[0].items[0].cache_id.expect("cached");
        out.clear();
        for r in 0..2 {
            n.handle(
                r,
                ToCoordinator::Submit(vec![
                    Submit::Cached { set_id: 0, id },
                    Submit::Full(req("y", DType::F32, &[2])),
                ]),
                &mut out,
            );
        }
        n.flush(&mut out);
        let r = responses(&out, 1);
        assert_eq!(r.len(), 1, "x and y fuse into one response");
        assert_eq!(r[0].items.len(), 2);
        out.clear();
        n.handle(
            0,
            ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id: 999 }]),
            &mut out,
        );
        assert!(matches!(
            out[0].1,
            FromCoordinator::CacheMiss { id: 999, .. }
        ));
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_name() {
        let mut n = Negotiator::new(1, &[], 1 << 20, 2);
        let mut out = Vec::new();
        let mut id_of = |n: &mut Negotiator, sub: Submit| {
            out.clear();
            n.handle(0, ToCoordinator::Submit(vec![sub]), &mut out);
            n.flush(&mut out);
            responses(&out, 0).first().and_then(|r| r.items[0].cache_id)
        };
        let a = id_of(&mut n, Submit::Full(req("a", DType::F32, &[1]))).unwrap();
        let b = id_of(&mut n, Submit::Full(req("b", DType::F32, &[1]))).unwrap();
        // `a` used again: `b` is now the oldest and goes when `c` needs room.
        assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: a }), Some(a));
        let c = id_of(&mut n, Submit::Full(req("c", DType::F32, &[1]))).unwrap();
        assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: c }), Some(c));
        assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: a }), Some(a));
        assert_eq!(id_of(&mut n, Submit::Cached { set_id: 0, id: b }), None);
        let mut miss = Vec::new();
        n.handle(
            0,
            ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id: b }]),
            &mut miss,
        );
        assert!(matches!(miss[0].1, FromCoordinator::CacheMiss { .. }));
    }

    #[test]
    fn host_and_cuda_allreduces_never_fuse_and_a_cached_name_may_change_device() {
        let mut n = Negotiator::new(2, &[], 1 << 20, 16);
        let mut out = Vec::new();
        let cuda = |name: &str| Request {
            device: DeviceKind::Cuda,
            ..req(name, DType::F32, &[4])
        };
        for r in 0..2 {
            n.handle(
                r,
                ToCoordinator::Submit(vec![
                    Submit::Full(req("h1", DType::F32, &[4])),
                    Submit::Full(cuda("d1")),
                    Submit::Full(cuda("d2")),
                    Submit::Full(req("h2", DType::F32, &[4])),
                ]),
                &mut out,
            );
        }
        n.flush(&mut out);
        let r = responses(&out, 0);
        let groups: Vec<Vec<(&str, DeviceKind)>> = r
            .iter()
            .map(|resp| {
                resp.items
                    .iter()
                    .map(|i| (i.request.name.as_str(), i.request.device))
                    .collect()
            })
            .collect();
        assert_eq!(
            groups,
            vec![
                vec![("h1", DeviceKind::Host)],
                vec![("d1", DeviceKind::Cuda), ("d2", DeviceKind::Cuda)],
                vec![("h2", DeviceKind::Host)],
            ]
        );
        // h1 is cached as a host request; the same name on CUDA is a different request, sent
        // in full and validated again (rank 1 stays on the host: a mismatch).
        let id = r[0].items[0].cache_id.expect("cached");
        out.clear();
        n.handle(
            0,
            ToCoordinator::Submit(vec![Submit::Full(cuda("h1"))]),
            &mut out,
        );
        n.handle(
            1,
            ToCoordinator::Submit(vec![Submit::Cached { set_id: 0, id }]),
            &mut out,
        );
        n.flush(&mut out);
        let (_, msg) = responses(&out, 1)[0].error.clone().expect("mismatch");
        assert!(
            msg.contains("Mismatched devices: rank 0 sent CUDA, rank 1 sent CPU")
                && msg.contains("'h1'"),
            "{msg}"
        );
    }

    #[test]
    fn dead_rank_fails_pending_names() {
        let mut n = Negotiator::new(3, &[], 1 << 20, 16);
        let mut out = Vec::new();
        n.handle(
            0,
            ToCoordinator::Submit(vec![Submit::Full(req("g", DType::F32, &[1]))]),
            &mut out,
        );
        n.rank_gone(2, Gone::Died, "connection lost".into(), &mut out);
        n.flush(&mut out);
        let r = responses(&out, 0);
        assert!(r[0].error.as_ref().unwrap().1.contains("rank 2 failed"));
        assert!(out
            .iter()
            .any(|(to, m)| *to == 1 && matches!(m, FromCoordinator::RankFailed { rank: 2, .. })));
    }

    #[test]
    fn stall_inspector_names_tensors_and_missing_ranks_then_gives_up() {
        let mut n = Negotiator::new(3, &[], 1 << 20, 16);
        let mut out = Vec::new();
        n.handle(
            0,
            ToCoordinator::Submit(vec![Submit::Full(req("skipped", DType::F32, &[1]))]),
            &mut out,
        );
        n.handle(
            2,
            ToCoordinator::Submit(vec![Submit::Full(req("skipped", DType::F32, &[1]))]),
            &mut out,
        );
        let t0 = Instant::now();
        let check = Duration::from_secs(2);
        assert!(n.inspect(t0, check, None).is_none(), "too early");
        let warn = n
            .inspect(t0 + Duration::from_secs(3), check, None)
            .expect("a warning");
        assert!(warn.contains("Missing ranks:\n1: [skipped]"), "{warn}");
        assert!(
            n.inspect(t0 + Duration::from_secs(4), check, None)
                .is_none(),
            "once per interval"
        );
        let warn = n.inspect(
            t0 + Duration::from_secs(10),
            check,
            Some(Duration::from_secs(8)),
        );
        assert!(warn.is_some());
        n.flush(&mut out);
        let r = responses(&out, 0);
        let (code, msg) = r[0].error.clone().expect("stalled tensor fails");
        assert_eq!(code, 2);
        assert!(msg.contains("'skipped'") && msg.contains("[1]"), "{msg}");
    }

    #[test]
    fn join_counts_as_submitted_and_reports_last_rank() {
        let mut n = Negotiator::new(2, &[], 1 << 20, 16);
        let mut out = Vec::new();
        n.handle(0, ToCoordinator::Join, &mut out);
        n.handle(
            1,
            ToCoordinator::Submit(vec![Submit::Full(req("g", DType::F32, &[1]))]),
            &mut out,
        );
        n.flush(&mut out);
        let r = responses(&out, 0);
        assert_eq!(r[0].joined, vec![0]);
        out.clear();
        n.handle(1, ToCoordinator::Join, &mut out);
        n.flush(&mut out);
        let r = responses(&out, 0);
        assert_eq!((r[0].kind, r[0].last_joined), (OpKind::Join, 1));
    }
}
