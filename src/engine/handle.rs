//! Handles: how a submitter learns that its op completed. `wait` spins briefly (a blocking
//! wake-up costs 40-60 µs here) and then blocks on a condition variable; `poll` never blocks.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::Result;
use crate::spin::Spin;

use super::names::NameClaim;
use super::tensor::TensorBuf;

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
}

struct State {
    result: Mutex<Option<Result<Output>>>,
    cond: Condvar,
    done: AtomicBool,
    /// Decremented on completion (the engine's count of ops in flight, see `engine::fast`).
    count: Option<Arc<AtomicUsize>>,
    /// The op's name, released on completion (see `engine::names`).
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

    /// Holds `claim` until the op completes.
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
        // Released before anyone can see the result, so the name is free again by then.
        drop(self.state.claim.lock().take());
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

    /// Waits at most `limit` (no spin): `None` when the op has not completed by then,
    /// otherwise what [`Handle::wait`] returns.
    pub fn wait_for(&self, limit: Duration) -> Option<Option<Result<Output>>> {
        let mut slot = self.state.result.lock();
        if !self.state.done.load(Ordering::Acquire) {
            self.state.cond.wait_for(&mut slot, limit);
        }
        self.state.done.load(Ordering::Acquire).then(|| slot.take())
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
        slot.take()
    }
}
