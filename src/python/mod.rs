//! The PyO3 boundary: the only Rust that knows Python. It holds the one process-wide engine
//! slot (so `init` / `shutdown` / `init` again work), turns Python arguments into engine
//! submissions, and maps engine errors onto the exception classes of `ferrovod.exceptions`.

mod errors;
mod host_memory;
mod tensor;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};

use crate::bootstrap::tcp_store::{TcpStore, TcpStoreServer};
use crate::bootstrap::Store;
use crate::config::{Config, VARS};
use crate::engine::{Engine, Handle, OpSpec, Output, PageBuf, Progress, Ran, TensorBuf};
use crate::error::Error;
use crate::types::{OpKind, ReduceOp};

use errors::to_pyerr;

struct Slot {
    engine: Engine,
    /// [`forks`] when it started: a different count means this is a forked child.
    forks: u64,
    /// This `init()`'s number, which keys its rendezvous-store entries.
    generation: u64,
    /// The job's rendezvous store (address, secret) and its wait limit, for the NCCL
    /// unique-id exchange; `None` for a one-rank job without one.
    store: Option<(String, Vec<u8>)>,
    start_timeout: std::time::Duration,
}

static ENGINE: OnceLock<Mutex<Option<Slot>>> = OnceLock::new();
/// The `log` → Python `logging` bridge, installed once per process at import.
static LOG_BRIDGE: OnceLock<pyo3_log::ResetHandle> = OnceLock::new();
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Forks of this process image so far, counted in every child by a `pthread_atfork` handler:
/// telling a forked child from the process that ran `init()` without a `getpid` system call
/// on every op (a tenth of a microsecond each).
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork() {
    // Runs in the child right after fork(): an atomic add is all it may safely do.
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// The fork count (see [`FORKS`]); installs the counting handler on first use.
fn forks() -> u64 {
    static HANDLER: std::sync::Once = std::sync::Once::new();
    HANDLER.call_once(|| {
        // SAFETY: `count_fork` is an `extern "C"` function with no arguments that lives for
        // the whole program and only touches an atomic, as a child handler must.
        let rc = unsafe { libc::pthread_atfork(None, None, Some(count_fork)) };
        assert_eq!(rc, 0, "pthread_atfork failed");
    });
    FORKS.load(Ordering::Relaxed)
}

fn slot() -> &'static Mutex<Option<Slot>> {
    ENGINE.get_or_init(|| Mutex::new(None))
}

/// Runs `f` with the live engine, or fails as Horovod does before `init()` (and after a fork).
fn with_engine<T>(f: impl FnOnce(&Engine) -> PyResult<T>) -> PyResult<T> {
    let guard = slot().lock();
    match guard.as_ref() {
        Some(s) if s.forks == forks() => f(&s.engine),
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

/// `(log_level, log_hide_time, rank)` from the environment, so that Python can set up the
/// `ferrovod` logger before `init()` starts logging.
#[pyfunction]
fn log_settings() -> PyResult<(String, bool, usize)> {
    let c = Config::from_env().map_err(to_pyerr)?;
    Ok((c.log_level, c.log_hide_time, c.launch.rank))
}

/// Starts the engine (no-op if already running in this process). `rendezvous_addr` and
/// `secret` replace `FERROVOD_RENDEZVOUS_ADDR` / `FERROVOD_SECRET` (the MPI exchange's result).
#[pyfunction]
#[pyo3(signature = (process_sets=Vec::new(), dynamic=false, rendezvous_addr=None, secret=None, generation=None))]
fn init(
    py: Python<'_>,
    process_sets: Vec<Vec<usize>>,
    dynamic: bool,
    rendezvous_addr: Option<String>,
    secret: Option<Vec<u8>>,
    generation: Option<u64>,
) -> PyResult<()> {
    let config =
        Config::from_env_with(rendezvous_addr.as_deref(), secret.as_deref()).map_err(to_pyerr)?;
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
                return Ok(());
            }
            // A forked child inherits the parent's slot but not its threads: forget it without
            // running any destructor that would wait for threads that do not exist here.
            std::mem::forget(guard.take());
        }
    }
    let mut config = config;
    config.dynamic_process_sets |= dynamic;
    // An elastic job names its formings by the launcher's epoch, which every member shares
    // (a new worker's count of its own init() calls would not match the survivors').
    let generation = match generation {
        Some(epoch) => epoch,
        None => GENERATION.fetch_add(1, Ordering::AcqRel),
    };
    let engine = py
        .detach(|| Engine::start(&config, &process_sets, generation))
        .map_err(to_pyerr)?;
    let store = match (&config.launch.rendezvous_addr, &config.launch.secret) {
        (Some(addr), Some(secret)) => Some((addr.clone(), secret.clone())),
        _ => None,
    };
    *slot().lock() = Some(Slot {
        engine,
        forks: forks(),
        generation,
        store,
        start_timeout: config.start_timeout,
    });
    Ok(())
}

