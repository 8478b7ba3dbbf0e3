"""The framework-free API: collectives on NumPy arrays and on any CPU object that speaks DLPack.

Every op is submitted to the Rust engine at once and returns an integer handle; the blocking
forms do what ``synchronize(<op>_async(...))`` does, without the handle table. Inputs are passed
zero-copy (their data pointers); the arrays are kept referenced (by the handle table, or by the
blocking call's own frame) until the op completes, which is what makes handing raw pointers to
the engine sound.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import os
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core, _elastic, _logging, _rendezvous
from . import process_sets as _ps
from .exceptions import FerrovodError, InvalidArgumentError
from .process_sets import ProcessSet, global_process_set

Average = _core.Average
Sum = _core.Sum
Adasum = _core.Adasum
Min = _core.Min
Max = _core.Max
Product = _core.Product

_DTYPES: Dict[str, int] = {
    "uint8": _core.DTYPE_UINT8,
    "int8": _core.DTYPE_INT8,
    "int16": _core.DTYPE_INT16,
    "int32": _core.DTYPE_INT32,
    "int64": _core.DTYPE_INT64,
    "float16": _core.DTYPE_FLOAT16,
    "bfloat16": _core.DTYPE_BFLOAT16,
    "float32": _core.DTYPE_FLOAT32,
    "float64": _core.DTYPE_FLOAT64,
    "bool": _core.DTYPE_BOOL,
}

Tensor = Any
Handle = int


# ----------------------------------------------------------------------------- lifecycle

_lock = threading.Lock()
_handles: Dict[int, "_Pending"] = {}
_next_handle = itertools.count(1)
_name_counters: Dict[str, itertools.count] = {}


def init(comm: Optional[Any] = None, process_sets: Optional[Union[str, Sequence[ProcessSet]]] = None) -> None:
    """Starts ferrovod: rendezvous with the other ranks and start the background engine.

    ``process_sets`` is a list of :class:`ProcessSet` registered at start-up (ids 1, 2, ...
    in order; sets given as mpi4py communicators after the rank lists, see
    :class:`ProcessSet`), or ``"dynamic"`` to allow :func:`add_process_set` later. ``comm`` may
    be an mpi4py communicator with as many ranks as ``MPI.COMM_WORLD`` (Horovod's signature):
    under ``mpirun`` without ``FERROVOD_RENDEZVOUS_ADDR`` the ranks then find each other over
    it; or, as in Horovod, the list of ranks the job runs on, which must be every rank in order
    (a job spans every launched process: collectives among some ranks take a process set).
    Calling ``init()`` again while running is a no-op; after :func:`shutdown` it starts a new
    engine.
    """
    exit_if_parameter_server()
    if isinstance(comm, (list, tuple)):
        _check_rank_list(comm)
        comm = None
    if comm is not None and not _rendezvous.is_world_comm(comm):
        raise ValueError("init(comm=...) accepts only an mpi4py communicator spanning every rank "
                         "(as many as MPI.COMM_WORLD): ferrovod does not run on MPI sub-communicators")
    dynamic = process_sets == "dynamic"
    static: List[ProcessSet] = [] if (process_sets is None or dynamic) else list(process_sets)
    for ps in static:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets must hold ProcessSet objects, got {ps!r}")
    if len(set(tuple(p.ranks) for p in static if p.mpi_comm is None)) != \
            len([p for p in static if p.mpi_comm is None]):
        raise ValueError("process_sets contains duplicates")
    if _core.is_initialized():
        return
    given, static = static, _ps._with_communicator_sets(static)
    # An elastic worker first takes its place in the launcher's newest membership.
    generation = _elastic.join_next() if _elastic.enabled() else None
    level, hide_time, my_rank = _core.log_settings()
    _logging.configure(level, hide_time, f"rank {my_rank}")
    info = _core.launch_info()
    addr, secret = _rendezvous.address_and_secret(comm, info)
    try:
        _core.init([p.ranks for p in static], dynamic, addr, secret, generation)
    except FerrovodError as e:
        if generation is None or isinstance(e, InvalidArgumentError):
            raise
        raise _elastic.FormingError(f"forming the elastic job's membership {generation} "
                                    f"failed: {e}") from e
    if generation is not None:
        _elastic.watch_hosts()
    _name_counters.clear()
    _ps._on_init(static, given)
    _share_cores(info["launcher"])


def exit_if_parameter_server() -> None:
    """Ends a process started as an MXNet parameter server or scheduler (``DMLC_ROLE``), saying
    why: the mxnet-operator and MXNet's ``tools/launch.py`` start them beside the workers, and
    ferrovod's workers, averaging with allreduce, need none. Exits with status 0, so that the
    job's server and scheduler replicas succeed."""
    role = os.environ.get("DMLC_ROLE", "").strip().lower()
    if role in ("server", "scheduler"):
        print(f"ferrovod: this process is an MXNet {role} (DMLC_ROLE={role}); ferrovod's workers "
              f"average with allreduce and need no {role}, so it exits now", file=sys.stderr,
              flush=True)
        sys.exit(0)


def _check_rank_list(ranks: Sequence[Any]) -> None:
    """``init(comm=[ranks])``: every launched rank, in order, or a ValueError saying why not."""
    size = int(_core.launch_info()["size"])
    try:
        given = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise ValueError(f"init(comm=...) takes a list of ranks, got {list(ranks)!r}") from None
    if given == list(range(size)):
        return
    if sorted(given) == list(range(size)):
        raise ValueError(f"init(comm={given}): ferrovod keeps the launcher's rank order; pass "
                         f"the ranks in order (list(range({size})))")
    raise ValueError(f"init(comm={given}): a ferrovod job spans every launched process "
                     f"({size} here); for collectives among ranks {sorted(set(given))} use a "
                     f"process set: init(process_sets=[ProcessSet({sorted(set(given))})])")


# Launchers that already give each rank its share of the cores (ferrovodrun's worker_env;
# torchrun sets OMP_NUM_THREADS=1), or start one process only.
_SHARING_LAUNCHERS = ("ferrovodrun", "torchrun", "none")


def _share_cores(launcher: str) -> None:
    """Under mpirun, srun or a TFJob with several ranks per host, sets the thread-pool variables
    the user left unset (OMP_NUM_THREADS and the BLAS ones) to this rank's share of the cores —
    by default every rank's pools would use every core and the ranks would fight over them.
    Libraries loaded from now on, and child processes, see them; a PyTorch already imported
    gets ``torch.set_num_threads`` too."""
    n = local_size()
    if launcher in _SHARING_LAUNCHERS or n <= 1:
        return
    from .runner.worker_env import thread_share

    share = thread_share(os.environ, n)
    if not share:
        return
    os.environ.update(share)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in share:
        torch.set_num_threads(int(share["OMP_NUM_THREADS"]))
    _logging.LOGGER.info("%d ranks on this host: set %s", n, ", ".join(f"{k}={v}" for k, v in share.items()))


def shutdown() -> None:
    """Stops the engine. Pending ops fail; ``init()`` may be called again afterwards."""
    _core.shutdown()
    _ps._on_shutdown()


def is_initialized() -> bool:
    """Whether :func:`init` has run in this process and :func:`shutdown` has not."""
    return bool(_core.is_initialized())


atexit.register(shutdown)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it). Unlike
    Horovod, ``FERROVOD_TIMELINE=DYNAMIC`` is not required first."""
    _core.start_timeline(str(file_path), bool(mark_cycles))


def stop_timeline() -> None:
    """Stops the timeline and closes its file."""
    _core.stop_timeline()


def _topo(i: int) -> Any:
    return _core.topology()[i]


def rank() -> int:
    """Global rank of this process."""
    return int(_topo(0))


def size() -> int:
    """Number of processes in the job."""
    return int(_topo(1))


def local_rank() -> int:
    """Rank of this process among those on its host."""
    return int(_topo(2))


def local_size() -> int:
    """Number of processes on this host."""
    return int(_topo(3))


def cross_rank() -> int:
    """Index of this host among the hosts that have a process with this local rank."""
    return int(_topo(4))


def cross_size() -> int:
    """Number of hosts that have a process with this local rank."""
    return int(_topo(5))


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return bool(_topo(6))


# ----------------------------------------------------------------------------- plumbing


class _Pending:
    """A submitted op: the engine's handle, what turns its result into the caller's, and the
    objects whose memory the engine reads or writes until it completes (one per op: slots)."""

    __slots__ = ("core", "finish", "keepalive")

    def __init__(self, core: Any, finish: Callable[[Any], Any], keepalive: Any = None) -> None:
        self.core = core
        self.finish = finish
        self.keepalive = keepalive


class _BadArgument(InvalidArgumentError):
    """An argument this rank cannot submit an op with. Raised only before anything is
    submitted; the op functions then refuse the op through the engine (:func:`_refuse`), so
    that the other members of the set fail it too instead of waiting for it."""


def _refuse(kind: int, name: str, process_set: ProcessSet, reason: str, now: bool) -> "_Pending":
    """This rank's part in an op it refuses: the engine negotiates the name as a rejection,
    and every member of the set fails the op with ``reason``. A blocking caller (``now``)
    waits for that and raises the error every rank gets; an async one raises at once, as
    Horovod does at submission (the others still learn of it through the engine)."""
    core = _core.reject(kind, name, _set_id(process_set), reason)
    if not now:
        raise InvalidArgumentError(f"{reason} (rank {rank()} refused this op; every rank of the "
                                   "set fails it)")
    return _Pending(core, lambda _: None)


def _as_array(tensor: Tensor) -> np.ndarray:
    """A NumPy view of ``tensor`` (zero-copy for arrays and CPU DLPack objects)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if tensor is None:
        raise _BadArgument("expected an array or a tensor, got None")
    if hasattr(tensor, "__dlpack__"):
        try:
            return np.from_dlpack(tensor)
        except (TypeError, RuntimeError, BufferError) as e:
            raise _BadArgument(
                f"cannot read a {type(tensor).__name__} through DLPack ({e}); pass a CPU tensor "
                "or a NumPy array"
            ) from e
    arr = np.asarray(tensor)
    if arr.dtype == object:
        raise _BadArgument(f"expected an array or a tensor, got {type(tensor).__name__}")
    return arr


