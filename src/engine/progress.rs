//! Who turns the worker, and how an idle wait works.
//!
//! The engine thread always can. A caller blocked in [`Progress::wait`] on its own op may
//! instead take the worker and turn it itself until the op completes. On machines with as many
//! ranks as cores that is the difference between a few microseconds and a few tens: each op
//! otherwise crosses from the caller to the engine thread and back, and every such hand-over
//! is a thread switch on a core another rank's thread wants too. Only one thread holds the
//! worker at a time (the mutex), so what it does is unchanged: the same steps in the same
//! order, whoever runs them.
//!
//! Idle waits poll for `spin` (yielding the core between polls, because the thread being waited
//! for may be queued on this very core) and then block. The engine thread spins only after
//! work it did itself: when a caller did the work, the engine thread goes straight back to
//! sleep rather than compete with that caller's next op.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::spin::Spin;

use super::handle::{Handle, Output};
use super::worker::{Step, Worker};
use super::Shared;
use crate::control::lease::Lease;
use crate::control::node::Assist;
use crate::sys::wait_readable;

/// How often a blocked caller asks whether to stop waiting ([`Progress::wait_or`]): well
/// below what a person pressing Ctrl-C notices.
pub const STOP_CHECK: Duration = Duration::from_millis(50);

/// How soon the idle engine thread looks again at the fast path's connections across hosts
/// while a caller of this rank offers (see [`run`]).
const OFFER_RECHECK: Duration = Duration::from_millis(1);

/// The worker, shared by the engine thread and waiting callers. `None` once it has shut
/// down: the engine thread drops it then, so its sockets and mappings go at shutdown even
/// while Python still holds handles.
type Slot = Mutex<Option<Worker>>;

/// A waiter's access to the worker; cheap to clone.
#[derive(Clone)]
pub struct Progress {
    slot: Arc<Slot>,
    shared: Arc<Shared>,
    spin: Duration,
    /// Rank 0: the coordinator, turned too while the worker waits for it.
    coordinator: Option<Assist>,
}

impl Progress {
    /// How long waits poll before they block.
    pub fn spin(&self) -> Duration {
        self.spin
    }

    /// Waits for `handle`, turning the worker meanwhile when no one else is. Returns the op's
    /// result (once; later calls get `None`).
    pub fn wait(&self, handle: &Handle) -> Option<Result<Output>> {
        self.wait_or(handle, &|| false)
    }

    /// [`Progress::wait`] that asks `stop` every [`STOP_CHECK`] while the op waits on other
    /// ranks, and returns `Interrupted` when it says so (a signal for the caller's thread):
    /// the op stays in the engine and completes unseen.
    pub fn wait_or(&self, handle: &Handle, stop: &dyn Fn() -> bool) -> Option<Result<Output>> {
        let mut spin = Spin::new(self.spin);
        while !handle.poll() {
            if let Some(mut guard) = self.slot.try_lock() {
                if let Some(worker) = guard.as_mut() {
                    self.shared.lease.renew(self.spin);
                    let done = drive(
                        worker,
                        handle,
                        self.spin,
                        &self.shared.lease,
                        self.coordinator.as_ref(),
                    );
                    if done {
                        self.shared.lease.renew(self.spin);
                    } else {
                        // Idle for the whole spin: the op waits on other ranks. Hand it back to
                        // the background threads now rather than when the lease runs out.
                        self.shared.lease.end();
                        self.shared.waker.wake();
                        if let Some(c) = &self.coordinator {
                            c.release();
                        }
                    }
                }
                break;
            }
            if !spin.yield_core() {
                break;
            }
        }
        loop {
            if let Some(result) = handle.wait_for(STOP_CHECK) {
                return result;
            }
            // Peers' offers across hosts of slots this rank declined are answered while it
            // waits, should its engine thread be busy (see `engine::fast`).
            self.shared.fast.service();
            if stop() {
                return Some(Err(Error::Interrupted("waiting for an op".into())));
            }
        }
    }
}