/// What `init()` needs to know before it starts the engine: `{"launcher": name, "rank",
/// "size", "needs_mpi_rendezvous": bool, "secret_set": bool (FERROVOD_SECRET given),
/// "iface": FERROVOD_IFACE or None, "agent_store": (torchrun agent store "host:port", key prefix) or None, "start_timeout": seconds}`.
#[pyfunction]
fn launch_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let c = Config::from_env().map_err(to_pyerr)?;
    let l = &c.launch;
    let d = PyDict::new(py);
    d.set_item("launcher", l.launcher.name())?;
    d.set_item("rank", l.rank)?;
    d.set_item("size", l.size)?;
    d.set_item("needs_mpi_rendezvous", l.needs_mpi_rendezvous())?;
    d.set_item("secret_set", l.secret.is_some() && !l.secret_derived)?;
    d.set_item("iface", c.iface)?;
    d.set_item("agent_store", l.agent_store.clone())?;
    d.set_item("start_timeout", c.start_timeout.as_secs_f64())?;
    Ok(d)
}

/// This host's IPv4 interfaces: `[(name, address, prefix length)]`.
#[pyfunction]
fn interfaces() -> PyResult<Vec<(String, String, u8)>> {
    Ok(crate::bootstrap::net::interfaces()
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

/// One tensor as the Python layer describes it: (data pointer, byte length, dtype code,
/// shape, output pointer or 0 for "engine allocates").
type PyTensor = (usize, usize, u8, Vec<usize>, usize);

/// Queues a collective and returns its handle at once. `device`: `(CUDA device ordinal, raw
/// current stream)` when the tensors are CUDA memory for the NCCL path (outputs allocated by
/// the caller: reducescatter's holds this rank's share); `None` for host memory. `now`: the
/// caller waits for the op at once, so a small allreduce may take the engine's fast path
/// (`engine::fast`) and come back already completed. `out_bytes`: the byte length of each
/// host output when it is not the input's: the whole result of an allgather into caller
/// memory, this rank's share of a reducescatter (in place when the input holds the output,
/// or the output the input, as this rank's block).
#[pyfunction]
#[pyo3(signature = (kind, name, set_id, tensors, op=1, root=0, prescale=1.0, postscale=1.0, splits=Vec::new(), device=None, now=false, out_bytes=None))]
#[allow(clippy::too_many_arguments)]
fn enqueue(
    py: Python<'_>,
    kind: u8,
    name: String,
    set_id: u32,
    tensors: Vec<PyTensor>,
    op: u8,
    root: usize,
    prescale: f64,
    postscale: f64,
    splits: Vec<usize>,
    device: Option<(u32, usize)>,
    now: bool,
    out_bytes: Option<Vec<usize>>,
) -> PyResult<CoreHandle> {
    let kind = OpKind::from_code(kind).map_err(to_pyerr)?;
    let op = reduce_op(op)?;
    if out_bytes.as_ref().is_some_and(|o| o.len() != tensors.len()) {
        return Err(to_pyerr(Error::InvalidArgument(format!(
            "{} '{name}': out_bytes gives one length per tensor",
            kind.name()
        ))));
    }
    let spec = with_engine(|e| {
        let tensors = tensors
            .into_iter()
            .enumerate()
            .map(|(i, t)| match device {
                None => tensor::spec_from_py(t, out_bytes.as_ref().map(|o| o[i])),
                Some((ordinal, stream)) => {
                    // An unknown set is refused by the engine, with its own message.
                    let n = e.process_set(set_id).map_or(1, |m| m.len());
                    let out = match &out_bytes {
                        Some(o) => o[i],
                        None if kind == OpKind::Reducescatter => t.1 / n,
                        None => t.1,
                    };
                    tensor::device_spec_from_py(t, ordinal, stream, out)
                }
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(OpSpec {
            set_id,
            name,
            kind,
            op,
            root,
            prescale,
            postscale,
            tensors,
            splits,
        })
    })?;
    if now {
        return match run_now(py, spec)? {
            (Ran::Done(out), progress) => {
                let handle = Handle::new();
                handle.complete(Ok(out));
                Ok(CoreHandle { handle, progress })
            }
            (Ran::Queued(handle, _), progress) => Ok(CoreHandle { handle, progress }),
        };
    }
    with_engine(|e| {
        Ok(CoreHandle {
            handle: e.submit(spec).map_err(to_pyerr)?,
            progress: e.progress(),
        })
    })
}

/// Runs a wait on other ranks without the GIL, handing it a `stop` check that runs Python's
/// signal handlers: a blocked op must not make Ctrl-C wait for it. The exception a handler
/// raised (KeyboardInterrupt) is returned beside the wait's result, which is then an
/// `Interrupted` error, and is what the caller raises.
fn interruptible<T: Send>(
    py: Python<'_>,
    wait: impl FnOnce(&dyn Fn() -> bool) -> T + Send,
) -> (T, Option<PyErr>) {
    let raised: Mutex<Option<PyErr>> = Mutex::new(None);
    let stop = || {
        Python::attach(|py| match py.check_signals() {
            Ok(()) => false,
            Err(e) => {
                *raised.lock() = Some(e);
                true
            }
        })
    };
    let out = py.detach(|| wait(&stop));
    (out, raised.into_inner())
}

/// Runs `spec` through the engine's one entry ([`Door::run`]) for a caller that waits at
/// once, with the GIL released while the fast path waits for the other ranks.
fn run_now(py: Python<'_>, spec: OpSpec) -> PyResult<(Ran, Progress)> {
    let door = with_engine(|e| Ok(e.door()))?;
    match interruptible(py, |stop| door.run(spec, Some(stop))) {
        (_, Some(e)) => Err(e),
        (ran, None) => Ok((ran.map_err(to_pyerr)?, door.progress())),
    }
}

/// Refuses an op on this rank while taking part in its negotiation: the other members of
/// process set `set_id` get the error too, instead of waiting for this rank's op. The
/// handle's `wait` raises every member's error (once all of them have submitted `name`).
#[pyfunction]
fn reject(kind: u8, name: String, set_id: u32, reason: String) -> PyResult<CoreHandle> {
    let kind = OpKind::from_code(kind).map_err(to_pyerr)?;
    let op = OpSpec {
        set_id,
        name,
        kind,
        op: ReduceOp::Sum,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        tensors: Vec::new(),
        splits: Vec::new(),
    };
    with_engine(|e| {
        Ok(CoreHandle {
            handle: e.reject(op, reason).map_err(to_pyerr)?,
            progress: e.progress(),
        })
    })
}

/// A reduction code from Python, or an error that names it.
fn reduce_op(code: u8) -> PyResult<ReduceOp> {
    ReduceOp::from_code(code).map_err(|_| {
        to_pyerr(Error::InvalidArgument(format!(
            "op={code} is not a reduction: use Sum, Average, Min, Max or Product"
        )))
    })
}

/// One NumPy array and its output (`None`: the engine allocates; may be the input itself,
/// which must then be writable) as an engine tensor, read from `__array_struct__`. `None`
/// when an array is not one [`tensor::describe_array`] describes or the output does not
/// match the input's size.
fn array_tensor(input: &Bound<'_, PyAny>, output: Option<&Bound<'_, PyAny>>) -> Option<PyTensor> {
    let in_place = output.is_some_and(|o| o.is(input));
    let (ptr, nbytes, dtype, shape) = tensor::describe_array(input, in_place)?;
    let out_ptr = match output {
        None => 0,
        Some(_) if in_place => ptr,
        Some(o) => match tensor::describe_array(o, true) {
            Some((p, n, _, _)) if n == nbytes => p,
            _ => return None,
        },
    };
    Some((ptr, nbytes, dtype as u8, shape, out_ptr))
}

/// Results up to this size that [`op_now`] hands back are copied into a `bytearray`.
const SMALL_RESULT_BYTES: usize = 256 << 10;

/// A blocking allreduce, broadcast, allgather, reducescatter or evenly split alltoall of one
/// NumPy array, done before returning: the fast path when it applies, else the engine.
/// `output`: the array the result goes to (may be `input` itself; `None` for the ops whose
/// result is new). Returns False, doing nothing, when an array is not one
/// [`tensor::describe_array`] describes, the output does not match, or the op is malformed (a
/// broadcast root outside the job, a 0-d input to gather or split, a reducescatter that is not
/// Sum or Average): the caller then takes the general path, with its own errors. Otherwise
/// True, or for a new result `(buffer, shape)`: a `bytearray` for a small result, else a
/// buffer as [`CoreHandle::wait`] returns them.
#[pyfunction]
#[pyo3(signature = (kind, input, output, name, op=1, root=0, prescale=1.0, postscale=1.0))]
#[allow(clippy::too_many_arguments)]
fn op_now<'py>(
    py: Python<'py>,
    kind: u8,
    input: Bound<'py, PyAny>,
    output: Option<Bound<'py, PyAny>>,
    name: String,
    op: u8,
    root: usize,
    prescale: f64,
    postscale: f64,
) -> PyResult<Bound<'py, PyAny>> {
    let no = || Ok(false.into_pyobject(py)?.to_owned().into_any());
    let kind = OpKind::from_code(kind).map_err(to_pyerr)?;
    let op = reduce_op(op)?;
    let Some(t) = array_tensor(&input, output.as_ref()) else {
        return no();
    };
    let (out_ptr, shape) = (t.4, &t.3);
    let well_formed = match kind {
        OpKind::Allreduce => out_ptr != 0,
        OpKind::Broadcast => out_ptr != 0 && root < with_engine(|e| Ok(e.topology().size))?,
        OpKind::Allgather | OpKind::Alltoall => out_ptr == 0 && !shape.is_empty(),
        OpKind::Reducescatter => {
            out_ptr == 0 && !shape.is_empty() && matches!(op, ReduceOp::Sum | ReduceOp::Average)
        }
        _ => false,
    };
    if !well_formed {
        return no();
    }
    let spec = OpSpec {
        set_id: 0,
        name,
        kind,
        op,
        root,
        prescale,
        postscale,
        tensors: vec![tensor::spec_from_py(t, None)?],
        splits: Vec::new(),
    };
    let out = match run_now(py, spec)? {
        (Ran::Done(out), _) => out,
        (Ran::Queued(handle, _), progress) => {
            match interruptible(py, move |stop| progress.wait_or(&handle, stop)) {
                (_, Some(e)) => return Err(e),
                (Some(Ok(out)), None) => out,
                (Some(Err(e)), None) => return Err(to_pyerr(e)),
                (None, None) => unreachable!("a handle no one else holds was not waited for"),
            }
        }
    };
    match out.tensors.into_iter().next() {
        None => Ok(true.into_pyobject(py)?.to_owned().into_any()),
        // A small result goes back as a bytearray: NumPy reads one through the buffer protocol
        // in a third of the time `__array_interface__` takes, which outweighs the copy.
        Some((buf, shape)) if buf.len() <= SMALL_RESULT_BYTES => {
            Ok((PyByteArray::new(py, buf.as_slice()), shape)
                .into_pyobject(py)?
                .into_any())
        }
        Some((buf, shape)) => {
            let data = EngineBytes::from(buf);
            Ok((Py::new(py, OwnedBuffer { data })?, shape)
                .into_pyobject(py)?
                .into_any())
        }
    }
}

/// [`enqueue`] for NumPy arrays, described in Rust from `__array_struct__` rather than as
/// tuples built in Python (about a fifth of a small op's Python time). `outputs[i]`: `None`
/// (the engine allocates) or the array the result goes to, which may be the input itself.
/// Returns `None`, queuing nothing, when an array is not one [`tensor::describe_array`]
/// describes or an output does not match its input's size: the caller then uses `enqueue`.
#[pyfunction]
#[pyo3(signature = (kind, name, set_id, inputs, outputs, op=1, root=0, prescale=1.0, postscale=1.0, splits=Vec::new(), now=false))]
#[allow(clippy::too_many_arguments)]
fn enqueue_arrays(
    py: Python<'_>,
    kind: u8,
    name: String,
    set_id: u32,
    inputs: Vec<Bound<'_, PyAny>>,
    outputs: Vec<Option<Bound<'_, PyAny>>>,
    op: u8,
    root: usize,
    prescale: f64,
    postscale: f64,
    splits: Vec<usize>,
    now: bool,
) -> PyResult<Option<CoreHandle>> {
    if inputs.len() != outputs.len() {
        return Ok(None);
    }
    let mut tensors = Vec::with_capacity(inputs.len());
    for (input, output) in inputs.iter().zip(&outputs) {
        let Some(t) = array_tensor(input, output.as_ref()) else {
            return Ok(None);
        };
        tensors.push(t);
    }
    enqueue(
        py, kind, name, set_id, tensors, op, root, prescale, postscale, splits, None, now, None,
    )
    .map(Some)
}

/// The data address of a NumPy array, or `None` when `obj` has no `__array_struct__`.
#[pyfunction]
fn array_address(obj: &Bound<'_, PyAny>) -> PyResult<Option<usize>> {
    tensor::array_address(obj)
}

/// `(ops reduced on the fast path, offers that went to the engine after all)` on this rank
/// (see `engine::fast`).
#[pyfunction]
fn fast_path_stats() -> PyResult<(u64, u64)> {
    with_engine(|e| Ok(e.fast_path().stats()))
}

/// Declares this rank out of data; the handle's result is the last rank to join.
#[pyfunction]
fn join() -> PyResult<CoreHandle> {
    with_engine(|e| {
        Ok(CoreHandle {
            handle: e.join(),
            progress: e.progress(),
        })
    })
}

/// Registers a process set; every rank calls it in the same order. Returns its id.
#[pyfunction]
fn add_process_set(py: Python<'_>, ranks: Vec<usize>) -> PyResult<u32> {
    // Not waited for under the engine lock: other threads may keep submitting meanwhile.
    let reply = with_engine(|e| Ok(e.add_process_set(ranks)))?;
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

/// The completion of one queued op.
#[pyclass(module = "ferrovod._core")]
struct CoreHandle {
    handle: Handle,
    progress: Progress,
}

#[pymethods]
impl CoreHandle {
    /// True when the op has completed (its name is then free again). Never blocks.
    fn poll(&self) -> bool {
        self.handle.seen_done()
    }

    /// Waits (GIL released) and returns `(outputs, received_splits, last_joined)` where
    /// outputs is a list of `(bytearray, shape)` for engine-allocated results.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = self.handle.clone();
        let progress = self.progress.clone();
        let (res, raised) = interruptible(py, move |stop| progress.wait_or(&h, stop));
        if let Some(e) = raised {
            return Err(e);
        }
        let out: Output = match res {
            Some(Ok(o)) => o,
            Some(Err(e)) => return Err(to_pyerr(e)),
            None => {
                return Err(to_pyerr(Error::InvalidArgument(
                    "this handle was already synchronized".into(),
                )))
            }
        };
        let list = PyList::empty(py);
        for (buf, shape) in out.tensors {
            let data = EngineBytes::from(buf);
            list.append((Py::new(py, OwnedBuffer { data })?, shape))?;
        }
        Ok((list, out.received_splits, out.last_joined)
            .into_pyobject(py)?
            .into_any())
    }
}

/// A result buffer the engine allocated, handed to NumPy without a copy: it exposes
/// `__array_interface__`, so `numpy.asarray(buf)` views its bytes and keeps it alive.
#[pyclass(module = "ferrovod._core")]
struct OwnedBuffer {
    /// Never resized after construction, so the address NumPy is given stays valid for as
    /// long as this object lives (NumPy holds a reference to it as the array's base).
    data: EngineBytes,
}

/// The memory behind an [`OwnedBuffer`]: a small result on the C heap, or a large one in
/// pages that go back to the engine's pool when NumPy lets go of the array.
enum EngineBytes {
    Heap(Vec<u8>),
    Pages(PageBuf),
}

impl From<TensorBuf> for EngineBytes {
    /// An engine result, without a copy where it is engine memory already.
    fn from(buf: TensorBuf) -> EngineBytes {
        match buf {
            TensorBuf::Owned(v) => EngineBytes::Heap(v),
            TensorBuf::Pages(p) => EngineBytes::Pages(p),
            other => EngineBytes::Heap(other.as_slice().to_vec()),
        }
    }
}

impl EngineBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            EngineBytes::Heap(v) => v,
            EngineBytes::Pages(p) => p.as_slice(),
        }
    }
}

