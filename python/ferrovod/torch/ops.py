"""Raw asynchronous collectives on torch tensors (``horovod.torch.mpi_ops``' non-differentiable
half) and the handle table they use.

Every op hands the engine raw ``(data_ptr, nbytes, dtype, shape)`` descriptions through
``ferrovod._api._enqueue_raw``, so no NumPy view is needed (torch bfloat16 works) and a
contiguous CPU tensor is never copied: the engine reads it, and in-place ops write it, where it
lies. Non-contiguous tensors and tensors on another device (CUDA) are staged through a
contiguous host copy; the result is copied back (in-place ops) or moved to the input's device
(out-of-place ops). Handles are ints in the same table as the framework-free API, so
:func:`poll` and :func:`synchronize` are the same functions; the table keeps every tensor the
engine touches alive until ``synchronize`` returns.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _api, _core
from .._api import Adasum, Average, Sum
from ..exceptions import InvalidArgumentError
from ..process_sets import ProcessSet, global_process_set

Handle = int

_CODES = {
    getattr(torch, n): _api._DTYPES[n]
    for n in ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
              "float64", "bool")
}

# torch gives zero-element tensors a null data pointer; the engine wants a real address even
# for zero bytes, so they point here.
_EMPTY = torch.zeros(16, dtype=torch.uint8)


def _code(t: torch.Tensor, what: str) -> int:
    code = _CODES.get(t.dtype)
    if code is None:
        names = ", ".join(str(d).replace("torch.", "") for d in _CODES)
        raise InvalidArgumentError(f"{what}: dtype {t.dtype} is not supported (supported: {names})")
    return code


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InvalidArgumentError(
            f"{what}: {t.layout} tensors are not supported here (sparse gradients go through "
            "sparse_allreduce_async)")
    return t


def _host(t: torch.Tensor, what: str) -> Tuple[torch.Tensor, bool]:
    """A C-contiguous CPU tensor holding ``t``'s values, and whether it is a copy.

    A contiguous CPU tensor is returned as itself (a detached alias: zero-copy). CUDA tensors
    are staged through host memory (with a one-time warning) until the engine dispatches them
    to the NCCL backend.
    """
    _check_tensor(t, what)
    h = t.detach()
    copied = False
    if h.device.type != "cpu":
        _warn_staging(h.device)
        h = h.to("cpu")
        copied = True
    if not h.is_contiguous():
        h = h.contiguous()
        copied = True
    return h, copied


_staging_warned = False


def _warn_staging(device: torch.device) -> None:
    """Says once per process that device tensors go through host memory, and why."""
    global _staging_warned
    if _staging_warned:
        return
    _staging_warned = True
    nccl = _api.gpu_libraries()["nccl"]
    found = (f"NCCL {nccl.get('version')} was found but the engine does not dispatch CUDA "
             f"tensors to NCCL yet"
             if nccl.get("found") else f"no usable NCCL ({nccl.get('reason')})")
    warnings.warn(
        f"ferrovod: {device.type} tensors are copied to host memory for every collective and "
        f"back ({found}); expect host-memory speed, not NCCL's",
        RuntimeWarning, stacklevel=4,
    )


def _addr(t: torch.Tensor) -> int:
    return int(t.data_ptr()) if t.numel() else int(_EMPTY.data_ptr())


def _desc(h: torch.Tensor, out: Optional[torch.Tensor], what: str) -> Tuple[int, int, int, List[int], int]:
    return (_addr(h), h.numel() * h.element_size(), _code(h, what), list(h.shape),
            0 if out is None else _addr(out))


def _from_owned(buf: Any, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A torch view of an engine-allocated result (no copy on CPU)."""
    shape = tuple(int(s) for s in shape)
    arr = np.asarray(buf)
    if arr.size == 0:
        out = torch.empty(shape, dtype=dtype)
    else:
        out = torch.from_numpy(arr)
        if dtype != torch.uint8:
            out = out.view(dtype)
        out = out.view(shape)
    return out if device.type == "cpu" else out.to(device)


def _copy_back(t: torch.Tensor, h: torch.Tensor) -> None:
    with torch.no_grad():
        t.copy_(h)


def _check_root(root_rank: int) -> int:
    if not 0 <= int(root_rank) < _api.size():
        raise InvalidArgumentError(
            f"broadcast received invalid root rank {root_rank}: the job has {_api.size()} ranks")
    return int(root_rank)


# ----------------------------------------------------------------------------- handles


def poll(handle: Handle) -> bool:
    """True when the op behind ``handle`` has completed. Never blocks."""
    return _api.poll(handle)


