"""The framework-free API: collectives on NumPy arrays and on any CPU object that speaks DLPack.

Every op is submitted to the Rust engine at once and returns an integer handle; the blocking
forms do what ``synchronize(<op>_async(...))`` does, without the handle table. Inputs are passed
zero-copy (their data pointers); the arrays are kept referenced (by the handle table, or by the
blocking call's own frame) until the op completes, which is what makes handing raw pointers to
the engine sound.

Here are the ops' one way into the engine (:func:`_run`), the handle table and the
collectives. ``ferrovod`` and the framework adapters reach the rest of the framework-free API
as ``_api.<name>`` too, so it is imported here from the modules that hold it: starting,
stopping and topology (``_lifecycle``), argument handling (``_arguments``) and what the build
holds (``_build_info``).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _core
from ._arguments import (
    Adasum,
    Average,
    Max,
    Min,
    OpName,
    Product,
    Sum,
    Tensor,
    _BadArgument,
    _DTYPES,
    _as_array,
    _auto_name,
    _contiguous,
    _dtype_code,
    _ptr,
    _resolve_op,
    _root,
    _set_id,
    _writable,
)
from ._build_info import (
    build_info,
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    gpu_libraries,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from ._lifecycle import (
    cross_rank,
    cross_size,
    exit_if_parameter_server,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .exceptions import InvalidArgumentError
from .process_sets import ProcessSet, global_process_set

Handle = int


# ----------------------------------------------------------------------------- plumbing

_lock = threading.Lock()
_handles: Dict[int, "_Pending"] = {}
_next_handle = itertools.count(1)


class _Pending:
    """A submitted op: the engine's handle, what turns its result into the caller's, and the
    objects whose memory the engine reads or writes until it completes (one per op: slots)."""

    __slots__ = ("core", "finish", "keepalive")

    def __init__(self, core: Any, finish: Callable[[Any], Any], keepalive: Any = None) -> None:
        self.core = core
        self.finish = finish
        self.keepalive = keepalive


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
    ``__array_struct__`` alone (non-contiguous, byte-swapped, bfloat16: see :func:`_submit`),
    or for a broadcast whose root is not a rank of the job (the caller refuses it).
    """
    return _core.run(kind, name, _set_id(process_set), tensors, outputs, wait, op, root, prescale,
                     postscale, splits, device, out_bytes)


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
        # One constructor: a third of the time of frombuffer and reshape.
        return np.ndarray(shape, dtype, buf)
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


#: From this size an allreduce that is not in place takes its result in memory the engine
#: gives (its page pool's, reused from op to op: already faulted in, and page-aligned, which
#: TensorFlow needs to take a host op's output without a copy). Smaller results are written
#: into a NumPy array, which is cheaper than viewing an engine buffer.
_ENGINE_OUTPUT_BYTES = 64 << 10


def _new_output(a: np.ndarray) -> Optional[np.ndarray]:
    """The output array of a non-in-place allreduce of ``a``; None: the engine gives it."""
    return None if a.nbytes >= _ENGINE_OUTPUT_BYTES else np.empty_like(a, order="C")


class _AllreduceResult(_PerTensorResult):
    """Columns: the caller's tensor, its array, the contiguous array the engine used, the
    output array (None: the engine's, in the op's result, in tensor order)."""

    __slots__ = ()

    def __call__(self, result: Any) -> Any:
        if self.inplace:
            return super().__call__(result)
        made = iter(result[0])
        if self.single:
            out = self._c3
            return _from_bytes(*next(made), self._c2.dtype) if out is None else out
        return [_from_bytes(*next(made), buf.dtype) if out is None else out
                for buf, out in zip(self._c2, self._c3)]

    def _one(self, tensor: Tensor, orig: np.ndarray, buf: np.ndarray, out: np.ndarray) -> Any:
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
        outputs = inputs if inplace else [_new_output(a) for a in inputs]
        core = _submit(_core.ALLREDUCE, name, process_set, inputs, outputs, rop, 0,
                       prescale_factor, postscale_factor, now=now)
    except _BadArgument as e:
        return _refuse(_core.ALLREDUCE, name, process_set, str(e), now)
    return _Pending(core, _AllreduceResult(tensors, originals, inputs, outputs, inplace, single))


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
    if name is None:
        name = _auto_name("allreduce", None)
    # A plain array of the global set: one waiting call into the engine (see
    # ``_core.allreduce_now``), which declines what it does not take, bad arguments among them.
    if type(tensor) is np.ndarray and process_set is global_process_set \
            and tensor.nbytes < _ENGINE_OUTPUT_BYTES:
        out = np.empty_like(tensor, order="C")
        if _core.allreduce_now(tensor, out, name, op, average, prescale_factor,
                               postscale_factor):
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
    if name is None:
        name = _auto_name("allreduce", None)
    # One waiting call into the engine for a plain array of the global set (see allreduce).
    if process_set is global_process_set and _core.allreduce_now(
            tensor, tensor, name, op, average, prescale_factor, postscale_factor):
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
    allreduce). None: the general path (another kind of tensor or set, an array the
    engine does not read as it lies, or a malformed op, whose error the general path gives)."""
    if type(tensor) is not np.ndarray or process_set is not global_process_set \
            or tensor.ndim == 0:
        return None
    got = _core.run(kind, name, 0, tensor, None, True, op, 0, prescale, postscale)
    if got is None:
        return None
    buf, shape = got[0][0]
    if type(buf) is bytearray:
        return np.ndarray(shape, tensor.dtype, buf)
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
            and root_rank >= 0:
        out = np.empty_like(tensor, order="C")
        # One waiting call into the engine (see allreduce); None (a root outside the job
        # among others): the general path.
        if _core.run(_core.BROADCAST, name, 0, tensor, out, True, Sum,
                     root_rank) is not None:
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
            and root_rank >= 0:
        # One waiting call into the engine (see allreduce); None (a root outside the job
        # among others): the general path.
        if _core.run(_core.BROADCAST, name, 0, tensor, tensor, True, Sum,
                     root_rank) is not None:
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