#[pymethods]
impl OwnedBuffer {
    /// NumPy's array interface (version 3): a writable 1-d uint8 view of the bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let bytes = self.data.as_slice();
        array_interface(py, bytes.as_ptr(), bytes.len())
    }

    fn __len__(&self) -> usize {
        self.data.as_slice().len()
    }
}

/// NumPy's array interface (version 3) of `len` writable bytes at `ptr`: the object that
/// returns it must keep them alive and in place (NumPy holds it as the array's base).
fn array_interface<'py>(
    py: Python<'py>,
    ptr: *const u8,
    len: usize,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("data", (ptr as usize, false))?;
    d.set_item("shape", (len,))?;
    d.set_item("typestr", "|u1")?;
    d.set_item("version", 3)?;
    Ok(d)
}

/// The rendezvous store a launcher runs for its workers.
#[pyclass(module = "ferrovod._core")]
struct RendezvousServer {
    server: Option<TcpStoreServer>,
    addr: String,
}

#[pymethods]
impl RendezvousServer {
    #[new]
    #[pyo3(signature = (secret, host="127.0.0.1"))]
    fn new(py: Python<'_>, secret: Vec<u8>, host: &str) -> PyResult<Self> {
        let bind = format!("{host}:0")
            .parse()
            .map_err(|e| to_pyerr(Error::InvalidArgument(format!("bad host {host:?}: {e}"))))?;
        // Without the GIL: nothing here needs Python, and the store's threads may log (which
        // takes the GIL) from the moment they exist.
        let server = py
            .detach(|| TcpStoreServer::start(bind, secret))
            .map_err(to_pyerr)?;
        let addr = server.local_addr().to_string();
        Ok(RendezvousServer {
            server: Some(server),
            addr,
        })
    }