def _writable(tensor: Tensor, arr: np.ndarray, what: str) -> None:
    """Refuses an in-place op on memory it cannot write back into: a read-only array, or an
    object (a list, bytes) that ``arr`` is a copy of."""
    if not (isinstance(tensor, np.ndarray) or hasattr(tensor, "__dlpack__")):
        raise _BadArgument(
            f"{what} writes its result into its input, which must be an array or a tensor; "
            f"got a {type(tensor).__name__} (use the out-of-place {what.rstrip('_')})")
    if not arr.flags.writeable:
        raise _BadArgument(f"{what} writes its result into its input, which is read-only")


def _root(root_rank: Any) -> int:
    """``root_rank`` as a global rank of this job, or refused."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise _BadArgument(f"root_rank must be an integer rank, got {root_rank!r} "
                           f"({type(root_rank).__name__})")
    if not 0 <= int(root_rank) < size():
        raise _BadArgument(
            f"broadcast received invalid root rank {int(root_rank)}: the job has {size()} ranks")
    return int(root_rank)


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when the engine can read it as it lies (C-contiguous, native byte order),
    else a copy that is (the engine reduces raw bytes: a byte-swapped array would be summed as
    garbage)."""
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.flags.c_contiguous:
        return arr
    # np.ascontiguousarray turns a 0-d array into shape (1,): keep 0-d tensors 0-d.
    return np.ascontiguousarray(arr).reshape(arr.shape)