def synchronize(handle: Union[Handle, Callable[[], Any]]) -> Any:
    """Waits for the op behind ``handle`` (GIL released) and returns its output: a tensor, a
    list of tensors for grouped ops, or ``(output, received_splits)`` for alltoall with splits.
    The handle of :func:`sparse_allreduce_async` (a callable) is accepted too. Raises
    ``HorovodInternalError`` (or a subclass) when the op failed."""
    if callable(handle):
        return handle()
    return _api.synchronize(handle)


# ----------------------------------------------------------------------------- allreduce


def _allreduce_async(tensors: Sequence[torch.Tensor], inplace: bool, average: Optional[bool],
                     name: Optional[str], op: Optional[int], prescale_factor: float,
                     postscale_factor: float, process_set: ProcessSet, kind_name: str) -> Handle:
    rop = _api._resolve_op(op, average)
    if rop == Adasum:
        raise InvalidArgumentError("Adasum is not supported by ferrovod yet")
    staged = [_host(t, kind_name) for t in tensors]
    hosts = [h for h, _ in staged]
    outs = hosts if inplace else [torch.empty_like(h, memory_format=torch.contiguous_format)
                                  for h in hosts]
    descs = [_desc(h, o, kind_name) for h, o in zip(hosts, outs)]

    def finish(_: Any) -> List[torch.Tensor]:
        results = []
        for t, (h, copied), o in zip(tensors, staged, outs):
            if inplace:
                if copied:
                    _copy_back(t, h)
                results.append(t)
            else:
                results.append(o if t.device.type == "cpu" else o.to(t.device))
        return results

    return _api._enqueue_raw(_core.ALLREDUCE, name, kind_name, process_set, descs, finish,
                             [list(tensors), hosts, outs], op=rop, prescale=prescale_factor,
                             postscale=postscale_factor)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allreduce of ``tensor`` into a new tensor; returns a handle. ``op`` defaults
    to Average; ``average`` is the deprecated boolean form."""
    return _api._single(_allreduce_async([tensor], False, average, name, op, prescale_factor,
                                         postscale_factor, process_set, "allreduce"))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place allreduce of ``tensor``; returns a handle."""
    return _api._single(_allreduce_async([tensor], True, average, name, op, prescale_factor,
                                         postscale_factor, process_set, "allreduce"))


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces ``tensor`` across ranks in place and returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allreduce of a list of tensors negotiated and fused as one unit."""
    return _allreduce_async(list(tensors), False, average, name, op, prescale_factor,
                            postscale_factor, process_set, "grouped_allreduce")


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> Handle:
    """In-place form of :func:`grouped_allreduce_async`."""
    return _allreduce_async(list(tensors), True, average, name, op, prescale_factor,
                            postscale_factor, process_set, "grouped_allreduce")


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reduces a list of tensors in place as one unit; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def sparse_allreduce_async(tensor: torch.Tensor, name: Optional[str], op: int,
                           process_set: ProcessSet = global_process_set) -> Callable[[], torch.Tensor]:
    """Reduces a sparse COO tensor by allgathering its indices and values (duplicates are
    summed when the result is coalesced; Average divides by the set size). Returns a callable
    that waits and builds the result; :func:`synchronize` accepts it."""
    if int(op) not in (Sum, Average):
        raise InvalidArgumentError("sparse allreduce supports only Sum and Average")
    t = tensor.detach().coalesce()
    base = name if name is not None else _api._auto_name("sparse_allreduce", None)
    # Allgather concatenates along dim 0, so indices travel transposed: (nnz, ndim).
    h_idx = allgather_async(t.indices().t().contiguous(), name=f"{base}.indices",
                            process_set=process_set)
    h_val = allgather_async(t.values().contiguous(), name=f"{base}.values",
                            process_set=process_set)
    n = len(process_set.ranks) if process_set.process_set_id != 0 else _api.size()

    def result() -> torch.Tensor:
        values = synchronize(h_val)
        indices = synchronize(h_idx)
        if int(op) == Average:
            values = values / n
        return torch.sparse_coo_tensor(indices.t(), values, t.size(),
                                       check_invariants=True).coalesce()

    return result


# ----------------------------------------------------------------------------- allgather


def _allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str],
                     process_set: ProcessSet, kind_name: str) -> Handle:
    hosts = [_host(t, kind_name)[0] for t in tensors]
    for h in hosts:
        if h.dim() == 0:
            raise InvalidArgumentError(
                f"{kind_name}: a 0-d (scalar) tensor cannot be gathered; reshape it to (1,)")
    descs = [_desc(h, None, kind_name) for h in hosts]

    def finish(result: Any) -> List[torch.Tensor]:
        outs, _, _ = result
        return [_from_owned(b, s, t.dtype, t.device) for (b, s), t in zip(outs, tensors)]

    return _api._enqueue_raw(_core.ALLGATHER, name, kind_name, process_set, descs, finish,
                             [list(tensors), hosts])


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather: every rank's ``tensor`` concatenated along dim 0 in rank order."""
    return _api._single(_allgather_async([tensor], name, process_set, "allgather"))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather of a list of tensors negotiated as one unit."""
    return _allgather_async(list(tensors), name, process_set, "grouped_allgather")


# ----------------------------------------------------------------------------- broadcast


def _broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                     process_set: ProcessSet, inplace: bool) -> Handle:
    root = _check_root(root_rank)
    h, copied = _host(tensor, "broadcast")
    out = h if inplace else torch.empty_like(h, memory_format=torch.contiguous_format)

    def finish(_: Any) -> torch.Tensor:
        if inplace:
            if copied:
                _copy_back(tensor, h)
            return tensor
        return out if tensor.device.type == "cpu" else out.to(tensor.device)

    return _api._enqueue_raw(_core.BROADCAST, name, "broadcast", process_set,
                             [_desc(h, out, "broadcast")], finish, [tensor, h, out], root=root)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts a broadcast of global rank ``root_rank``'s ``tensor`` into a new tensor."""
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place broadcast from global rank ``root_rank``."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrites ``tensor`` with ``root_rank``'s on every rank and returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ----------------------------------------------------------------------------- alltoall