    /// "host:port" workers connect to.
    #[getter]
    fn addr(&self) -> String {
        self.addr.clone()
    }

    /// Sets `key` to `value` in the store, waking the workers waiting on it (the elastic
    /// driver publishing a membership).
    fn set(&self, key: &str, value: Vec<u8>) -> PyResult<()> {
        match &self.server {
            Some(s) => {
                s.set(key, &value);
                Ok(())
            }
            None => Err(to_pyerr(Error::Shutdown(
                "the rendezvous store is closed".into(),
            ))),
        }
    }

    /// Stops serving. The store's threads are joined with the GIL released: a connection
    /// thread may be logging (e.g. a half-authenticated connection dropped by the shutdown),
    /// and logging goes to Python; joining it with the GIL held would never return.
    fn close(&mut self, py: Python<'_>) {
        if let Some(mut s) = self.server.take() {
            py.detach(move || s.shutdown());
        }
    }
}

/// A client of the job's rendezvous store (an elastic worker reading the memberships its
/// launcher publishes). Every blocking call releases the GIL.
#[pyclass(module = "ferrovod._core")]
struct StoreClient {
    store: TcpStore,
}

#[pymethods]
impl StoreClient {
    /// Connects to `addr` ("host:port") and proves `secret`, retrying for up to `timeout_s`.
    #[new]
    fn new(py: Python<'_>, addr: String, secret: Vec<u8>, timeout_s: f64) -> PyResult<Self> {
        let timeout = seconds(timeout_s)?;
        let store = py
            .detach(|| TcpStore::connect(addr.as_str(), &secret, timeout))
            .map_err(to_pyerr)?;
        Ok(StoreClient { store })
    }