# Keyed by the dtype object: ``dtype.name`` builds a string per call (several µs, a tenth of
# a small allreduce).
_DTYPE_CODES: Dict[np.dtype, int] = {}


def _dtype_code(arr: np.ndarray, what: str) -> int:
    code = _DTYPE_CODES.get(arr.dtype)
    if code is not None:
        return code
    code = _DTYPES.get(arr.dtype.name)
    if code is None:
        raise _BadArgument(
            f"{what}: dtype {arr.dtype} is not supported (supported: {', '.join(_DTYPES)})"
        )
    _DTYPE_CODES[arr.dtype] = code
    return code


def _ptr(arr: np.ndarray) -> int:
    # __array_struct__ through the engine: ~0.2 µs against 3-4 µs for __array_interface__.
    address = _core.array_address(arr)
    if address is None:
        address = arr.__array_interface__["data"][0]
    return int(address)


def _auto_name(kind: str, name: Optional[str]) -> str:
    if name is not None:
        return str(name)
    counter = _name_counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _set_id(process_set: ProcessSet) -> int:
    if process_set.process_set_id is None:
        raise InvalidArgumentError(
            f"{process_set} has not been registered (pass it to init(process_sets=...) or "
            "add_process_set)"
        )
    if process_set.process_set_id != 0 and rank() not in process_set.ranks:
        raise InvalidArgumentError(
            f"rank {rank()} is not a member of the provided process set {process_set.ranks}"
        )
    return int(process_set.process_set_id)


_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}


