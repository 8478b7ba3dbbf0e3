"""Collectives on MXNet NDArrays (Horovod's ``horovod.mxnet.mpi_ops``), over ferrovod's one way
into the engine (``ferrovod._api``).

A CPU NDArray is read where it lies (its data pointer, once MXNet's pending writes to it are
done) and results come back as new NDArrays on the input's context that take over the engine's
result memory, or, for the in-place forms, are written into the input by an MXNet assignment,
which MXNet's engine orders after the work already queued on that array. A GPU NDArray is copied to host memory and back, with a one-time
warning. ``priority`` is accepted and ignored: the engine orders ops by their negotiation.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, List, Optional, Sequence, Tuple, Union

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, check_call

from .. import _api
from .._api import (  # Horovod's names, re-exported
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ..common.basics import HorovodBasics
from ..process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "ccl_built", "cross_rank", "cross_size",
    "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init", "is_homogeneous",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size",
    "start_timeline", "stop_timeline", "ProcessSet", "add_process_set", "global_process_set",
    "remove_process_set", "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "barrier", "join",
]

# Horovod's per-framework basics object (see ferrovod.common.basics).
_basics = HorovodBasics()

NDArray = mx.nd.NDArray

_warned_gpu = False


def _check(tensor: Any, what: str) -> NDArray:
    if not isinstance(tensor, NDArray):
        raise ValueError(f"{what}: expected an mxnet.nd.NDArray, got {type(tensor).__name__}")
    if getattr(tensor, "stype", "default") != "default":
        raise ValueError(f"{what}: sparse NDArrays ({tensor.stype}) are not supported; "
                         f"convert with .tostype('default')")
    return tensor


def _host(tensor: NDArray, what: str) -> np.ndarray:
    """The NDArray's values as a NumPy array: a view of a CPU NDArray's memory (after the
    writes MXNet has queued for it), a copy of a GPU one."""
    global _warned_gpu
    t = _check(tensor, what)
    if t.context.device_type != "cpu":
        if not _warned_gpu:
            _warned_gpu = True
            warnings.warn(f"ferrovod: {t.context} NDArrays are copied to host memory for "
                          f"collectives and back; expect host-memory speed", RuntimeWarning,
                          stacklevel=3)
        return t.asnumpy()
    t.wait_to_read()
    nbytes = t.size * np.dtype(t.dtype).itemsize
    if nbytes == 0:
        return np.empty(t.shape, dtype=t.dtype)
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(t.handle, ctypes.byref(ptr)))
    buf = (ctypes.c_char * nbytes).from_address(ptr.value)
    # `buf` keeps no reference to `t`: the caller holds `t` until the op returns.
    return np.frombuffer(buf, dtype=t.dtype).reshape(t.shape)


# What mx.nd.from_numpy cannot take without a copy (its DLPack conversion refuses them).
_COPIED = (np.dtype(np.int8),)


def _nd(values: np.ndarray, like: NDArray) -> NDArray:
    """A new NDArray on ``like``'s context holding ``values`` in ``like``'s dtype. On the CPU it
    takes over the result's memory, which the engine allocated for this op alone (MXNet keeps
    the array alive), instead of copying it."""
    if (like.context.device_type == "cpu" and values.dtype == like.dtype and values.ndim
            and values.size and values.flags.c_contiguous and values.dtype not in _COPIED):
        return mx.nd.from_numpy(values, zero_copy=True)
    return mx.nd.array(values, ctx=like.context, dtype=like.dtype)


def _into(tensor: NDArray, values: np.ndarray) -> NDArray:
    tensor[:] = values
    return tensor


def _allreduce(tensor: NDArray, what: str, average: Optional[bool], name: Optional[str],
               prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
               op: Optional[int]) -> np.ndarray:
    return _api.allreduce(_host(tensor, what), average=average, name=name, op=op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                          process_set=process_set)


def allreduce(tensor: NDArray, average: Optional[bool] = None, name: Optional[str] = None,
              priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> NDArray:
    """Reduces ``tensor`` across the set (default: Average) into a new NDArray; ``tensor`` is
    not modified."""
    del priority
    return _nd(_allreduce(tensor, "allreduce", average, name, prescale_factor,
                          postscale_factor, process_set, op), tensor)


def allreduce_(tensor: NDArray, average: Optional[bool] = None, name: Optional[str] = None,
               priority: int = 0, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, op: Optional[int] = None) -> NDArray:
    """:func:`allreduce` in place: ``tensor`` holds the result and is returned."""
    del priority
    return _into(tensor, _allreduce(tensor, "allreduce_", average, name, prescale_factor,
                                    postscale_factor, process_set, op))


def _grouped_allreduce(tensors: List[NDArray], what: str, average: Optional[bool],
                       name: Optional[str], prescale_factor: float, postscale_factor: float,
                       process_set: ProcessSet, op: Optional[int]) -> List[np.ndarray]:
    return _api.grouped_allreduce([_host(t, what) for t in tensors], average=average, name=name,
                                  op=op, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor, process_set=process_set)


def grouped_allreduce(tensors: Sequence[NDArray], average: Optional[bool] = None,
                      name: Optional[str] = None, priority: int = 0,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      op: Optional[int] = None) -> List[NDArray]:
    """Reduces a list of NDArrays negotiated as one unit; returns new NDArrays."""
    del priority
    tensors = list(tensors)
    outs = _grouped_allreduce(tensors, "grouped_allreduce", average, name, prescale_factor,
                              postscale_factor, process_set, op)
    return [_nd(o, t) for o, t in zip(outs, tensors)]


def grouped_allreduce_(tensors: Sequence[NDArray], average: Optional[bool] = None,
                       name: Optional[str] = None, priority: int = 0,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set,
                       op: Optional[int] = None) -> List[NDArray]:
    """:func:`grouped_allreduce` in place; returns the NDArrays."""
    del priority
    tensors = list(tensors)
    outs = _grouped_allreduce(tensors, "grouped_allreduce_", average, name, prescale_factor,
                              postscale_factor, process_set, op)
    return [_into(t, o) for t, o in zip(tensors, outs)]


def allgather(tensor: NDArray, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """Every rank's ``tensor`` concatenated along dim 0, in rank order (dim 0 may differ)."""
    del priority
    return _nd(_api.allgather(_host(tensor, "allgather"), name=name, process_set=process_set),
               tensor)