    /// The value of `key`, waiting up to `timeout_s` for it to be set; `None` if it was not.
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &str,
        timeout_s: f64,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let timeout = seconds(timeout_s)?;
        match py.detach(|| self.store.get(key, timeout)) {
            Ok(v) => Ok(Some(PyBytes::new(py, &v))),
            Err(Error::Timeout { .. }) => Ok(None),
            Err(e) => Err(to_pyerr(e)),
        }
    }

    /// Adds `delta` to the counter at `key` (missing: 0) and returns the new value.
    fn add(&self, py: Python<'_>, key: &str, delta: i64) -> PyResult<i64> {
        py.detach(|| self.store.add(key, delta)).map_err(to_pyerr)
    }

    /// Sets `key` to `value`, replacing what it held.
    fn set(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        py.detach(|| self.store.set(key, value)).map_err(to_pyerr)
    }
}

fn seconds(s: f64) -> PyResult<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s.max(0.0))
        .map_err(|e| to_pyerr(Error::InvalidArgument(format!("bad timeout {s}: {e}"))))
}

impl Drop for RendezvousServer {
    /// A server never closed is shut down when Python frees it: also without the GIL (see
    /// `close`), where the GIL can be released.
    fn drop(&mut self) {
        let mut server = self.server.take();
        if server.is_none() {
            return;
        }
        Python::try_attach(|py| py.detach(|| server.take().map(|mut s| s.shutdown())));
        if let Some(mut s) = server {
            s.shutdown();
        }
    }
}