/// Turns `worker` until `handle` completes (true), or the worker has been idle for `spin` or
/// shut down (false).
fn drive(
    worker: &mut Worker,
    handle: &Handle,
    spin: Duration,
    lease: &Lease,
    coordinator: Option<&Assist>,
) -> bool {
    let mut idle = Spin::new(spin);
    while !handle.poll() {
        match worker.step() {
            Step::Busy => {
                idle = Spin::new(spin);
                lease.renew(spin);
            }
            Step::Idle if coordinator.is_some_and(|c| c.turn(spin)) => {
                idle = Spin::new(spin);
                lease.renew(spin);
            }
            Step::Idle if idle.yield_core() => {}
            Step::Idle | Step::Finished => return handle.poll(),
        }
    }
    true
}

/// Starts the engine thread for `worker`; returns it and the waiters' access.
pub(super) fn start(
    worker: Worker,
    shared: Arc<Shared>,
    spin: Duration,
    coordinator: Option<Assist>,
) -> Result<(JoinHandle<()>, Progress)> {
    let slot = Arc::new(Mutex::new(Some(worker)));
    let (thread_slot, thread_shared) = (slot.clone(), shared.clone());
    let thread = std::thread::Builder::new()
        .name("ferrovod-engine".into())
        .spawn(move || run(&thread_slot, &thread_shared, spin))
        .map_err(|e| Error::Io(format!("spawning the engine thread: {e}")))?;
    Ok((
        thread,
        Progress {
            slot,
            shared,
            spin,
            coordinator,
        },
    ))
}

/// The engine thread: turn the worker while it has work; when idle, spin briefly if the work
/// was its own, then block until a submission or a control message arrives. While a caller
/// holds the lease, sleep instead.
fn run(slot: &Slot, shared: &Shared, spin: Duration) {
    let mut idle = Spin::new(spin);
    // Slept armed and not yet disarmed (a caller held the worker when we woke): the control
    // descriptor's readiness then.
    let mut armed: Option<bool> = None;
    loop {
        if let Some(left) = shared.lease.remaining() {
            let _ = wait_readable(&[shared.waker.fd()], left);
            shared.waker.clear();
            continue;
        }
        let mut guard = slot.lock();
        let Some(worker) = guard.as_mut() else {
            return;
        };
        if let Some(rang) = armed.take() {
            worker.disarm(rang);
        }
        match worker.step() {
            Step::Busy => {
                idle = Spin::new(spin);
                continue;
            }
            Step::Finished => {
                *guard = None;
                return;
            }
            Step::Idle => {}
        }
        let (mut fds, mut timeout) = (worker.idle_fds(), worker.idle_timeout());
        // The fast path's connections across hosts: a peer's offer of a slot this rank declined
        // is answered from here. Not while a caller offers or has just taken a slot (it reads
        // them, and sleeps on them): then look again within a millisecond.
        let fast_fds = fds.len();
        if shared.fast.offering(OFFER_RECHECK) {
            timeout = timeout.min(OFFER_RECHECK);
        } else {
            fds.extend(shared.fast.link_fds());
        }
        if !idle.over() {
            drop(guard);
            // A contended yield ends the spin: the next turn arms and blocks.
            idle.yield_core();
            continue;
        }
        if !worker.arm() {
            worker.disarm(false);
            continue;
        }
        drop(guard);
        // A submission made while a caller holds the lease does not write the waker unless it
        // sees this flag: publish it, then look at the queue once more (see `Engine::push`).
        shared.polling.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if !shared.queue.lock().is_empty() {
            shared.polling.store(false, Ordering::Relaxed);
            continue;
        }
        // The descriptors stay open while we sleep: only this thread drops the worker.
        let woke = wait_readable(&fds, timeout).unwrap_or_default();
        shared.polling.store(false, Ordering::Relaxed);
        shared.waker.clear();
        if woke.iter().any(|&i| i >= fast_fds) {
            shared.fast.service();
        }
        // Disarm at once if we can, or the coordinator rings for every message while a caller
        // turns the worker; otherwise on the next turn.
        let rang = woke.iter().any(|&i| i > 0 && i < fast_fds);
        match slot.try_lock() {
            Some(mut g) => {
                if let Some(w) = g.as_mut() {
                    w.disarm(rang);
                }
            }
            None => armed = Some(rang),
        }
    }
}