def _alltoall_async(tensor: torch.Tensor, splits: Any, name: Optional[str],
                    process_set: ProcessSet, want_splits: bool) -> Handle:
    h, _ = _host(tensor, "alltoall")
    if h.dim() == 0:
        raise InvalidArgumentError("alltoall: a 0-d (scalar) tensor has no first dimension")
    split_list: List[int] = []
    if splits is not None:
        if isinstance(splits, torch.Tensor):
            split_list = [int(s) for s in splits.detach().cpu().reshape(-1).tolist()]
        else:
            split_list = [int(s) for s in np.asarray(splits).reshape(-1).tolist()]
        if any(s < 0 for s in split_list):
            raise InvalidArgumentError(f"alltoall: splits must be non-negative, got {split_list}")

    def finish(result: Any) -> Any:
        outs, received, _ = result
        out = _from_owned(outs[0][0], outs[0][1], tensor.dtype, tensor.device)
        if want_splits:
            return out, torch.tensor(list(received), dtype=torch.int32)
        return out

    return _api._enqueue_raw(_core.ALLTOALL, name, "alltoall", process_set,
                             [_desc(h, None, "alltoall")], finish, [tensor, h],
                             splits=split_list)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an alltoall: ``splits[i]`` rows of dim 0 go to set rank i (default: equal
    split). Its result is the output, or ``(output, received_splits)`` when ``splits`` is
    given (received splits as an int32 tensor)."""
    return _alltoall_async(tensor, splits, name, process_set, splits is not None)


# ----------------------------------------------------------------------------- reducescatter


def _reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str], op: int,
                         process_set: ProcessSet, prescale_factor: float,
                         postscale_factor: float, kind_name: str) -> Handle:
    if int(op) not in (Sum, Average):
        raise InvalidArgumentError("Reducescatter currently only supports AVERAGE and SUM.")
    hosts = [_host(t, kind_name)[0] for t in tensors]
    descs = [_desc(h, None, kind_name) for h in hosts]

    def finish(result: Any) -> List[torch.Tensor]:
        outs, _, _ = result
        return [_from_owned(b, s, t.dtype, t.device) for (b, s), t in zip(outs, tensors)]

    return _api._enqueue_raw(_core.REDUCESCATTER, name, kind_name, process_set, descs, finish,
                             [list(tensors), hosts], op=int(op), prescale=prescale_factor,
                             postscale=postscale_factor)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Handle:
    """Starts a reducescatter (Sum or Average): this rank gets its rows of dim 0 of the
    reduction, the lowest set ranks one extra row when dim 0 does not divide evenly."""
    return _api._single(_reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                             postscale_factor, "reducescatter"))


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: int = Average,
                                process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> Handle:
    """Starts a reducescatter of a list of tensors negotiated as one unit."""
    return _reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                postscale_factor, "grouped_reducescatter")