/// Whether the engine hands CUDA tensors to the NCCL backend (allreduce, broadcast and
/// evenly split reducescatter; the torch adapter stages the rest, and everything where
/// [`device_path`] says no, through host memory). `build_info`'s `gpu_operations` and
/// `nccl_built()` follow it.
const DEVICE_DISPATCH: bool = true;

/// Whether the engine takes CUDA tensors in this process: `(True, what it runs them on)` —
/// NCCL (searched as `gpu_probe` does, with `extra_dirs`; the NCCL it opens is the one the
/// engine then uses), or, without NCCL or with `FERROVOD_NCCL_DISPATCH=0`, the engine's
/// staging through pinned host memory — or `(False, why not)`: no CUDA driver or GPU, so the
/// torch adapter stages them itself. Loads the libraries: ask only once a CUDA tensor is at
/// hand.
#[pyfunction]
fn device_path(py: Python<'_>, extra_dirs: Vec<String>) -> (bool, String) {
    if !DEVICE_DISPATCH {
        return (
            false,
            "this build does not dispatch CUDA tensors to NCCL".into(),
        );
    }
    let dirs: Vec<std::path::PathBuf> = extra_dirs.into_iter().map(Into::into).collect();
    let answer = py.detach(|| {
        let devices = crate::backend::cuda::cuda_ready()?;
        let nccl = crate::backend::nccl::Nccl::dispatched(&dirs).map(|nccl| {
            let lib = nccl.library();
            let (a, b, c) = lib.version;
            format!("NCCL {a}.{b}.{c} ({})", lib.path)
        });
        Ok::<_, Error>(match nccl {
            Ok(what) => format!("{what} on {devices} CUDA device(s)"),
            Err(e) => format!(
                "{devices} CUDA device(s), no NCCL ({e}): the engine stages CUDA tensors \
                 through pinned host memory"
            ),
        })
    });
    match answer {
        Ok(what) => (true, what),
        Err(e) => (false, e.to_string()),
    }
}