def grouped_allgather(tensors: Sequence[NDArray], name: Optional[str] = None,
                      priority: int = 0,
                      process_set: ProcessSet = global_process_set) -> List[NDArray]:
    """:func:`allgather` of a list of NDArrays negotiated as one unit."""
    del priority
    tensors = list(tensors)
    outs = _api.grouped_allgather([_host(t, "grouped_allgather") for t in tensors], name=name,
                                  process_set=process_set)
    return [_nd(o, t) for o, t in zip(outs, tensors)]


def broadcast(tensor: NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
              process_set: ProcessSet = global_process_set) -> NDArray:
    """``root_rank``'s ``tensor`` as a new NDArray on every rank."""
    del priority
    return _nd(_api.broadcast(_host(tensor, "broadcast"), root_rank, name=name,
                              process_set=process_set), tensor)


def broadcast_(tensor: NDArray, root_rank: int, name: Optional[str] = None, priority: int = 0,
               process_set: ProcessSet = global_process_set) -> NDArray:
    """Overwrites ``tensor`` with ``root_rank``'s on every rank and returns it."""
    del priority
    return _into(tensor, _api.broadcast(_host(tensor, "broadcast_"), root_rank, name=name,
                                        process_set=process_set))


def alltoall(tensor: NDArray, splits: Any = None, name: Optional[str] = None,
             priority: int = 0, process_set: ProcessSet = global_process_set
             ) -> Union[NDArray, Tuple[NDArray, NDArray]]:
    """Sends ``splits[i]`` rows of dim 0 to set rank i (default: an equal split) and returns
    the rows received in rank order; with ``splits`` given, also the rows received from each
    rank (an int32 NDArray on the CPU), as Horovod does."""
    del priority
    # The splits go on as they are, so that float splits are refused (on every rank) as
    # Horovod does, not rounded.
    raw = splits.asnumpy() if isinstance(splits, NDArray) else splits
    got = _api.alltoall(_host(tensor, "alltoall"), splits=raw, name=name,
                        process_set=process_set)
    if splits is None:
        return _nd(got, tensor)
    out, received = got
    return _nd(out, tensor), mx.nd.array(np.asarray(received), ctx=mx.cpu(), dtype="int32")


def reducescatter(tensor: NDArray, op: int = Average, name: Optional[str] = None,
                  priority: int = 0, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> NDArray:
    """Reduces across the set (Average or Sum) and returns this rank's rows of dim 0 (the
    lowest ranks get one extra row when dim 0 does not divide evenly)."""
    del priority
    return _nd(_api.reducescatter(_host(tensor, "reducescatter"), name=name, op=op,
                                  process_set=process_set, prescale_factor=prescale_factor,
                                  postscale_factor=postscale_factor), tensor)


def grouped_reducescatter(tensors: Sequence[NDArray], op: int = Average,
                          name: Optional[str] = None, priority: int = 0,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[NDArray]:
    """:func:`reducescatter` of a list of NDArrays negotiated as one unit."""
    del priority
    tensors = list(tensors)
    outs = _api.grouped_reducescatter([_host(t, "grouped_reducescatter") for t in tensors],
                                      name=name, op=op, process_set=process_set,
                                      prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor)
    return [_nd(o, t) for o, t in zip(outs, tensors)]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Returns once every rank of ``process_set`` has called it."""
    _api.barrier(process_set)


def join() -> int:
    """Declares this rank out of data (its allreduces contribute zeros from now on) and
    returns, once every rank has joined, the last rank that did."""
    return _api.join()
