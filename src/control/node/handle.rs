//! What the engine holds of its rank's node: its settings, the running node (whose drop ends
//! its thread), and the access a waiting caller uses to turn it.

use std::net::TcpListener;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;

use super::{run, ConnectUp, State};
use crate::bootstrap::ControlTree;
use crate::control::autotune::AutotuneConfig;
use crate::control::lease::Lease;
use crate::control::relay::Links;
use crate::error::{Error, Result};
use crate::sys::Waker;

/// Settings the coordinator needs.
pub struct CoordinatorConfig {
    /// Ranks in the job.
    pub size: usize,
    /// Job secret.
    pub secret: Vec<u8>,
    /// Static process sets (ids 1..).
    pub process_sets: Vec<Vec<usize>>,
    /// Fusion limit in bytes.
    pub fusion_threshold: usize,
    /// Response cache capacity per set.
    pub cache_capacity: usize,
    /// Batching window.
    pub cycle_time: Duration,
    /// Bound on authentication and sends.
    pub timeout: Duration,
    /// Stall inspector warning time (`None`: disabled).
    pub stall_check: Option<Duration>,
    /// Stall shutdown time.
    pub stall_shutdown: Option<Duration>,
    /// Online tuning of the fusion threshold and cycle time.
    pub autotune: Option<AutotuneConfig>,
    /// How long an idle wait polls (yielding) before it blocks.
    pub spin: Duration,
    /// This node's rank.
    pub rank: usize,
    /// The control tree every rank derived from the same host table; `None` for a coordinator
    /// started before the table was read (see [`Coordinator::place`]).
    pub tree: Option<ControlTree>,
    /// A relay's way up to its parent's node; `None` for the coordinator (rank 0).
    pub parent: Option<ConnectUp>,
    /// Ranks may register sets without this one after it has shut down: a job of
    /// torch.distributed's front end, where `destroy_process_group` is no barrier and
    /// `new_group` asks no rank outside the group (see `may_stop`).
    pub sets_may_come: bool,
}

/// A running coordinator; dropping it (or `stop`) ends the thread.
pub struct Coordinator {
    stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    state: Arc<Mutex<State>>,
    lease: Arc<Lease>,
    thread: Option<JoinHandle<()>>,
}

impl Coordinator {
    /// Starts the coordinator on `listener`, and on `local` (an abstract Unix socket that
    /// ranks on this host reach it by) when given.
    pub fn start(
        listener: TcpListener,
        local: Option<UnixListener>,
        cfg: CoordinatorConfig,
    ) -> Result<Coordinator> {
        listener.set_nonblocking(true)?;
        if let Some(l) = &local {
            l.set_nonblocking(true)?;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let waker = Arc::new(Waker::new()?);
        let state = Arc::new(Mutex::new(State::new(listener, local, cfg, waker.clone())));
        let lease = Arc::new(Lease::default());
        let (s, w, st, l) = (stop.clone(), waker.clone(), state.clone(), lease.clone());
        let thread = std::thread::Builder::new()
            .name("ferrovod-coordinator".into())
            .spawn(move || run(&st, &s, &w, &l))
            .map_err(|e| Error::Io(format!("spawning the coordinator: {e}")))?;
        Ok(Coordinator {
            stop,
            waker,
            state,
            lease,
            thread: Some(thread),
        })
    }

    /// Gives a coordinator started before the host table was read its control tree: from now
    /// on the connections it authenticated register.
    pub fn place(&self, tree: &ControlTree) {
        let mut st = self.state.lock();
        st.links = Links::new(tree, st.cfg.rank);
        st.cfg.tree = Some(tree.clone());
        drop(st);
        self.waker.wake();
    }

    /// From now on ranks may register sets without this one after it has shut down
    /// ([`CoordinatorConfig::sets_may_come`]): torch.distributed's front end has joined an
    /// engine that `ferrovod.init()` started.
    pub fn let_sets_come(&self) {
        self.state.lock().cfg.sets_may_come = true;
    }

    /// Lets another thread turn the coordinator when it is idle (rank 0's caller waiting for
    /// an op: see `engine::progress`).
    pub fn assist(&self) -> Assist {
        Assist {
            state: self.state.clone(),
            lease: self.lease.clone(),
            waker: self.waker.clone(),
        }
    }

    /// Processes what is already received (e.g. this rank's `Leave`), then stops.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Another thread's access to the coordinator.
#[derive(Clone)]
pub struct Assist {
    state: Arc<Mutex<State>>,
    lease: Arc<Lease>,
    waker: Arc<Waker>,
}

impl Assist {
    /// Handles whatever has arrived, without blocking, unless the coordinator is busy (its
    /// own thread has it) or stopped, and keeps the coordinator thread asleep for `spin`.
    /// Returns whether anything was handled.
    pub fn turn(&self, spin: Duration) -> bool {
        self.lease.renew(spin);
        match self.state.try_lock() {
            Some(mut state) if !state.stopped => state.poll_and_turn(false, true),
            _ => false,
        }
    }

    /// Hands the coordinator back to its thread at once.
    pub fn release(&self) {
        self.lease.end();
        self.waker.wake();
    }
}