/// Why the NCCL path cannot run this op on CUDA tensors as they are, or `None` when it can
/// (kind, dtype and reduce-op codes; `set_size`: ranks of the process set). The torch
/// adapter stages the op through host memory when it cannot.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn device_op_check(
    kind: u8,
    dtype: u8,
    op: u8,
    prescale: f64,
    postscale: f64,
    set_size: usize,
    shape: Vec<usize>,
) -> PyResult<Option<String>> {
    let kind = OpKind::from_code(kind).map_err(to_pyerr)?;
    let dtype = crate::types::DType::from_code(dtype).map_err(to_pyerr)?;
    let op = reduce_op(op)?;
    Ok(crate::backend::nccl::check_device_op(
        kind, dtype, op, prescale, postscale, set_size, &shape,
    )
    .err()
    .map(|e| e.to_string()))
}

/// What this build contains. `nccl`: the NCCL backend is compiled in (every build); whether
/// it can be used on this machine is the run-time probe's answer (`gpu_probe`).
/// `device_dispatch`: whether the engine uses it for CUDA tensors ([`DEVICE_DISPATCH`]).
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", env!("CARGO_PKG_VERSION"))?;
    d.set_item("transports", vec!["tcp", "shm"])?;
    d.set_item("controllers", vec!["ferrovod"])?;
    d.set_item("cpu_operations", vec!["ferrovod"])?;
    let gpu_operations: &[&str] = if DEVICE_DISPATCH && crate::config::nccl_dispatch() {
        &["nccl"]
    } else {
        &[]
    };
    d.set_item("gpu_operations", gpu_operations)?;
    d.set_item("nccl", true)?;
    d.set_item(
        "device_dispatch",
        DEVICE_DISPATCH && crate::config::nccl_dispatch(),
    )?;
    d.set_item("cuda", false)?;
    d.set_item("mpi", false)?;
    d.set_item("gloo", false)?;
    Ok(d)
}