def _resolve_op(op: Optional[int], average: Optional[bool], default: int = Average) -> int:
    """The reduction's code, or refused (a float, a string or an unknown code is not one)."""
    if op is not None and average is not None:
        raise _BadArgument("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if isinstance(op, bool) or not isinstance(op, (int, np.integer)) or int(op) not in _OP_NAMES:
        raise _BadArgument(f"op={op!r} is not a reduction: use Sum, Average, Min, Max or Product "
                           "(ferrovod.Sum, ...)")
    return int(op)


def _register(core: Any, finish: Callable[[Any], Any], keepalive: Any = None) -> Handle:
    return _start(_Pending(core, finish, keepalive))


def _start(p: _Pending) -> Handle:
    """Puts a submitted op in the handle table (``synchronize``/``poll`` find it there)."""
    h = next(_next_handle)
    with _lock:
        _handles[h] = p
    return h


def _outcome(core: Any) -> Any:
    """What an op's ``core`` (from :func:`_run`) hands back: the result a waiting call got at
    once (a tuple), or its handle's, waited for."""
    return core if type(core) is tuple else core.wait()


def _now(p: _Pending) -> Any:
    """Waits for a submitted op no one else can see: the blocking calls skip the handle table,
    whose registering, wrapping and looking up again were a third of a small op's Python time.
    The locals of the caller keep the memory alive meanwhile."""
    return p.finish(_outcome(p.core))


def _single(h: Handle) -> Handle:
    """:func:`_one` for a registered handle (the torch adapter registers its ops)."""
    with _lock:
        _one(_handles[h])
    return h


def _one(p: _Pending) -> _Pending:
    """Makes a one-tensor op return the tensor rather than a one-element list."""
    inner = p.finish
    p.finish = lambda r: inner(r)[0]
    return p


def _run(
    kind: int,
    name: str,
    process_set: ProcessSet,
    tensors: Sequence[Any],
    outputs: Optional[Sequence[Optional[np.ndarray]]] = None,
    op: int = Sum,
    root: int = 0,
    prescale: float = 1.0,
    postscale: float = 1.0,
    splits: Sequence[int] = (),
    device: Optional[Tuple[int, int]] = None,
    out_bytes: Optional[Sequence[int]] = None,
    wait: bool = False,
) -> Any:
    """The one way into the engine for an op: NumPy's, torch's, TensorFlow's and every later
    adapter's op is submitted here (``ferrovod._core.run``, which hands it to the engine's own
    entry, where the way it takes is decided).

    ``tensors``: NumPy arrays (``outputs[i]``: the array a result goes to, which may be the
    input itself, or ``None`` for a result the engine allocates), or raw ``(data_ptr, nbytes,
    dtype_code, shape, out_ptr or 0)`` tuples for memory NumPy cannot describe (torch
    bfloat16, CUDA tensors; ``out_bytes``: each output's size where it is not the input's). The
    caller guarantees every address is C-contiguous memory of that size owned by an object it
    keeps referenced until the op completes (the handle table does, or a blocking call's frame).
    ``device``: ``(CUDA ordinal, raw current stream)`` when the tuples address CUDA memory.
    ``wait``: the caller waits at once, so a small op may take the engine's fast path; the op's
    result, ``(outputs, received_splits, last_joined)``, is then returned instead of a handle.

    Returns ``None``, having submitted nothing, when an array is not one the engine reads from
    ``__array_struct__`` alone (non-contiguous, byte-swapped, bfloat16): see :func:`_submit`.
    """
    return _core.run(kind, name, _set_id(process_set), tensors, outputs, op, root, prescale,
                     postscale, splits, device, out_bytes, wait)


def _submit(
    kind: int,
    name: str,
    process_set: ProcessSet,
    inputs: Sequence[np.ndarray],
    outputs: Sequence[Optional[np.ndarray]],
    op: int = Sum,
    root: int = 0,
    prescale: float = 1.0,
    postscale: float = 1.0,
    splits: Sequence[int] = (),
    now: bool = False,
) -> Any:
    """:func:`_run` for C-contiguous NumPy arrays in native byte order; ``now``: the caller
    waits at once. Arrays the engine cannot read from ``__array_struct__`` alone (bfloat16)
    go again as raw tuples."""
    op, root, prescale, postscale = int(op), int(root), float(prescale), float(postscale)
    splits = [int(s) for s in splits]
    core = _run(kind, name, process_set, inputs, outputs, op, root, prescale, postscale, splits,
                wait=now)
    if core is not None:
        return core
    tensors = []
    for arr, out in zip(inputs, outputs):
        code = _dtype_code(arr, name)
        tensors.append((_ptr(arr), arr.nbytes, code, list(arr.shape), 0 if out is None else _ptr(out)))
    return _run(kind, name, process_set, tensors, None, op, root, prescale, postscale, splits,
                wait=now)


def _from_bytes(buf: Any, shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """A result the engine allocated as an array: a small one comes as a ``bytearray``, a large
    one as an engine-owned buffer exposing ``__array_interface__``; both viewed, not copied."""
    if type(buf) is bytearray:
        return np.frombuffer(buf, dtype=dtype).reshape(shape)
    return np.asarray(buf).view(dtype).reshape(tuple(shape))


def poll(handle: Handle) -> bool:
    """True when the op behind ``handle`` has completed. Never blocks."""
    with _lock:
        p = _handles.get(handle)
    if p is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    return type(p.core) is tuple or bool(p.core.poll())


def synchronize(handle: Handle) -> Any:
    """Waits for the op behind ``handle`` (with the GIL released) and returns its result."""
    with _lock:
        p = _handles.get(handle)
    if p is None:
        raise ValueError(f"unknown or already synchronized handle {handle}")
    try:
        result = _outcome(p.core)
    finally:
        with _lock:
            _handles.pop(handle, None)
    return p.finish(result)


# ----------------------------------------------------------------------------- allreduce


class _PerTensorResult:
    """What an op over a list of tensors hands back (its ``finish``): per tensor, what
    :meth:`_one` makes of that tensor's four columns (a one-tensor op returns it alone), and,
    until then, every object whose memory the engine uses. One object per op: a pending op's
    objects outlive the garbage collector's young generations (they wait through a backward
    pass), and their promotion to the oldest one is what triggers its full collections, 95 ms
    each with torch loaded. With closures, their cells and keepalive lists, 16 tracked objects
    per op made one every dozen steps of a 500-tensor model (two-thirds of the Python time per
    op)."""

    __slots__ = ("_c0", "_c1", "_c2", "_c3", "inplace", "single")

    def __init__(self, c0: Sequence[Any], c1: Sequence[Any], c2: Sequence[Any],
                 c3: Sequence[Any], inplace: bool, single: bool) -> None:
        # A one-tensor op keeps its objects themselves: no list to track.
        self._c0: Any = c0[0] if single else c0
        self._c1: Any = c1[0] if single else c1
        self._c2: Any = c2[0] if single else c2
        self._c3: Any = c3[0] if single else c3
        self.inplace = inplace
        self.single = single

    def __call__(self, _: Any) -> Any:
        if self.single:
            return self._one(self._c0, self._c1, self._c2, self._c3)
        return [self._one(*row) for row in zip(self._c0, self._c1, self._c2, self._c3)]

    def _one(self, c0: Any, c1: Any, c2: Any, c3: Any) -> Any:
        raise NotImplementedError


class _AllreduceResult(_PerTensorResult):
    """Columns: the caller's tensor, its array, the contiguous array the engine used, the
    output array."""

    __slots__ = ()

    def _one(self, tensor: Tensor, orig: np.ndarray, buf: np.ndarray, out: np.ndarray) -> Any:
        if not self.inplace:
            return out
        if buf is not orig:
            orig[...] = buf
        return tensor


def _allreduce(
    tensors: Sequence[Tensor], inplace: bool, average: Optional[bool], name: Optional[str],
    op: Optional[int], prescale_factor: float, postscale_factor: float,
    process_set: ProcessSet, kind_name: str, single: bool = False, now: bool = False,
) -> _Pending:
    """``now``: the caller waits at once (see ``_submit``)."""
    name = _auto_name(kind_name, name)
    try:
        rop = _resolve_op(op, average)
        originals = [_as_array(t) for t in tensors]
        if inplace:
            for t, a in zip(tensors, originals):
                _writable(t, a, kind_name + "_")
        inputs = [_contiguous(a) for a in originals]
        if inplace:
            outputs = inputs
        else:
            outputs = [np.empty_like(a, order="C") for a in inputs]
        core = _submit(_core.ALLREDUCE, name, process_set, inputs, outputs, rop, 0,
                       prescale_factor, postscale_factor, now=now)
    except _BadArgument as e:
        return _refuse(_core.ALLREDUCE, name, process_set, str(e), now)
    return _Pending(core, _AllreduceResult(tensors, originals, inputs, outputs, inplace, single))


def _allreduce_now(tensor: np.ndarray, out: np.ndarray, name: str, op: Optional[int],
                   average: Optional[bool], prescale: float, postscale: float) -> bool:
    """The blocking one-array allreduce as one waiting call into the engine (which may take its
    fast path): no handle, result holder or pending op. False, having done nothing, for what
    it does not take (non-contiguous, byte-swapped or bfloat16 arrays, Adasum): the general
    path then runs, under the same name."""
    try:
        rop = _resolve_op(op, average)
    except _BadArgument:
        return False
    if rop == Adasum:
        return False
    return _run(_core.ALLREDUCE, name, global_process_set, (tensor,), (out,), rop, 0,
                float(prescale), float(postscale), wait=True) is not None


def allreduce_async(tensor: Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allreduce of ``tensor`` into a new array; returns a handle."""
    return _start(_allreduce([tensor], False, average, name, op, prescale_factor,
                             postscale_factor, process_set, "allreduce", single=True))


def allreduce(tensor: Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduces ``tensor`` across ranks (default: Average) and returns the result."""
    name = _auto_name("allreduce", name)
    if type(tensor) is np.ndarray and process_set is global_process_set:
        out = np.empty_like(tensor, order="C")
        if _allreduce_now(tensor, out, name, op, average, prescale_factor, postscale_factor):
            return out
    return _now(_allreduce([tensor], False, average, name, op, prescale_factor,
                           postscale_factor, process_set, "allreduce", single=True, now=True))


def allreduce_async_(tensor: Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place allreduce of ``tensor``; returns a handle."""
    return _start(_allreduce([tensor], True, average, name, op, prescale_factor,
                             postscale_factor, process_set, "allreduce", single=True))


def allreduce_(tensor: Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> Tensor:
    """Reduces ``tensor`` across ranks in place and returns it."""
    name = _auto_name("allreduce", name)
    if type(tensor) is np.ndarray and process_set is global_process_set:
        if _allreduce_now(tensor, tensor, name, op, average, prescale_factor, postscale_factor):
            return tensor
    return _now(_allreduce([tensor], True, average, name, op, prescale_factor,
                           postscale_factor, process_set, "allreduce", single=True, now=True))



def grouped_allreduce_async(tensors: Sequence[Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allreduce of a list of tensors negotiated and fused as one unit."""
    return _start(_allreduce(list(tensors), False, average, name, op, prescale_factor,
                             postscale_factor, process_set, "grouped_allreduce"))


def grouped_allreduce(tensors: Sequence[Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """Reduces a list of tensors as one unit; returns the list of results."""
    return _now(_allreduce(list(tensors), False, average, name, op, prescale_factor,
                           postscale_factor, process_set, "grouped_allreduce", now=True))


def grouped_allreduce_async_(tensors: Sequence[Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place form of :func:`grouped_allreduce_async`."""
    return _start(_allreduce(list(tensors), True, average, name, op, prescale_factor,
                             postscale_factor, process_set, "grouped_allreduce"))


def grouped_allreduce_(tensors: Sequence[Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[Tensor]:
    """Reduces a list of tensors in place as one unit; returns them."""
    return _now(_allreduce(list(tensors), True, average, name, op, prescale_factor,
                           postscale_factor, process_set, "grouped_allreduce", now=True))


# ----------------------------------------------------------------------------- allgather


def _gather(tensors: Sequence[Tensor], name: Optional[str], process_set: ProcessSet,
            kind_name: str, now: bool = False) -> _Pending:
    """``now``: the caller waits at once (see ``_submit``)."""
    name = _auto_name(kind_name, name)
    try:
        inputs = [_contiguous(_as_array(t)) for t in tensors]
        for a in inputs:
            if a.ndim == 0:
                raise _BadArgument(
                    f"{kind_name}: a 0-d (scalar) tensor cannot be gathered; reshape it to (1,)")
        core = _submit(_core.ALLGATHER, name, process_set, inputs, [None] * len(inputs), now=now)
    except _BadArgument as e:
        return _refuse(_core.ALLGATHER, name, process_set, str(e), now)
    dtypes = [a.dtype for a in inputs]

    def finish(result: Any) -> List[np.ndarray]:
        outs, _, _ = result
        return [_from_bytes(b, s, d) for (b, s), d in zip(outs, dtypes)]

    return _Pending(core, finish, [tensors, inputs])


def _one_call(kind: int, tensor: Tensor, name: str, process_set: ProcessSet, op: int = Sum,
              prescale: float = 1.0, postscale: float = 1.0) -> Optional[np.ndarray]:
    """A blocking op with a new result (allgather, reducescatter, evenly split alltoall) of
    one plain array in the global set, as one waiting call into the engine (see
    _allreduce_now). None: the general path (another kind of tensor or set, an array the
    engine does not read as it lies, or a malformed op, whose error the general path gives)."""
    if type(tensor) is not np.ndarray or process_set is not global_process_set \
            or tensor.ndim == 0:
        return None
    got = _run(kind, name, global_process_set, (tensor,), None, op, 0, prescale, postscale,
               wait=True)
    if got is None:
        return None
    buf, shape = got[0][0]
    return _from_bytes(buf, shape, tensor.dtype)


def allgather_async(tensor: Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather (concatenation along dim 0 in rank order)."""
    return _start(_one(_gather([tensor], name, process_set, "allgather")))


def allgather(tensor: Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenates every rank's ``tensor`` along dim 0 (dim 0 may differ per rank)."""
    name = _auto_name("allgather", name)
    got = _one_call(_core.ALLGATHER, tensor, name, process_set)
    if got is not None:
        return got
    return _now(_one(_gather([tensor], name, process_set, "allgather", now=True)))


def grouped_allgather_async(tensors: Sequence[Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather of a list of tensors negotiated as one unit."""
    return _start(_gather(list(tensors), name, process_set, "grouped_allgather"))


def grouped_allgather(tensors: Sequence[Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[np.ndarray]:
    """Allgathers a list of tensors as one unit."""
    return _now(_gather(list(tensors), name, process_set, "grouped_allgather", now=True))


# ----------------------------------------------------------------------------- broadcast


def _broadcast(tensor: Tensor, root_rank: int, name: Optional[str],
               process_set: ProcessSet, inplace: bool, now: bool = False) -> _Pending:
    """``now``: the caller waits at once (see ``_submit``)."""
    name = _auto_name("broadcast", name)
    try:
        root = _root(root_rank)
        original = _as_array(tensor)
        if inplace:
            _writable(tensor, original, "broadcast_")
        buf = _contiguous(original)
        out = buf if inplace else np.empty_like(buf, order="C")
        core = _submit(_core.BROADCAST, name, process_set, [buf], [out], root=root, now=now)
    except _BadArgument as e:
        return _refuse(_core.BROADCAST, name, process_set, str(e), now)

    def finish(_: Any) -> Any:
        if inplace:
            if buf is not original:
                original[...] = buf
            return tensor
        return out

    return _Pending(core, finish, [tensor, original, buf, out])


def broadcast_async(tensor: Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts a broadcast from global rank ``root_rank`` into a new array."""
    return _start(_broadcast(tensor, root_rank, name, process_set, False))


def broadcast(tensor: Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Returns ``root_rank``'s tensor on every rank (``root_rank`` is a global rank)."""
    name = _auto_name("broadcast", name)
    if type(tensor) is np.ndarray and process_set is global_process_set and type(root_rank) is int \
            and 0 <= root_rank < _core.topology()[1]:
        out = np.empty_like(tensor, order="C")
        # One waiting call into the engine (see _allreduce_now); None: the general path.
        if _run(_core.BROADCAST, name, global_process_set, (tensor,), (out,), Sum, root_rank,
                wait=True) is not None:
            return out
    return _now(_broadcast(tensor, root_rank, name, process_set, False, now=True))


def broadcast_async_(tensor: Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place broadcast."""
    return _start(_broadcast(tensor, root_rank, name, process_set, True))


def broadcast_(tensor: Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> Tensor:
    """Overwrites ``tensor`` with ``root_rank``'s on every rank and returns it."""
    name = _auto_name("broadcast", name)
    if type(tensor) is np.ndarray and process_set is global_process_set and type(root_rank) is int \
            and 0 <= root_rank < _core.topology()[1]:
        # One waiting call into the engine (see _allreduce_now); None: the general path.
        if _run(_core.BROADCAST, name, global_process_set, (tensor,), (tensor,), Sum, root_rank,
                wait=True) is not None:
            return tensor
    return _now(_broadcast(tensor, root_rank, name, process_set, True, now=True))


# ----------------------------------------------------------------------------- alltoall


def alltoall_async(tensor: Tensor, splits: Optional[Sequence[int]] = None,
                   name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an alltoall: ``splits[i]`` rows of dim 0 go to set rank i (default: equal)."""
    return _start(_alltoall(tensor, splits, name, process_set))


def _alltoall(tensor: Tensor, splits: Optional[Sequence[int]], name: Optional[str],
              process_set: ProcessSet, now: bool = False) -> _Pending:
    """``now``: the caller waits at once (see ``_submit``)."""
    name = _auto_name("alltoall", name)
    try:
        arr = _contiguous(_as_array(tensor))
        if arr.ndim == 0:
            raise _BadArgument("alltoall: a 0-d (scalar) tensor has no first dimension")
        split_list: List[int] = []
        if splits is not None:
            raw = np.asarray(_as_array(splits)).reshape(-1)
            if raw.dtype.kind not in "iu":
                raise _BadArgument(f"alltoall: splits must be integers, got {raw.tolist()}")
            split_list = [int(s) for s in raw]
            if any(s < 0 for s in split_list):
                raise _BadArgument(f"alltoall: splits must be non-negative, got {split_list}")
        core = _submit(_core.ALLTOALL, name, process_set, [arr], [None], splits=split_list,
                       now=now)
    except _BadArgument as e:
        return _refuse(_core.ALLTOALL, name, process_set, str(e), now)
    want_splits = splits is not None

    def finish(result: Any) -> Any:
        outs, received, _ = result
        out = _from_bytes(outs[0][0], outs[0][1], arr.dtype)
        if want_splits:
            return out, np.asarray(received, dtype=np.int32)
        return out

    return _Pending(core, finish, [tensor, arr])


def alltoall(tensor: Tensor, splits: Optional[Sequence[int]] = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Scatters dim-0 slices to every rank and gathers theirs. Returns the output, or
    ``(output, received_splits)`` when ``splits`` is given."""
    name = _auto_name("alltoall", name)
    if splits is None:
        got = _one_call(_core.ALLTOALL, tensor, name, process_set)
        if got is not None:
            return got
    return _now(_alltoall(tensor, splits, name, process_set, now=True))


# ----------------------------------------------------------------------------- reducescatter


def _reducescatter(tensors: Sequence[Tensor], name: Optional[str], op: int,
                   process_set: ProcessSet, prescale_factor: float,
                   postscale_factor: float, kind_name: str, now: bool = False) -> _Pending:
    """``now``: the caller waits at once (see ``_submit``)."""
    name = _auto_name(kind_name, name)
    try:
        rop = _resolve_op(op, None)
        if rop not in (Sum, Average):
            raise _BadArgument("Reducescatter currently only supports AVERAGE and SUM.")
        inputs = [_contiguous(_as_array(t)) for t in tensors]
        core = _submit(_core.REDUCESCATTER, name, process_set, inputs, [None] * len(inputs),
                       rop, 0, prescale_factor, postscale_factor, now=now)
    except _BadArgument as e:
        return _refuse(_core.REDUCESCATTER, name, process_set, str(e), now)
    dtypes = [a.dtype for a in inputs]

    def finish(result: Any) -> List[np.ndarray]:
        outs, _, _ = result
        return [_from_bytes(b, s, d) for (b, s), d in zip(outs, dtypes)]

    return _Pending(core, finish, [tensors, inputs])


def reducescatter_async(tensor: Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Starts a reducescatter (Sum or Average)."""
    return _start(_one(_reducescatter([tensor], name, op, process_set, prescale_factor,
                                      postscale_factor, "reducescatter")))


def reducescatter(tensor: Tensor, name: Optional[str] = None, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduces across ranks and returns this rank's rows of dim 0 (the lowest ranks get one
    extra row when dim 0 does not divide evenly)."""
    name = _auto_name("reducescatter", name)
    if type(op) is int and op in (Sum, Average):
        got = _one_call(_core.REDUCESCATTER, tensor, name, process_set, op, prescale_factor,
                        postscale_factor)
        if got is not None:
            return got
    return _now(_one(_reducescatter([tensor], name, op, process_set, prescale_factor,
                                    postscale_factor, "reducescatter", now=True)))


def grouped_reducescatter_async(tensors: Sequence[Tensor], name: Optional[str] = None,
                                op: int = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Starts a reducescatter of a list of tensors negotiated as one unit."""
    return _start(_reducescatter(list(tensors), name, op, process_set, prescale_factor,
                                 postscale_factor, "grouped_reducescatter"))


def grouped_reducescatter(tensors: Sequence[Tensor], name: Optional[str] = None,
                          op: int = Average, process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[np.ndarray]:
    """Reducescatters a list of tensors as one unit."""
    return _now(_reducescatter(list(tensors), name, op, process_set, prescale_factor,
                               postscale_factor, "grouped_reducescatter", now=True))


# ----------------------------------------------------------------------------- barrier, join


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of ``process_set`` has called it."""
    core = _submit(_core.BARRIER, _auto_name("barrier", None), process_set, [], [])
    _now(_Pending(core, lambda _: None))


def join(device: int = -1) -> int:
    """Declares this rank out of data. Until every rank has joined, this rank's engine takes
    part in the others' allreduces with zeros. Returns the last rank to join."""
    del device  # CPU only: zeros are made by the engine
    core = _core.join()
    return int(_now(_Pending(core, lambda r: int(r[2]))))


# ----------------------------------------------------------------------------- objects


def _pickled(obj: Any) -> Tuple[int, bytes]:
    """``(0, cloudpickle bytes)``, or ``(1, why it failed)``: a rank whose object does not
    pickle still takes part in the exchange, so that every rank raises instead of waiting."""
    import cloudpickle

    try:
        return 0, cloudpickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - any pickling failure is reported on every rank
        return 1, f"{type(e).__name__}: {e}".encode()


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Sends a picklable object from ``root_rank`` to every rank (cloudpickle). An object the
    root cannot pickle raises on every rank, naming the root and the reason."""
    import cloudpickle

    name = _auto_name("broadcast_object", name)
    header = np.zeros(2, dtype=np.int64)
    payload = b""
    if rank() == root_rank:
        status, payload = _pickled(obj)
        header[:] = (status, len(payload))
    broadcast_(header, root_rank, name=f"{name}.size", process_set=process_set)
    buf = (np.frombuffer(payload, dtype=np.uint8).copy() if rank() == root_rank
           else np.zeros(int(header[1]), dtype=np.uint8))
    broadcast_(buf, root_rank, name=f"{name}.data", process_set=process_set)
    if header[0] != 0:
        raise InvalidArgumentError(f"broadcast_object '{name}': rank {root_rank} could not "
                                   f"pickle its object: {buf.tobytes().decode(errors='replace')}")
    if rank() == root_rank:
        return obj
    return cloudpickle.loads(buf.tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Gathers a picklable object from every rank; returns them in rank order. An object some
    rank cannot pickle raises on every rank, naming those ranks and the reasons."""
    import cloudpickle

    name = _auto_name("allgather_object", name)
    status, payload = _pickled(obj)
    headers = allgather(np.array([[status, len(payload)]], dtype=np.int64),
                        name=f"{name}.sizes", process_set=process_set)
    data = allgather(np.frombuffer(payload, dtype=np.uint8), name=f"{name}.data",
                     process_set=process_set)
    chunks, off = [], 0
    for n in headers[:, 1].tolist():
        chunks.append(data[off:off + n].tobytes())
        off += n
    members = process_set.ranks
    failed = [f"rank {members[i]}: {c.decode(errors='replace')}"
              for i, (st, c) in enumerate(zip(headers[:, 0].tolist(), chunks)) if st != 0]
    if failed:
        raise InvalidArgumentError(f"allgather_object '{name}': some ranks could not pickle "
                                   f"their objects: {'; '.join(failed)}")
    return [cloudpickle.loads(c) for c in chunks]


# ----------------------------------------------------------------------------- queries


def _nccl_wheel_dirs() -> List[str]:
    """``lib`` directories of the ``nvidia-nccl-*`` wheel (torch's CUDA builds install it),
    found without importing torch."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [os.path.join(r, "lib") for r in roots if os.path.isdir(os.path.join(r, "lib"))]


_gpu_libraries: Optional[Dict[str, Any]] = None


def gpu_libraries() -> Dict[str, Any]:
    """What the run-time search for GPU libraries found (done once per process, never raises):
    ``{"nccl": {"found", "version", "path" | "reason"}, "cuda": {"found", "devices" |
    "reason"}}``. Nothing is linked at build time; ``FERROVOD_NCCL_LIBRARY`` names the NCCL
    library to use."""
    global _gpu_libraries
    if _gpu_libraries is None:
        probe = dict(_core.gpu_probe(_nccl_wheel_dirs()))
        _gpu_libraries = {k: dict(v) for k, v in probe.items()}
    return {k: dict(v) for k, v in _gpu_libraries.items()}


def build_info() -> Dict[str, Any]:
    """What this build contains: version, transports, controllers and backends, and (as
    ``nccl_library`` and ``cuda_driver``) what the run-time search for GPU libraries found."""
    info = dict(_core.build_info())
    gpu = gpu_libraries()
    info["nccl_library"] = gpu["nccl"]
    info["cuda_driver"] = gpu["cuda"]
    return info


def gloo_built() -> bool:
    """True: ferrovod's own controller and data plane take the place Gloo has in Horovod (a
    job that needs no MPI), which is what a script asking this wants to know; no Gloo library
    is involved."""
    return True


def gloo_enabled() -> bool:
    """Whether the job is formed (ferrovod's controller, in Gloo's place: see
    :func:`gloo_built`)."""
    return bool(_core.is_initialized())


def mpi_built() -> bool:
    """False: ferrovod does not link MPI."""
    return False


def mpi_enabled() -> bool:
    """False: ferrovod does not link MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: ferrovod does not link MPI."""
    return False


def nccl_built() -> int:
    """As in Horovod, the NCCL version code (e.g. 23007) collectives of GPU tensors run on, 0 when
    none. ferrovod's NCCL backend is in every build and loads NCCL at run time, so this is the
    code of the library ``gpu_libraries()`` found — when the engine dispatches CUDA tensors to
    NCCL (``build_info()["device_dispatch"]``, on unless ``FERROVOD_NCCL_DISPATCH=0``);
    otherwise 0: they are staged through host memory."""
    if not _core.build_info().get("device_dispatch"):
        return 0
    nccl = gpu_libraries()["nccl"]
    return int(nccl.get("code", 0)) if nccl.get("found") else 0


def cuda_built() -> bool:
    """Whether CUDA support is built in."""
    return False


def rocm_built() -> bool:
    """Whether ROCm support is built in."""
    return False


def ddl_built() -> bool:
    """Whether IBM DDL support is built in."""
    return False


def ccl_built() -> bool:
    """Whether oneCCL support is built in."""
    return False

