//! The door from Python into the engine for an op ([`run`]), and what comes back: the handle
//! of a queued op and the buffers of results the engine allocated.

use parking_lot::Mutex;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyDict, PyList, PyString, PyTuple};

use crate::engine::{Handle, OpSpec, Output, PageBuf, Progress, TensorBuf};
use crate::error::Error;
use crate::types::{OpKind, ReduceOp};

use super::errors::to_pyerr;
use super::tensor;
use super::with_engine;

/// One tensor as the Python layer describes it: (data pointer, byte length, dtype code,
/// shape, output pointer or 0 for "engine allocates").
pub(super) type PyTensor = (usize, usize, u8, Vec<usize>, usize);

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run, m)?)?;
    m.add_function(wrap_pyfunction!(allreduce_now, m)?)?;
    m.add_function(wrap_pyfunction!(reject, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(transfer, m)?)?;
    m.add_class::<CoreHandle>()?;
    m.add_class::<OwnedBuffer>()?;
    Ok(())
}

/// The one door from Python into the engine for an op: NumPy's, torch's, TensorFlow's and any
/// later adapter's op comes in here (through `ferrovod._api._run`) and goes on through the
/// engine's entry ([`crate::engine::Door::run`]), which decides its way.
///
/// `tensors`: a tuple or list of NumPy arrays, read from `__array_struct__` (a result goes to
/// `outputs[i]`: `None` when the engine allocates it, or an array of the input's size, which
/// may be the input itself; one array, and its output, may be passed bare), or `(address,
/// nbytes, dtype code, shape, output address or 0)` tuples for memory NumPy cannot describe
/// (the torch adapter's). `out_bytes`: each output's byte length where it
/// is not the input's (an allgather into caller memory, this rank's share of a reducescatter).
/// `device`: `(CUDA ordinal, raw current stream)` when the tuples address CUDA memory for the
/// NCCL path. `wait`: the caller waits at once, so the op is offered to the fast path first
/// (`engine::fast`); the GIL is released while it waits. `name`: a `str`, or an `OpName` that
/// also says where its base begins (see [`op_name`]).
///
/// Returns a [`CoreHandle`], or with `wait` the op's result (see [`result`]); `None`, queuing
/// nothing, when an array is not one [`tensor::describe_array`] describes or an output does
/// not match its input (the caller then describes it as a tuple), or for a broadcast whose
/// root is not a rank of the job (the caller refuses it, with its own message).
#[pyfunction]
// `tensors`, `outputs` and `splits` are read as they come rather than extracted into vectors
// by PyO3, which checks and iterates each as a generic sequence: a third of a small op's time
// in this call.
#[pyo3(signature = (kind, name, set_id, tensors, outputs=None, wait=false, op=1, root=0, prescale=1.0, postscale=1.0, splits=None, device=None, out_bytes=None))]
#[allow(clippy::too_many_arguments)] // the Python function's keywords, as the adapters pass them
fn run<'py>(
    py: Python<'py>,
    kind: u8,
    name: &Bound<'py, PyString>,
    set_id: u32,
    tensors: &Bound<'py, PyAny>,
    outputs: Option<&Bound<'py, PyAny>>,
    wait: bool,
    op: u8,
    root: usize,
    prescale: f64,
    postscale: f64,
    splits: Option<&Bound<'py, PyAny>>,
    device: Option<(u32, usize)>,
    out_bytes: Option<Vec<usize>>,
) -> PyResult<Bound<'py, PyAny>> {
    let (name, base_at) = op_name(name)?;
    let kind = OpKind::from_code(kind).map_err(to_pyerr)?;
    let op = reduce_op(op)?;
    let tensors = Items::of(tensors);
    let outputs = outputs.map(Items::of);
    let splits: Vec<usize> = match splits {
        Some(s) if s.len()? > 0 => s.extract()?,
        _ => Vec::new(),
    };
    let per_tensor = |what: &str, n: Option<usize>| match n {
        Some(n) if n != tensors.len() => Err(to_pyerr(Error::InvalidArgument(format!(
            "{} '{name}': {what} gives one entry per tensor",
            kind.name()
        )))),
        _ => Ok(()),
    };
    per_tensor("outputs", outputs.as_ref().map(Items::len))?;
    per_tensor("out_bytes", out_bytes.as_ref().map(Vec::len))?;
    // Host tensors become the engine's at once; device ones once the engine says how many
    // ranks share a reducescatter.
    let mut specs = Vec::with_capacity(tensors.len());
    let mut on_device = Vec::new();
    for i in 0..tensors.len() {
        let t = tensors.get(i)?;
        let described = match t.cast::<PyTuple>() {
            Ok(tuple) => tuple.extract::<PyTensor>()?,
            Err(_) => {
                let output = match &outputs {
                    Some(o) => Some(o.get(i)?).filter(|o| !o.is_none()),
                    None => None,
                };
                match array_tensor(&t, output.as_ref()) {
                    Some(d) => d,
                    None => return Ok(py.None().into_bound(py)),
                }
            }
        };
        let out = out_bytes.as_ref().map(|o| o[i]);
        match device {
            None => specs.push(tensor::spec_from_py(described, out)?),
            Some(_) => on_device.push((described, out)),
        }
    }
    let Some((spec, door)) = with_engine(|e| {
        // A broadcast from outside the job is the caller's to refuse, with its own message.
        if kind == OpKind::Broadcast && root >= e.topology().size {
            return Ok(None);
        }
        if let Some((ordinal, stream)) = device {
            // An unknown set is refused by the engine, with its own message.
            let n = e.process_set(set_id).map_or(1, |m| m.len());
            for (t, out) in on_device {
                let out = match out {
                    Some(o) => o,
                    None if kind == OpKind::Reducescatter => t.1 / n,
                    None => t.1,
                };
                specs.push(tensor::device_spec_from_py(t, ordinal, stream, out)?);
            }
        }
        let spec = OpSpec {
            set_id,
            name,
            base_at,
            kind,
            op,
            root,
            prescale,
            postscale,
            tensors: specs,
            splits,
        };
        check_base(&spec)?;
        Ok(Some((spec, e.door())))
    })?
    else {
        return Ok(py.None().into_bound(py));
    };
    if !wait {
        let handle = CoreHandle {
            handle: door.submit(spec).map_err(to_pyerr)?,
            progress: door.progress(),
        };
        return Ok(Bound::new(py, handle)?.into_any());
    }
    let out = wait_interruptibly(py, |stop| door.run_and_wait(spec, stop))?;
    result(py, out)
}