/// What the run-time search for NCCL and the CUDA driver found (`extra_dirs`: directories
/// that may hold `libnccl.so.2`, e.g. the `nvidia-nccl-*` wheel's). Never fails: a missing or
/// broken library is described, not raised.
#[pyfunction]
fn gpu_probe(py: Python<'_>, extra_dirs: Vec<String>) -> PyResult<Bound<'_, PyDict>> {
    use crate::gpu::loader::{probe_cuda, probe_nccl, CudaProbe, NcclProbe};
    let dirs: Vec<std::path::PathBuf> = extra_dirs.into_iter().map(Into::into).collect();
    let explicit = crate::config::nccl_library();
    let (nccl, cuda) = py.detach(|| (probe_nccl(explicit.as_deref(), &dirs), probe_cuda()));
    let d = PyDict::new(py);
    let n = PyDict::new(py);
    match nccl {
        NcclProbe::Found(lib) => {
            n.set_item("found", true)?;
            n.set_item("path", lib.path)?;
            let (a, b, c) = lib.version;
            n.set_item("version", format!("{a}.{b}.{c}"))?;
            n.set_item("code", lib.code)?;
        }
        NcclProbe::Unusable { path, reason } => {
            n.set_item("found", false)?;
            n.set_item("path", path)?;
            n.set_item("reason", reason)?;
        }
        NcclProbe::Absent { tried } => {
            n.set_item("found", false)?;
            n.set_item("reason", format!("not found (tried {})", tried.join("; ")))?;
        }
    }
    d.set_item("nccl", n)?;
    let c = PyDict::new(py);
    match cuda {
        CudaProbe::Ready {
            driver_version,
            devices,
        } => {
            c.set_item("found", true)?;
            c.set_item("driver_version", driver_version)?;
            c.set_item("devices", devices)?;
        }
        CudaProbe::Unusable { reason } => {
            c.set_item("found", false)?;
            c.set_item("reason", reason)?;
        }
        CudaProbe::Absent { detail } => {
            c.set_item("found", false)?;
            c.set_item("reason", format!("no CUDA driver ({detail})"))?;
        }
    }
    d.set_item("cuda", c)?;
    Ok(d)
}

/// Agrees on an NCCL unique id for a communicator of process set `process_set_id` through
/// the job's rendezvous store, as the engine does before creating one: the set's first rank
/// generates it (`ncclGetUniqueId`), the others fetch it. `comm_index` tells apart several
/// communicators of one set. Needs a usable NCCL (the probe's search, with `extra_dirs`), no
/// GPU. Returns the id's 128 bytes.
#[pyfunction]
#[pyo3(signature = (extra_dirs, process_set_id=0, comm_index=0))]
fn nccl_unique_id(
    py: Python<'_>,
    extra_dirs: Vec<String>,
    process_set_id: u32,
    comm_index: u32,
) -> PyResult<Bound<'_, PyBytes>> {
    use crate::backend::nccl::{unique_id_key, Nccl};
    let (ranks, rank) = with_engine(|e| Ok((e.process_set(process_set_id), e.topology().rank)))?;
    let (generation, store, timeout) = {
        let guard = slot().lock();
        let s = guard.as_ref().expect("with_engine found it");
        (s.generation, s.store.clone(), s.start_timeout)
    };
    let ranks = ranks.ok_or_else(|| {
        to_pyerr(Error::InvalidArgument(format!(
            "no process set {process_set_id}"
        )))
    })?;
    let me = ranks.iter().position(|&r| r == rank).ok_or_else(|| {
        to_pyerr(Error::InvalidArgument(format!(
            "rank {rank} is not a member of process set {process_set_id}"
        )))
    })?;
    let dirs: Vec<std::path::PathBuf> = extra_dirs.into_iter().map(Into::into).collect();
    let explicit = crate::config::nccl_library();
    let id = py
        .detach(|| {
            let probe = crate::gpu::loader::probe_nccl(explicit.as_deref(), &dirs);
            let nccl = Nccl::open(&probe)?;
            match store {
                Some((addr, secret)) if ranks.len() > 1 => {
                    let store = TcpStore::connect(addr.as_str(), &secret, timeout)?;
                    let key = unique_id_key(generation, process_set_id, comm_index);
                    nccl.exchange_unique_id(&store, &key, me, timeout)
                }
                _ => nccl.unique_id(),
            }
        })
        .map_err(to_pyerr)?;
    Ok(PyBytes::new(py, id.as_bytes()))
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
    m.add_function(wrap_pyfunction!(log_settings, m)?)?;
    m.add_function(wrap_pyfunction!(start_timeline, m)?)?;
    m.add_function(wrap_pyfunction!(stop_timeline, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    host_memory::register(m)?;
    m.add_function(wrap_pyfunction!(launch_info, m)?)?;
    m.add_function(wrap_pyfunction!(interfaces, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(topology, m)?)?;
    m.add_function(wrap_pyfunction!(enqueue, m)?)?;
    m.add_function(wrap_pyfunction!(enqueue_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(fast_path_stats, m)?)?;
    m.add_function(wrap_pyfunction!(op_now, m)?)?;
    m.add_function(wrap_pyfunction!(reject, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(add_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(remove_process_set, m)?)?;
    m.add_function(wrap_pyfunction!(process_sets, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_probe, m)?)?;
    m.add_function(wrap_pyfunction!(nccl_unique_id, m)?)?;
    m.add_function(wrap_pyfunction!(device_path, m)?)?;
    m.add_function(wrap_pyfunction!(device_op_check, m)?)?;
    m.add_function(wrap_pyfunction!(env_vars, m)?)?;
    m.add_function(wrap_pyfunction!(array_address, m)?)?;
    m.add_class::<CoreHandle>()?;
    m.add_class::<RendezvousServer>()?;
    m.add_class::<StoreClient>()?;
    m.add_class::<OwnedBuffer>()?;
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
