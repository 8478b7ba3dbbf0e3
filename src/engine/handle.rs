//! Handles: how a submitter learns that its op completed. `wait` spins briefly (a blocking
//! wake-up costs 40-60 µs here) and then blocks on a condition variable; `poll` never blocks.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::Result;
use crate::spin::Spin;

use super::tensor::TensorBuf;
use crate::control::names::NameClaim;

/// What a completed op hands back.
#[derive(Default)]
pub struct Output {
    /// Engine-allocated results (allgather, alltoall, reducescatter), one per tensor, with
    /// their shapes. Empty for ops that wrote into caller memory.
    pub tensors: Vec<(TensorBuf, Vec<usize>)>,
    /// Alltoall: rows received from each rank.
    pub received_splits: Vec<usize>,
    /// Join: the last rank to join.
    pub last_joined: Option<usize>,
    /// A point-to-point message: the rank it went to or came from.
    pub source: Option<usize>,
}

struct State {
    result: Mutex<Option<Result<Output>>>,
    cond: Condvar,
    done: AtomicBool,
    /// Decremented on completion (the engine's count of ops in flight, see `engine::fast`).
    count: Option<Arc<AtomicUsize>>,
    /// The op's name, held until the submitter has seen the op complete (see
    /// `control::names`).
    claim: Mutex<Option<NameClaim>>,
}

/// Shared completion slot of one submitted op.
#[derive(Clone)]
pub struct Handle {
    state: Arc<State>,
}

impl Default for Handle {
    fn default() -> Self {
        Handle::new()
    }
}

impl Handle {
    /// A pending handle.
    pub fn new() -> Handle {
        Handle::with_count(None)
    }

    /// A pending handle counted in `count` until it completes.
    pub(crate) fn counted(count: &Arc<AtomicUsize>) -> Handle {
        count.fetch_add(1, Ordering::AcqRel);
        Handle::with_count(Some(count.clone()))
    }

    fn with_count(count: Option<Arc<AtomicUsize>>) -> Handle {
        Handle {
            state: Arc::new(State {
                result: Mutex::new(None),
                cond: Condvar::new(),
                done: AtomicBool::new(false),
                count,
                claim: Mutex::new(None),
            }),
        }
    }

    /// Holds `claim` until the submitter sees the op complete: its result taken
    /// ([`Handle::wait`]), a [`Handle::seen_done`] that says so, or the handle dropped.
    pub(crate) fn hold(self, claim: NameClaim) -> Handle {
        *self.state.claim.lock() = Some(claim);
        self
    }

    /// Completes the op (first completion wins).
    pub fn complete(&self, result: Result<Output>) {
        let mut slot = self.state.result.lock();
        if self.state.done.load(Ordering::Acquire) {
            return;
        }
        *slot = Some(result);
        self.state.done.store(true, Ordering::Release);
        if let Some(c) = &self.state.count {
            c.fetch_sub(1, Ordering::AcqRel);
        }
        self.state.cond.notify_all();
    }

    /// True once completed. Never blocks.
    pub fn poll(&self) -> bool {
        self.state.done.load(Ordering::Acquire)
    }

    /// [`Handle::poll`] for the submitter: once it says the op is done, the op's name is free
    /// again. Until the submitter has seen that, a second op under the name is refused even
    /// if the first has completed: otherwise whether it was refused would depend on how fast
    /// the peers were (a rank whose first op completed at once would send a second one that
    /// the others, which refused theirs, never match).
    pub fn seen_done(&self) -> bool {
        let done = self.poll();
        if done {
            self.release_name();
        }
        done
    }

    fn release_name(&self) {
        drop(self.state.claim.lock().take());
    }

    /// Waits at most `limit` (no spin): `None` when the op has not completed by then,
    /// otherwise what [`Handle::wait`] returns.
    pub fn wait_for(&self, limit: Duration) -> Option<Option<Result<Output>>> {
        let mut slot = self.state.result.lock();
        if !self.state.done.load(Ordering::Acquire) {
            self.state.cond.wait_for(&mut slot, limit);
        }
        let done = self.state.done.load(Ordering::Acquire).then(|| slot.take());
        drop(slot);
        if done.is_some() {
            self.release_name();
        }
        done
    }

    /// Waits for completion, spinning up to `spin` first. Returns the result (once; later
    /// calls get `None`).
    pub fn wait(&self, spin: Duration) -> Option<Result<Output>> {
        let mut spin = Spin::new(spin);
        // Yield while spinning: the engine thread completing this op may share our core.
        while !self.poll() && spin.yield_core() {}
        let mut slot = self.state.result.lock();
        while !self.state.done.load(Ordering::Acquire) {
            self.state.cond.wait(&mut slot);
        }
        let out = slot.take();
        drop(slot);
        self.release_name();
        out
    }
}