/// The blocking allreduce of one plain NumPy array in the global set, its arguments as the
/// caller of `allreduce`/`allreduce_` gave them, through [`run`]: `out` is `tensor` itself
/// (in place) or a new array of its size. False, having done nothing, for anything else (an
/// ndarray subclass or another object, a name that is not a string, `op` and `average` both
/// given or not a plain reduction code and bool, Adasum, factors that are not numbers, an
/// array `run` does not take): the general path then runs, and gives bad arguments their
/// errors.
///
/// Why here: when ranks outnumber cores every rank's turn on a core is short, and a Python
/// frame that resolves arguments runs cache-cold after each switch: the frames around
/// `run` cost a 4-byte allreduce on 8 ranks and 2 cores 40-50 us against 25-30 without them.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // the Python function's arguments, as `allreduce_` passes them
fn allreduce_now<'py>(
    py: Python<'py>,
    tensor: &Bound<'py, PyAny>,
    out: &Bound<'py, PyAny>,
    name: &Bound<'py, PyAny>,
    op: &Bound<'py, PyAny>,
    average: &Bound<'py, PyAny>,
    prescale: &Bound<'py, PyAny>,
    postscale: &Bound<'py, PyAny>,
) -> PyResult<bool> {
    static NDARRAY: PyOnceLock<Py<pyo3::types::PyType>> = PyOnceLock::new();
    let ndarray = NDARRAY.import(py, "numpy", "ndarray")?;
    if !tensor.get_type().is(ndarray) || !out.get_type().is(ndarray) {
        return Ok(false);
    }
    let Ok(name) = name.cast::<PyString>() else {
        return Ok(false);
    };
    let Some(code) = plain_reduction(op, average) else {
        return Ok(false);
    };
    let (Ok(prescale), Ok(postscale)) = (prescale.extract::<f64>(), postscale.extract::<f64>())
    else {
        return Ok(false);
    };
    let done = run(
        py,
        OpKind::Allreduce as u8,
        name,
        0,
        tensor,
        Some(out),
        true,
        code,
        0,
        prescale,
        postscale,
        None,
        None,
        None,
    )?;
    Ok(!done.is_none())
}

/// The reduction `op`/`average` name when they are the plain forms (`op` an `int` code of an
/// elementwise reduction, or `average` a `bool`, or neither: Average); `None` for anything
/// the general path must judge.
fn plain_reduction(op: &Bound<'_, PyAny>, average: &Bound<'_, PyAny>) -> Option<u8> {
    let code = match (op.is_none(), average.is_none()) {
        (true, true) => ReduceOp::Average as u8,
        (true, false) => {
            if average.cast_exact::<pyo3::types::PyBool>().ok()?.is_true() {
                ReduceOp::Average as u8
            } else {
                ReduceOp::Sum as u8
            }
        }
        (false, true) => op
            .cast_exact::<pyo3::types::PyInt>()
            .ok()?
            .extract::<u8>()
            .ok()?,
        (false, false) => return None,
    };
    match ReduceOp::from_code(code) {
        Ok(ReduceOp::Adasum) | Err(_) => None,
        Ok(_) => Some(code),
    }
}

