//! The PyO3 boundary: the only Rust that knows Python. It holds the one process-wide engine
//! slot (so `init` / `shutdown` / `init` again work), turns Python arguments into engine
//! submissions, and maps engine errors onto the exception classes of `ferrovod.exceptions`.

mod device;
mod errors;
mod host_memory;
mod op;
mod settings;
mod store;
mod tensor;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::bootstrap::launch::{LaunchInfo, Launcher};
use crate::config::{Config, VARS};
use crate::engine::{Engine, SetScope};
use crate::error::Error;
use crate::job::Membership;
use crate::sys::forks;
use crate::types::{OpKind, ReduceOp};

use errors::to_pyerr;
use settings::Settings;

struct Slot {
    engine: Engine,
    /// [`forks`] when it started: a different count means this is a forked child.
    forks: u64,
    /// `FERROVOD_SHM_DISABLE` as this engine was started with (host memory asks).
    shm_disable: bool,
    /// What the tests' view of the NCCL id exchange (`device::nccl_unique_id`) reads: this
    /// `init()`'s number, which keys its rendezvous-store entries, and the job's rendezvous
    /// store (address, secret; `None` for a one-rank job without one) with its wait limit.
    #[cfg(feature = "testing")]
    exchange: (u64, Option<(String, Vec<u8>)>, std::time::Duration),
}

static ENGINE: OnceLock<Mutex<Option<Slot>>> = OnceLock::new();
/// The `log` → Python `logging` bridge, installed once per process at import.
static LOG_BRIDGE: OnceLock<pyo3_log::ResetHandle> = OnceLock::new();
static GENERATION: AtomicU64 = AtomicU64::new(0);

fn slot() -> &'static Mutex<Option<Slot>> {
    ENGINE.get_or_init(|| Mutex::new(None))
}

/// Whether the live engine runs with shared memory off (`FERROVOD_SHM_DISABLE`).
fn shm_disabled() -> PyResult<bool> {
    with_slot(|s| Ok(s.shm_disable))
}

/// Runs `f` with the live engine, or fails as Horovod does before `init()` (and after a fork).
fn with_engine<T>(f: impl FnOnce(&Engine) -> PyResult<T>) -> PyResult<T> {
    with_slot(|s| f(&s.engine))
}

/// Runs `f` with the live engine's slot, or fails as [`with_engine`] says.
fn with_slot<T>(f: impl FnOnce(&Slot) -> PyResult<T>) -> PyResult<T> {
    let guard = slot().lock();
    match guard.as_ref() {
        Some(s) if s.forks == forks() => f(s),
        Some(_) => Err(to_pyerr(Error::NotInitialized(
            "ferrovod cannot be used in a process forked after init() (e.g. a data-loader \
             worker); call ferrovod.init() in the child if it needs its own job"
                .into(),
        ))),
        None => Err(to_pyerr(Error::NotInitialized(
            "ferrovod has not been initialized; use ferrovod.init().".into(),
        ))),
    }
}

/// Starts the engine (no-op if already running in this process) with `settings`, read with
/// the launch. `rendezvous_addr` and `secret` replace `FERROVOD_RENDEZVOUS_ADDR` /
/// `FERROVOD_SECRET` (the MPI exchange's result). `store_listener` is the descriptor of a
/// listening TCP socket on the port of `rendezvous_addr`, which the engine takes over (closes)
/// and, as rank 0, serves the rendezvous store on.
#[pyfunction]
#[pyo3(signature = (settings, process_sets=Vec::new(), dynamic=false, rendezvous_addr=None, secret=None, generation=None, store_listener=None))]
#[allow(clippy::too_many_arguments)] // Python's keyword arguments, passed through
fn init(
    py: Python<'_>,
    settings: PyRef<'_, Settings>,
    process_sets: Vec<Vec<usize>>,
    dynamic: bool,
    rendezvous_addr: Option<String>,
    secret: Option<Vec<u8>>,
    generation: Option<u64>,
    store_listener: Option<i32>,
) -> PyResult<()> {
    // Owned first, so that it is closed whatever happens next.
    let listener = store_listener
        .map(crate::sys::tcp_listener_from_fd)
        .transpose()
        .map_err(to_pyerr)?;
    if !settings.with_launch() {
        return Err(to_pyerr(Error::InvalidArgument(
            "init() needs settings read with the launch (read_settings())".into(),
        )));
    }
    let mut config = settings
        .config_with(rendezvous_addr.as_deref(), secret.as_deref())
        .map_err(to_pyerr)?;
    config.dynamic_process_sets |= dynamic;
    start(
        py,
        config,
        process_sets,
        generation,
        None,
        listener.as_ref(),
    )
    .map(|_| ())
}

