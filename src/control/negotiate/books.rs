//! The negotiator's books: per process set, the requests each member has sent under a name
//! ([`Pending`]), the set's own state ([`SetState`]: its ranks, time limit, response cache and
//! the bases in flight), and the cache's order of use ([`Lru`]). Visible to the negotiator's
//! other files, as when they were one.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::control::message::Request;

pub(super) struct Pending {
    /// Members of the op's set.
    pub(super) members: usize,
    /// Which members submitted, a bit each in set order.
    pub(super) got_bits: Vec<u64>,
    /// Members whose request is in.
    pub(super) got: usize,
    /// The one request every submission so far shares (a cached op's members all submit the
    /// cache's own): a pointer for the op, not one per rank, at the root of a large job.
    pub(super) shared: Option<Arc<Request>>,
    /// Each member's request, once two submissions differ (a full request among cached
    /// ones, or two full ones): what validation compares.
    pub(super) each: Option<Vec<Option<Arc<Request>>>>,
    /// (global rank, reason) of members that refused the op (see [`Submit::Rejected`]).
    pub(super) rejected: Vec<(usize, String)>,
    pub(super) all_cached: bool,
    /// When the first rank submitted it (the stall inspector's clock).
    pub(super) since: Instant,
    /// When the stall inspector last warned about it.
    pub(super) warned: Option<Instant>,
}

impl Pending {
    pub(super) fn new(members: usize) -> Pending {
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
    pub(super) fn has(&self, idx: usize) -> bool {
        self.got_bits[idx / 64] & (1 << (idx % 64)) != 0
    }

    /// Records the submission of the member at `idx` (which has not submitted), its request
    /// `req`, cloned only when the op does not hold it already.
    pub(super) fn put(&mut self, idx: usize, req: &Arc<Request>) {
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
    pub(super) fn request(&self, idx: usize) -> Option<&Arc<Request>> {
        match &self.each {
            Some(each) => each[idx].as_ref(),
            None => self.shared.as_ref().filter(|_| self.has(idx)),
        }
    }

    /// A submitted request (the op has at least one).
    pub(super) fn first(&self) -> Request {
        Request::clone(self.any())
    }

    pub(super) fn any(&self) -> &Arc<Request> {
        let any = match &self.each {
            Some(each) => each.iter().flatten().next(),
            None => self.shared.as_ref(),
        };
        any.expect("a pending op has a submission")
    }
}

pub(super) struct SetState {
    pub(super) ranks: Vec<usize>,
    /// How long an op of this set may wait for members that have not submitted it before it
    /// fails on those that have (torch's group timeout); `None`: the engine's stall limit.
    pub(super) timeout: Option<Duration>,
    pub(super) table: HashMap<String, Pending>,
    /// Shared base name → the names pending under it (see
    /// [`Op::base`](crate::control::message::Op::base)): one, unless ranks disagree.
    pub(super) bases: HashMap<String, Vec<String>>,
    /// How many bases have more than one name: while none has, no submission looks at them.
    pub(super) contested: usize,
    /// name → (cache id, validated request); `by_id` is its inverse.
    pub(super) cache: HashMap<String, (u64, Arc<Request>)>,
    pub(super) by_id: HashMap<u64, String>,
    pub(super) lru: Lru,
}

/// A set's own stall limit from its wire form (milliseconds; 0: none, the engine's applies).
pub(super) fn set_limit(timeout_ms: u64) -> Option<Duration> {
    (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms))
}

impl SetState {
    pub(super) fn new(ranks: Vec<usize>) -> Self {
        SetState::limited(ranks, 0)
    }

    /// A set whose stalled ops fail after `timeout_ms` (0: the engine's stall limit).
    pub(super) fn limited(ranks: Vec<usize>, timeout_ms: u64) -> Self {
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
    pub(super) fn cached(&mut self, id: u64) -> Option<Arc<Request>> {
        let req = self.cache.get(self.by_id.get(&id)?)?.1.clone();
        self.lru.touch(id);
        Some(req)
    }

    pub(super) fn set_rank(&self, global: usize) -> Option<usize> {
        self.ranks.binary_search(&global).ok()
    }

    /// Records that `request`'s name is pending (its first submission), under its shared base
    /// if it has one.
    pub(super) fn note_base(&mut self, request: &Request) {
        let Some(base) = request.base() else {
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
    pub(super) fn take(&mut self, name: &str) -> Option<Pending> {
        let p = self.table.remove(name)?;
        let req = p.any();
        if let Some(base) = req.base() {
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

/// Cache ids by last use. Every cached op touches its id twice (its submission, its
/// response), so a touch must not cost a pass over the cache: a model with a thousand
/// gradients made the old queue scan a thousand ids per op on rank 0.
#[derive(Default)]
pub(super) struct Lru {
    /// use tick → id, oldest first.
    pub(super) by_tick: BTreeMap<u64, u64>,
    /// id → its tick in `by_tick`.
    pub(super) tick_of: HashMap<u64, u64>,
    pub(super) next_tick: u64,
}

impl Lru {
    /// Marks `id` (new or known) as used last.
    pub(super) fn touch(&mut self, id: u64) {
        self.remove(id);
        self.by_tick.insert(self.next_tick, id);
        self.tick_of.insert(id, self.next_tick);
        self.next_tick += 1;
    }

    pub(super) fn remove(&mut self, id: u64) {
        if let Some(t) = self.tick_of.remove(&id) {
            self.by_tick.remove(&t);
        }
    }

    /// Takes the least recently used id.
    pub(super) fn pop_oldest(&mut self) -> Option<u64> {
        let (_, id) = self.by_tick.pop_first()?;
        self.tick_of.remove(&id);
        Some(id)
    }
}