/// The items of a tuple or list; any other object is one item (a one-tensor op's array,
/// passed as it is). Read in place: most ops have one tensor, and a vector of it would cost
/// an allocation.
enum Items<'a, 'py> {
    One(&'a Bound<'py, PyAny>),
    Tuple(&'a Bound<'py, PyTuple>),
    List(&'a Bound<'py, PyList>),
}

impl<'a, 'py> Items<'a, 'py> {
    fn of(seq: &'a Bound<'py, PyAny>) -> Self {
        if let Ok(t) = seq.cast::<PyTuple>() {
            return Items::Tuple(t);
        }
        if let Ok(l) = seq.cast::<PyList>() {
            return Items::List(l);
        }
        Items::One(seq)
    }

    fn len(&self) -> usize {
        match self {
            Items::One(_) => 1,
            Items::Tuple(t) => t.len(),
            Items::List(l) => l.len(),
        }
    }

    fn get(&self, i: usize) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Items::One(o) => Ok((*o).clone()),
            Items::Tuple(t) => t.get_item(i),
            Items::List(l) => l.get_item(i),
        }
    }
}

/// Results up to this size are handed back copied into a `bytearray`: NumPy views one in a
/// third of the time `__array_interface__` takes (0.25 against 1.9 µs), which outweighs the
/// copy up to about here; a 256 KiB allgather on one rank took 29.8 µs copied, 22 µs not.
const SMALL_RESULT_BYTES: usize = 64 << 10;