/// Starts the engine for torch.distributed's front end (`init_process_group(backend=
/// "ferrovod")`): rank `rank` of `size`, formed over `store`, the store torch hands the backend
/// (any object with torch's `set`, `get`, `add` and `wait`), within `timeout_s`. `store_addr`
/// ("host:port") is where that store lives when known: the ranks listen on the address that
/// reaches it. `generation` numbers this forming among those over the same store, the same on
/// every rank (torch.distributed's front end counts them in the store). Process sets are
/// dynamic (torch's groups become process sets). `FERROVOD_SECRET` is the job secret when set;
/// else rank 0 hands one out through the store. With `op_timeout_s`, an op of the job's own
/// set stalled that long fails on the ranks that submitted it, and small ops keep off the fast
/// path (which cannot give up on one rank alone). Returns whether this call started the
/// engine (false: one was running with this rank and size, e.g. after `ferrovod.init()`, and
/// the caller must not shut it down).
#[pyfunction]
#[pyo3(signature = (settings, store, rank, size, timeout_s, store_addr=None, generation=0, op_timeout_s=None))]
#[allow(clippy::too_many_arguments)] // torch's creator's arguments, passed through
fn init_over_store(
    py: Python<'_>,
    settings: PyRef<'_, Settings>,
    store: Py<PyAny>,
    rank: usize,
    size: usize,
    timeout_s: f64,
    store_addr: Option<String>,
    generation: u64,
    op_timeout_s: Option<f64>,
) -> PyResult<bool> {
    if size == 0 || rank >= size {
        return Err(to_pyerr(Error::InvalidArgument(format!(
            "rank {rank} of a job of {size} ranks"
        ))));
    }
    if settings.with_launch() {
        return Err(to_pyerr(Error::InvalidArgument(
            "init_over_store() takes settings read without the launch \
             (read_settings(with_launch=False)): torch hands in the rank and size"
                .into(),
        )));
    }
    let mut config = settings.config().clone();
    let secret = config.launch.secret.take();
    config.launch = LaunchInfo {
        launcher: Launcher::ProcessGroup,
        rank0_hosts_store: false,
        rank,
        size,
        local: None,
        rendezvous_addr: store_addr,
        secret,
        secret_derived: false,
        agent_store: None,
    };
    config.start_timeout = positive_seconds(timeout_s)?;
    if let Some(t) = op_timeout_s {
        // An op of the job's own set that some ranks have not submitted within it fails, as
        // gloo's do (the stall limit, when lower, wins).
        let t = positive_seconds(t)?;
        config.stall_shutdown = Some(config.stall_shutdown.map_or(t, |s| s.min(t)));
    }
    config.dynamic_process_sets = true;
    let given: Arc<dyn crate::bootstrap::Store> = Arc::new(store::TorchStore::new(store));
    start(py, config, Vec::new(), Some(generation), Some(given), None)
}

/// `t` seconds as a duration, or an error unless it is a positive number.
fn positive_seconds(t: f64) -> PyResult<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(t)
        .ok()
        .filter(|t| !t.is_zero())
        .ok_or_else(|| to_pyerr(Error::InvalidArgument(format!("bad timeout {t} s"))))
}

/// Starts the engine with `config` unless one runs (a no-op then: false), with the slot's
/// bookkeeping; `given` is a store to form over instead of the rendezvous store, and
/// `store_listener` where rank 0 serves that one ([`Membership`]).
fn start(
    py: Python<'_>,
    config: Config,
    process_sets: Vec<Vec<usize>>,
    generation: Option<u64>,
    given: Option<Arc<dyn crate::bootstrap::Store>>,
    store_listener: Option<&std::net::TcpListener>,
) -> PyResult<bool> {
    // One init at a time, but the engine slot stays free while the rendezvous runs (up to the
    // start timeout): a thread blocked on the slot holds the GIL, which the starting engine's
    // log records need. Taken without the GIL for the same reason.
    static STARTING: Mutex<()> = Mutex::new(());
    let _starting = loop {
        if let Some(g) = STARTING.try_lock() {
            break g;
        }
        py.detach(|| drop(STARTING.lock()));
    };
    {
        let mut guard = slot().lock();
        if let Some(s) = guard.as_ref() {
            if s.forks == forks() {
                let (rank, size) = (config.launch.rank, config.launch.size);
                let running = s.engine.topology();
                if given.is_some() && (running.rank, running.size) != (rank, size) {
                    return Err(to_pyerr(Error::InvalidArgument(format!(
                        "ferrovod already runs as rank {} of {}, but torch.distributed asks for \
                         rank {rank} of {size}: call ferrovod.shutdown() first, or start both \
                         with the same ranks",
                        running.rank, running.size
                    ))));
                }
                if given.is_some() {
                    s.engine.let_sets_come();
                }
                return Ok(false);
            }
            // A forked child inherits the parent's slot but not its threads: forget it without
            // running any destructor that would wait for threads that do not exist here.
            std::mem::forget(guard.take());
        }
    }
    // An elastic job names its formings by the launcher's epoch, which every member shares
    // (a new worker's count of its own init() calls would not match the survivors').
    let generation = match generation {
        Some(epoch) => epoch,
        None => GENERATION.fetch_add(1, Ordering::AcqRel),
    };
    let engine = py
        .detach(|| {
            Engine::start_as(
                &config,
                Membership {
                    process_sets: &process_sets,
                    generation,
                    store: given.as_ref(),
                    store_listener,
                },
            )
        })
        .map_err(to_pyerr)?;
    *slot().lock() = Some(Slot {
        engine,
        forks: forks(),
        shm_disable: config.shm_disable,
        #[cfg(feature = "testing")]
        exchange: (
            generation,
            match (
                &given,
                &config.launch.rendezvous_addr,
                &config.launch.secret,
            ) {
                (None, Some(addr), Some(secret)) => Some((addr.clone(), secret.clone())),
                _ => None,
            },
            config.start_timeout,
        ),
    });
    Ok(true)
}

/// This host's IPv4 interfaces: `[(name, address, prefix length)]`.
#[pyfunction]
fn interfaces() -> PyResult<Vec<(String, String, u8)>> {
    Ok(crate::sys::interfaces()
        .map_err(to_pyerr)?
        .into_iter()
        .map(|i| (i.name, i.addr.to_string(), i.prefix))
        .collect())
}

/// Drops the bridge's cached Python logger levels (call after changing them).
#[pyfunction]
fn reset_log_cache() {
    if let Some(h) = LOG_BRIDGE.get() {
        h.reset();
    }
}

/// Stops the engine; pending ops fail. Safe to call when not initialized.
#[pyfunction]
fn shutdown(py: Python<'_>) {
    let taken = slot().lock().take();
    if let Some(s) = taken {
        if s.forks == forks() {
            let mut engine = s.engine;
            py.detach(move || engine.shutdown());
        } else {
            std::mem::forget(s);
        }
    }
}

/// Whether `init()` has run (in this process) and `shutdown()` has not.
#[pyfunction]
fn is_initialized() -> bool {
    matches!(slot().lock().as_ref(), Some(s) if s.forks == forks())
}

/// (rank, size, local_rank, local_size, cross_rank, cross_size, is_homogeneous)
#[pyfunction]
fn topology() -> PyResult<(usize, usize, usize, usize, usize, usize, bool)> {
    with_engine(|e| {
        let t = e.topology();
        Ok((
            t.rank,
            t.size,
            t.local_rank,
            t.local_size,
            t.cross_rank,
            t.cross_size,
            t.homogeneous,
        ))
    })
}

/// The data address of a NumPy array, or `None` when `obj` has no `__array_struct__`.
#[pyfunction]
fn array_address(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    tensor::array_address(obj)
}

/// `(ops reduced on the fast path, offers that went to the engine after all)` on this rank
/// (see `engine::fast`). For tests: not in the wheel (the `testing` feature).
#[cfg(feature = "testing")]
#[pyfunction]
fn fast_path_stats() -> PyResult<(u64, u64)> {
    with_engine(|e| Ok(e.fast_path().stats()))
}

/// The largest tensor, in bytes, that a blocking op of the global set takes the engine's
/// fast path with now (0: the path is off; see `engine::fast`).
#[pyfunction]
fn fast_path_bytes() -> PyResult<usize> {
    with_engine(|e| Ok(e.fast_path().max_bytes()))
}

/// Registers a process set; every rank calls it in the same order, or with `members_only` its
/// members alone (a set with these ranks and this timeout that exists already is then
/// reused), whose ops fail once stalled `timeout_s` seconds (torch's group timeout; `None`:
/// the engine's stall limit). Returns its id.
#[pyfunction]
#[pyo3(signature = (ranks, members_only=false, timeout_s=None))]
fn add_process_set(
    py: Python<'_>,
    ranks: Vec<usize>,
    members_only: bool,
    timeout_s: Option<f64>,
) -> PyResult<u32> {
    let scope = if members_only {
        let timeout = timeout_s.map(positive_seconds).transpose()?;
        SetScope::Members { timeout }
    } else if timeout_s.is_some() {
        return Err(to_pyerr(Error::InvalidArgument(
            "a timeout is a property of sets their members register alone".into(),
        )));
    } else {
        SetScope::EveryRank
    };
    // Not waited for under the engine lock: other threads may keep submitting meanwhile.
    let reply = with_engine(|e| Ok(e.add_process_set(ranks, scope)))?;
    py.detach(|| reply.wait()).map_err(to_pyerr)
}