/// An op's result as Python gets it: `(outputs, received_splits, rank)` (`rank`: the last
/// rank to join, or a point-to-point message's peer), where
/// `outputs` is a tuple of `(buffer, shape)`, one for each result the engine allocated — a
/// `bytearray` for a small one, else an [`OwnedBuffer`].
fn result(py: Python<'_>, out: Output) -> PyResult<Bound<'_, PyAny>> {
    // The third element: the rank the op reports (the last to join, a message's peer).
    let named = out.last_joined.or(out.source);
    if out.tensors.is_empty() && out.received_splits.is_empty() && named.is_none() {
        // Most waiting calls write into the caller's memory: one shared `((), (), None)`
        // spares them building what no one reads.
        static NOTHING: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
        let nothing = NOTHING.get_or_try_init(py, || {
            let empty = PyTuple::empty(py);
            let t = (empty.clone(), empty, py.None()).into_pyobject(py)?;
            Ok::<_, PyErr>(t.into_any().unbind())
        })?;
        return Ok(nothing.bind(py).clone());
    }
    let outputs = out
        .tensors
        .into_iter()
        .map(|(buf, shape)| {
            let buf = if buf.len() <= SMALL_RESULT_BYTES {
                let bytes = buf.as_slice();
                PyByteArray::new_with(py, bytes.len(), |b| {
                    crate::sys::copy::copy(b, bytes);
                    Ok(())
                })?
                .into_any()
            } else {
                let data = EngineBytes::from(buf);
                Bound::new(py, OwnedBuffer { data })?.into_any()
            };
            (buf, shape).into_pyobject(py)
        })
        .collect::<PyResult<Vec<_>>>()?;
    // An empty tuple is a shared object, where an empty list is made anew.
    let received = if out.received_splits.is_empty() {
        PyTuple::empty(py).into_any()
    } else {
        out.received_splits.into_pyobject(py)?.into_any()
    };
    Ok((PyTuple::new(py, outputs)?, received, named)
        .into_pyobject(py)?
        .into_any())
}

/// Runs a wait on other ranks without the GIL, handing it a `stop` check that runs Python's
/// signal handlers: a blocked op must not make Ctrl-C wait for it. The exception a handler
/// raised (KeyboardInterrupt) is returned beside the wait's result, which is then an
/// `Interrupted` error, and is what the caller raises.
pub(super) fn interruptible<T: Send>(
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

/// [`interruptible`] for a wait that ends in the engine's `Result`: the exception a signal
/// handler raised, else the wait's error as Python's.
pub(super) fn wait_interruptibly<T: Send>(
    py: Python<'_>,
    wait: impl FnOnce(&dyn Fn() -> bool) -> crate::error::Result<T> + Send,
) -> PyResult<T> {
    match interruptible(py, wait) {
        (_, Some(e)) => Err(e),
        (done, None) => done.map_err(to_pyerr),
    }
}

/// Refuses an op on this rank while taking part in its negotiation: the other members of
/// process set `set_id` get the error too, instead of waiting for this rank's op. The
/// handle's `wait` raises every member's error (once all of them have submitted `name`, a
/// `str` or an `OpName`, as [`run`]'s).
#[pyfunction]
fn reject(
    kind: u8,
    name: &Bound<'_, PyString>,
    set_id: u32,
    reason: String,
) -> PyResult<CoreHandle> {
    let (name, base_at) = op_name(name)?;
    let kind = OpKind::from_code(kind).map_err(to_pyerr)?;
    let op = OpSpec {
        set_id,
        name,
        base_at,
        kind,
        op: ReduceOp::Sum,
        root: 0,
        prescale: 1.0,
        postscale: 1.0,
        tensors: Vec::new(),
        splits: Vec::new(),
    };
    check_base(&op)?;
    with_engine(|e| {
        Ok(CoreHandle {
            handle: e.reject(op, reason).map_err(to_pyerr)?,
            progress: e.progress(),
        })
    })
}

/// An op's name as Python hands it over, and where its base begins
/// ([`crate::control::message::Op::base_at`]): a plain `str` has none; an `OpName` (the
/// `str` subclass ferrovod.torch builds as `<kind>.<base>`) carries it in `base_at`. The name
/// itself is the one carrier, so no entry point can drop its base on the way.
fn op_name(name: &Bound<'_, PyString>) -> PyResult<(String, u32)> {
    let base_at = if name.is_exact_instance_of::<PyString>() {
        0
    } else {
        match name.getattr(pyo3::intern!(name.py(), "base_at")) {
            Ok(at) => at.extract::<u32>()?,
            Err(_) => 0, // another str subclass: a plain name
        }
    };
    Ok((name.to_str()?.to_owned(), base_at))
}

/// Refuses a `base_at` that does not split the op's name into its kind and a base.
fn check_base(op: &OpSpec) -> PyResult<()> {
    if op.base_at_is_valid() {
        return Ok(());
    }
    Err(to_pyerr(Error::InvalidArgument(format!(
        "{} '{}': base_at={} does not split the name into its kind and a base",
        op.kind.name(),
        op.name,
        op.base_at
    ))))
}

/// A reduction code from Python, or an error that names it.
pub(super) fn reduce_op(code: u8) -> PyResult<ReduceOp> {
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

/// A point-to-point message of one tensor, described as [`run`]'s tuples are: sent to global
/// rank `peer` (`sending`) or received from it into the tensor (`None`: from any rank), under
/// `name`, waiting at most `timeout` seconds for the other side (see
/// [`crate::engine::Door::send`]). Its handle completes once the message has been taken (a
/// send) or has arrived (a receive); its result's third element is the peer.
#[pyfunction]
fn transfer(
    sending: bool,
    tensor: PyTensor,
    peer: Option<usize>,
    name: String,
    timeout: f64,
) -> PyResult<CoreHandle> {
    let spec = tensor::spec_from_py(tensor, None)?;
    let timeout = std::time::Duration::try_from_secs_f64(timeout.max(0.0))
        .unwrap_or(std::time::Duration::MAX);
    with_engine(|e| {
        let door = e.door();
        let t = crate::engine::Transfer {
            peer,
            name,
            tensor: spec,
            timeout,
        };
        let handle = if sending { door.send(t) } else { door.recv(t) };
        Ok(CoreHandle {
            handle: handle.map_err(to_pyerr)?,
            progress: door.progress(),
        })
    })
}

/// The completion of one queued op.
#[pyclass(module = "ferrovod._core")]
pub(super) struct CoreHandle {
    handle: Handle,
    progress: Progress,
}

#[pymethods]
impl CoreHandle {
    /// True when the op has completed (its name is then free again). Never blocks.
    fn poll(&self) -> bool {
        self.handle.seen_done()
    }

    /// Waits (GIL released) and returns the op's result as [`run`] with `wait` does.
    fn wait<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let h = self.handle.clone();
        let progress = self.progress.clone();
        match interruptible(py, move |stop| progress.wait_or(&h, stop)) {
            (_, Some(e)) => Err(e),
            (Some(Ok(out)), None) => result(py, out),
            (Some(Err(e)), None) => Err(to_pyerr(e)),
            (None, None) => Err(to_pyerr(Error::InvalidArgument(
                "this handle was already synchronized".into(),
            ))),
        }
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
pub(super) fn array_interface<'py>(
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