/// Removes a process set; False if it was not registered.
#[pyfunction]
fn remove_process_set(py: Python<'_>, id: u32) -> PyResult<bool> {
    let reply = with_engine(|e| Ok(e.remove_process_set(id)))?;
    py.detach(|| reply.wait()).map_err(to_pyerr)
}

/// Starts writing a timeline to `path` (rank 0 writes; other ranks accept and ignore).
#[pyfunction]
#[pyo3(signature = (path, mark_cycles=false))]
fn start_timeline(py: Python<'_>, path: String, mark_cycles: bool) -> PyResult<()> {
    // Waited for outside the engine lock, as every wait is: a thread that blocks on that lock
    // holds the GIL, which the engine may need meanwhile (its log records go to Python).
    let reply = with_engine(|e| Ok(e.start_timeline(path, mark_cycles)))?;
    py.detach(|| reply.wait()).map_err(to_pyerr)
}

/// Stops the timeline and finishes its file.
#[pyfunction]
fn stop_timeline(py: Python<'_>) -> PyResult<()> {
    let reply = with_engine(|e| Ok(e.stop_timeline()))?;
    py.detach(|| reply.wait()).map_err(to_pyerr)
}

/// Registered process sets: {id: [ranks]}.
#[pyfunction]
fn process_sets(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let sets = with_engine(|e| Ok(e.process_sets()))?;
    let d = PyDict::new(py);
    for (id, ranks) in sets {
        d.set_item(id, ranks)?;
    }
    Ok(d)
}

/// Every environment variable: (name, Horovod alias or None, default, meaning).
#[pyfunction]
fn env_vars() -> Vec<(
    &'static str,
    Option<&'static str>,
    &'static str,
    &'static str,
)> {
    VARS.iter()
        .map(|v| (v.name, v.alias, v.default, v.doc))
        .collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // Every level passes the Rust side; Python's `ferrovod` logger level decides (cached by
    // the bridge, so a disabled record costs no GIL).
    if LOG_BRIDGE.get().is_none() {
        let logger = pyo3_log::Logger::new(m.py(), pyo3_log::Caching::LoggersAndLevels)?
            .filter(log::LevelFilter::Trace);
        if let Ok(handle) = logger.install() {
            let _ = LOG_BRIDGE.set(handle);
        }
    }
    m.add_function(wrap_pyfunction!(reset_log_cache, m)?)?;
    m.add_function(wrap_pyfunction!(start_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(stop_timeline, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(init_over_store, m)?)?;
    host_memory::register(m)?;
    device::register(m)?;
    op::register(m)?;
    store::register(m)?;
    settings::register(m)?;
    m.add_function(wrap_pyfunction!(interfaces, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(topology, m)?)?;
    #[cfg(feature = "testing")]
    m.add_function(wrap_pyfunction!(fast_path_stats, m)?)?;
    m.add_function(wrap_pyfunction!(fast_path_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(add_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(remove_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(process_sets, m)?)?;
    m.add_function(wrap_pyfunction!(env_vars, m)?)?;
    m.add_function(wrap_pyfunction!(array_address, m)?)?;
    for (name, code) in [
        ("ALLREDUCE", OpKind::Allreduce),
        ("ALLGATHER", OpKind::Allgather),
        ("BROADCAST", OpKind::Broadcast),
        ("ALLTOALL", OpKind::Alltoall),
        ("REDUCESCATTER", OpKind::Reducescatter),
        ("BARRIER", OpKind::Barrier),
    ] {
        m.add(name, code as u8)?;
    }
    for op in [
        ReduceOp::Average,
        ReduceOp::Sum,
        ReduceOp::Adasum,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ] {
        let name = match op {
            ReduceOp::Average => "Average",
            ReduceOp::Sum => "Sum",
            ReduceOp::Adasum => "Adasum",
            ReduceOp::Min => "Min",
            ReduceOp::Max => "Max",
            ReduceOp::Product => "Product",
        };
        m.add(name, op as u8)?;
    }
    for d in crate::types::DType::ALL {
        m.add(
            format!("DTYPE_{}", d.name().to_uppercase()).as_str(),
            d as u8,
        )?;
    }
    Ok(())
}
