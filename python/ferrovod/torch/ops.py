"""Raw asynchronous collectives on torch tensors (``horovod.torch.mpi_ops``' non-differentiable
half) and the handle table they use.

Every op hands the engine raw ``(data_ptr, nbytes, dtype, shape)`` descriptions through
``ferrovod._api._run`` (:func:`_submit`), so no NumPy view is needed (torch bfloat16 works) and a
contiguous CPU tensor is never copied: the engine reads it, and in-place ops write it, where it
lies. CUDA tensors of allreduce, broadcast and evenly split reducescatter go to the engine's
NCCL path where it is usable in this process (NCCL found, CUDA driver working: asked once;
the decision is :mod:`ferrovod.torch._cuda`'s), with outputs allocated here on the same device and the device's current stream to order the
collective after. Other non-contiguous tensors and tensors on another device are staged
through a contiguous host copy (CUDA ones with a one-time warning saying why); the result is
copied back (in-place ops) or moved to the input's device (out-of-place ops). Handles are ints in the same table as the framework-free API, so
:func:`poll` and :func:`synchronize` are the same functions; the table keeps every tensor the
engine touches alive until ``synchronize`` returns.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import _api, _core
from .._api import Average, Sum
from .._host_memory import shard as _shard
from ..exceptions import InvalidArgumentError
from ..process_sets import ProcessSet, global_process_set
from ._cuda import _cuda_target, _ddesc, _device_out, _device_sizes, _on_device
from ._tensors import _check_tensor, _code, _set_rank, _set_size

Handle = int

# torch gives zero-element tensors a null data pointer; the engine wants a real address even
# for zero bytes, so they point here.
_EMPTY = torch.zeros(16, dtype=torch.uint8)


def _host(t: torch.Tensor, what: str) -> Tuple[torch.Tensor, bool]:
    """A C-contiguous CPU tensor holding ``t``'s values, and whether it is a copy.

    A contiguous CPU tensor is returned as itself (a detached alias: zero-copy). Tensors on
    another device are copied to host memory (CUDA ones after :func:`_cuda_target` said why).
    """
    _check_tensor(t, what)
    if t.device.type == "cpu" and t.is_contiguous():
        # Only its memory is used: no detached alias to create (a Python object per op).
        return t, False
    h = t.detach()
    copied = False
    if h.device.type != "cpu":
        h = h.to("cpu")
        copied = True
    if not h.is_contiguous():
        h = h.contiguous()
        copied = True
    return h, copied


def _device_sized(kind: int, name: str, kind_name: str, process_set: ProcessSet,
                  tensors: Sequence[torch.Tensor], hs: Sequence[torch.Tensor],
                  outs: Sequence[torch.Tensor], finish: Callable[[Any], Any],
                  target: Tuple[int, int], splits: Sequence[int] = ()) -> Handle:
    """Submits an allgather or alltoall of CUDA tensors into outputs sized beforehand."""
    descs = [_ddesc(h, o, kind_name) for h, o in zip(hs, outs)]
    return _submit(kind, name, kind_name, process_set, descs, finish,
                   [list(tensors), list(hs), list(outs)], splits=splits,
                   device=target,
                   out_bytes=[o.numel() * o.element_size() for o in outs])


def _op_name(kind_name: str, name: Optional[str]) -> str:
    """The op's name in the engine (its timeline, stall reports and errors), as Horovod's
    torch names it: ``<kind>.<name>``, or ``<kind>.noname.<n>`` when unnamed. Ops of different
    kinds given one name are then different ops, and may be in flight together."""
    return _api._auto_name(kind_name, None) if name is None else _qualified(kind_name, str(name))


# A training step names the same ops every step: one OpName each (90 ns for a cached one,
# 500 ns to make it), the cache bounded for code that names every step's ops anew.
_qualified = functools.lru_cache(maxsize=4096)(_api.OpName)


def _submit(kind: int, name: Optional[str], kind_name: str, process_set: ProcessSet,
            descs: Sequence[Tuple[int, int, int, List[int], int]], finish: Callable[[Any], Any],
            keepalive: Any, op: int = Sum, root: int = 0, prescale: float = 1.0,
            postscale: float = 1.0, splits: Sequence[int] = (),
            device: Optional[Tuple[int, int]] = None, now: bool = False,
            out_bytes: Optional[Sequence[int]] = None) -> Handle:
    """Submits tensors described as raw tuples through ``ferrovod._api._run`` and registers the
    op in the handle table, which keeps ``finish`` (it turns the engine's result into the
    caller's) and ``keepalive`` (every tensor the engine reads or writes) referenced until
    :func:`synchronize` returns. Unnamed ops share the ``<kind_name>.noname.<n>`` counters of
    the framework-free API. ``now``: the caller synchronizes at once, so a small op may take
    the engine's fast path (and is then done when this returns)."""
    core = _api._run(kind, _api._auto_name(kind_name, name), process_set, descs, None, int(op),
                     int(root), float(prescale), float(postscale), [int(s) for s in splits],
                     device, None if out_bytes is None else [int(b) for b in out_bytes], now)
    return _api._register(core, finish, keepalive)


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
    if isinstance(root_rank, torch.Tensor) and root_rank.numel() == 1 and \
            not root_rank.is_floating_point():
        root_rank = int(root_rank.item())
    return _api._root(root_rank)


def _refused(kind: int, name: str, process_set: ProcessSet, e: Exception, now: bool) -> Handle:
    """An op whose arguments this rank refuses, negotiated as a refusal so that every member of
    the set fails it (see ``ferrovod._api._refuse``): its handle, whose synchronize raises."""
    return _api._start(_api._refuse(kind, name, process_set, str(e), now))


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
                     postscale_factor: float, process_set: ProcessSet, kind_name: str,
                     single: bool = False, now: bool = False, named: bool = False) -> Handle:
    """``now``: the caller synchronizes at once (see :func:`_submit`); ``named``: ``name``
    is already the op's."""
    name = name if named and name is not None else _op_name(kind_name, name)
    try:
        rop = _api._resolve_op(op, average)
        for t in tensors:
            _check_tensor(t, kind_name)
        target = _cuda_target(tensors, _core.ALLREDUCE, kind_name, rop, prescale_factor,
                              postscale_factor, process_set)
        if target is not None:
            h = _device_inplace_or_new(_core.ALLREDUCE, tensors, inplace, name, kind_name,
                                       process_set, target, op=rop, prescale=prescale_factor,
                                       postscale=postscale_factor)
            return _api._single(h) if single else h
        staged = [_host(t, kind_name) for t in tensors]
        hosts = [h for h, _ in staged]
        outs = hosts if inplace else [torch.empty_like(h, memory_format=torch.contiguous_format)
                                      for h in hosts]
        descs = [_desc(h, o, kind_name) for h, o in zip(hosts, outs)]
        result = _HostAllreduce(tensors, hosts, [c for _, c in staged], outs, inplace, single)
        return _submit(_core.ALLREDUCE, name, kind_name, process_set, descs, result, None,
                       op=rop, prescale=prescale_factor, postscale=postscale_factor,
                       now=now)
    except _api._BadArgument as e:
        return _refused(_core.ALLREDUCE, name, process_set, e, now)


class _HostAllreduce(_api._PerTensorResult):
    """A host-memory allreduce's result (see ``ferrovod._api._PerTensorResult``). Columns: the
    caller's tensor, the host tensor the engine used, whether that is a copy, the output."""

    __slots__ = ()

    def _one(self, t: torch.Tensor, h: torch.Tensor, copied: bool, o: torch.Tensor) -> Any:
        if self.inplace:
            if copied:
                _copy_back(t, h)
            return t
        return o if t.device.type == "cpu" else o.to(t.device)


def _device_inplace_or_new(kind: int, tensors: Sequence[torch.Tensor], inplace: bool,
                           name: Optional[str], kind_name: str, process_set: ProcessSet,
                           target: Tuple[int, int], **params: Any) -> Handle:
    """Allreduce or broadcast of CUDA tensors on the NCCL path: in place in the tensors (a
    non-contiguous one through a contiguous copy on its device, copied back), or into new
    tensors on the same device."""
    srcs = [_on_device(t) for t in tensors]
    hs = [h for h, _ in srcs]
    outs = hs if inplace else [torch.empty_like(h, memory_format=torch.contiguous_format)
                               for h in hs]
    descs = [_ddesc(h, o, kind_name) for h, o in zip(hs, outs)]

    def finish(_: Any) -> List[torch.Tensor]:
        if not inplace:
            return list(outs)
        for t, (h, copied) in zip(tensors, srcs):
            if copied:
                _copy_back(t, h)
        return list(tensors)

    return _submit(kind, name, kind_name, process_set, descs, finish,
                   [list(tensors), hs, outs], device=target, **params)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allreduce of ``tensor`` into a new tensor; returns a handle. ``op`` defaults
    to Average; ``average`` is the deprecated boolean form."""
    return _allreduce_async([tensor], False, average, name, op, prescale_factor,
                            postscale_factor, process_set, "allreduce", single=True)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an in-place allreduce of ``tensor``; returns a handle."""
    return _allreduce_async([tensor], True, average, name, op, prescale_factor,
                            postscale_factor, process_set, "allreduce", single=True)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces ``tensor`` across ranks in place and returns it."""
    return _allreduce_blocking(tensor, True, average, name, op, prescale_factor,
                               postscale_factor, process_set)


def _numpy_view(tensor: Any) -> Optional[np.ndarray]:
    """A NumPy array over a contiguous CPU tensor's own memory, or None (another device,
    layout or class, a dtype NumPy lacks, a conjugate or negative view)."""
    if type(tensor) is not torch.Tensor or tensor.is_cuda:
        return None
    try:
        return tensor.detach().numpy() if tensor.is_contiguous() else None
    except (RuntimeError, TypeError):
        return None


def _allreduce_blocking(tensor: torch.Tensor, inplace: bool, average: Optional[bool],
                        name: Optional[str], op: Optional[int], prescale_factor: float,
                        postscale_factor: float, process_set: ProcessSet) -> torch.Tensor:
    """A one-tensor allreduce waited for at once, so a small one on one host may take the
    engine's fast path (no negotiation through the coordinator). ``name`` is the caller's
    (see :func:`_op_name`)."""
    name = _op_name("allreduce", name)
    # A contiguous CPU tensor of the global set: one waiting call into the engine through a
    # NumPy view of its memory (and of a new output's), as ferrovod.allreduce_ makes. The
    # general path's frames cost a small op 14 us against 3 on 2 ranks of one host; the
    # engine declines what it does not take, bad arguments among them, and that path runs.
    if process_set is global_process_set:
        arr = _numpy_view(tensor)
        if arr is not None:
            out = tensor if inplace else torch.empty_like(tensor,
                                                          memory_format=torch.contiguous_format)
            if _core.allreduce_now(arr, arr if inplace else out.numpy(), name, op, average,
                                   prescale_factor, postscale_factor):
                return out
    return synchronize(_allreduce_async([tensor], inplace, average, name, op, prescale_factor,
                                        postscale_factor, process_set, "allreduce",
                                        single=True, now=True, named=True))


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
                     process_set: ProcessSet, kind_name: str, now: bool = False) -> Handle:
    """``now``: the caller synchronizes at once (see :func:`_submit`)."""
    name = _op_name(kind_name, name)
    try:
        for t in tensors:
            _check_tensor(t, kind_name)
        target = _cuda_target(tensors, _core.ALLGATHER, kind_name, process_set=process_set)
        if target is not None:
            refused = any(t.dim() == 0 for t in tensors)
            mine = [-1 if refused else int(t.shape[0]) for t in tensors]
            dims = _device_sizes(_core.ALLGATHER, mine, name, process_set)
            if dims is not None:
                hs = [_on_device(t)[0] for t in tensors]
                outs = [_device_out(h, dims[:, i].sum()) for i, h in enumerate(hs)]
                return _device_sized(_core.ALLGATHER, name, kind_name, process_set, tensors,
                                     hs, outs, lambda _: list(outs), target)
        hosts = [_host(t, kind_name)[0] for t in tensors]
        for h in hosts:
            if h.dim() == 0:
                raise _api._BadArgument(
                    f"{kind_name}: a 0-d (scalar) tensor cannot be gathered; reshape it to (1,)")
        descs = [_desc(h, None, kind_name) for h in hosts]

        def finish(result: Any) -> List[torch.Tensor]:
            outs, _, _ = result
            return [_from_owned(b, s, t.dtype, t.device) for (b, s), t in zip(outs, tensors)]

        return _submit(_core.ALLGATHER, name, kind_name, process_set, descs, finish,
                       [list(tensors), hosts], now=now)
    except _api._BadArgument as e:
        return _refused(_core.ALLGATHER, name, process_set, e, now)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather: every rank's ``tensor`` concatenated along dim 0 in rank order."""
    return _api._single(_allgather_async([tensor], name, process_set, "allgather"))


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an allgather of a list of tensors negotiated as one unit."""
    return _allgather_async(list(tensors), name, process_set, "grouped_allgather")


# ----------------------------------------------------------------------------- messages


def _transfer_async(tensor: torch.Tensor, peer: Optional[int], name: str, sending: bool,
                    timeout: float) -> Handle:
    """A point-to-point message (torch.distributed's ``send``/``recv``): ``tensor`` sent to
    global rank ``peer``, or received from it into ``tensor`` (``peer=None``: the first message
    of ``name`` from any rank), under ``name``, waiting at most ``timeout`` seconds for the
    other side. The engine's messages carry host memory, so a tensor elsewhere (CUDA) or not
    contiguous goes through a host copy. A send completes once the receive has taken it; a
    disagreement in dtype, shape or size fails both sides. :func:`synchronize` returns the
    peer's global rank (for a receive from any rank, the sender's)."""
    kind_name = "send" if sending else "recv"
    h, copied = _host(tensor, kind_name)
    core = _core.transfer(sending, _desc(h, None, kind_name),
                          None if peer is None else int(peer), name, float(timeout))

    def finish(raw: Any) -> int:
        if copied and not sending:
            _copy_back(tensor, h)
        return int(raw[2])

    return _api._register(core, finish, [tensor, h])


# ----------------------------------------------------------------------------- broadcast


def _broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str],
                     process_set: ProcessSet, inplace: bool, now: bool = False) -> Handle:
    name = _op_name("broadcast", name)
    try:
        root = _check_root(root_rank)
        _check_tensor(tensor, "broadcast")
        target = _cuda_target([tensor], _core.BROADCAST, "broadcast", process_set=process_set)
        if target is not None:
            h = _device_inplace_or_new(_core.BROADCAST, [tensor], inplace, name, "broadcast",
                                       process_set, target, root=root)
            return _api._single(h)
        h, copied = _host(tensor, "broadcast")
        out = h if inplace else torch.empty_like(h, memory_format=torch.contiguous_format)

        def finish(_: Any) -> torch.Tensor:
            if inplace:
                if copied:
                    _copy_back(tensor, h)
                return tensor
            return out if tensor.device.type == "cpu" else out.to(tensor.device)

        return _submit(_core.BROADCAST, name, "broadcast", process_set,
                       [_desc(h, out, "broadcast")], finish, [tensor, h, out], root=root)
    except _api._BadArgument as e:
        return _refused(_core.BROADCAST, name, process_set, e, now)


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
    return synchronize(_broadcast_async(tensor, root_rank, name, process_set, True, now=True))


# ----------------------------------------------------------------------------- alltoall


def _alltoall_async(tensor: torch.Tensor, splits: Any, name: Optional[str],
                    process_set: ProcessSet, want_splits: bool, now: bool = False) -> Handle:
    """``now``: the caller synchronizes at once (see :func:`_submit`)."""
    name = _op_name("alltoall", name)
    try:
        _check_tensor(tensor, "alltoall")
        target = _cuda_target([tensor], _core.ALLTOALL, "alltoall", process_set=process_set)
        try:
            split_list = _alltoall_splits(tensor, splits)
            bad: Optional[_api._BadArgument] = None
        except _api._BadArgument as e:
            split_list, bad = [], e
        if target is not None:
            h = _device_alltoall(tensor, split_list, bad is not None, name, process_set,
                                 want_splits, target)
            if h is not None:
                return h
        if bad is not None:
            raise bad
        h, _ = _host(tensor, "alltoall")

        def finish(result: Any) -> Any:
            outs, received, _ = result
            out = _from_owned(outs[0][0], outs[0][1], tensor.dtype, tensor.device)
            if want_splits:
                return out, torch.tensor(list(received), dtype=torch.int32)
            return out

        return _submit(_core.ALLTOALL, name, "alltoall", process_set,
                       [_desc(h, None, "alltoall")], finish, [tensor, h],
                       splits=split_list, now=now)
    except _api._BadArgument as e:
        return _refused(_core.ALLTOALL, name, process_set, e, now)


def _alltoall_splits(tensor: torch.Tensor, splits: Any) -> List[int]:
    """The splits as a list of ints (empty: equal split), or ``_BadArgument`` saying why not."""
    if tensor.dim() == 0:
        raise _api._BadArgument("alltoall: a 0-d (scalar) tensor has no first dimension")
    if splits is None:
        return []
    raw = (splits.detach().cpu().numpy() if isinstance(splits, torch.Tensor)
           else np.asarray(splits)).reshape(-1)
    # Horovod wants integer splits; a float tensor (perhaps uninitialised: NaN) is refused on
    # every rank rather than rounded.
    if raw.dtype.kind not in "iu":
        raise _api._BadArgument(f"alltoall: splits must be integers, got {raw.dtype}")
    split_list = [int(s) for s in raw.tolist()]
    if any(s < 0 for s in split_list):
        raise _api._BadArgument(f"alltoall: splits must be non-negative, got {split_list}")
    return split_list


def _device_alltoall(tensor: torch.Tensor, split_list: List[int], refused: bool, name: str,
                     process_set: ProcessSet, want_splits: bool,
                     target: Tuple[int, int]) -> Optional[Handle]:
    """An alltoall of a CUDA tensor on the NCCL path, its output sized by the rows every rank
    sends this one (exchanged first); ``None`` when a rank's arguments are refused or its
    splits do not fit its rows (the host path then says so on every rank)."""
    n = _set_size(process_set)
    rows = int(tensor.shape[0]) if tensor.dim() else 0
    sends = split_list or ([rows // n] * n if rows % n == 0 else [])
    if refused or len(sends) != n or sum(sends) != rows:
        sends = []
    got = _device_sizes(_core.ALLTOALL, sends or [-1] * n, name, process_set)
    if got is None:
        return None
    received = [int(r) for r in got.tolist()]
    h = _on_device(tensor)[0]
    out = _device_out(h, sum(received))

    def finish(_: Any) -> Any:
        if want_splits:
            return out, torch.tensor(received, dtype=torch.int32)
        return out

    return _device_sized(_core.ALLTOALL, name, "alltoall", process_set, [tensor], [h], [out],
                         finish, target, splits=sends)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> Handle:
    """Starts an alltoall: ``splits[i]`` rows of dim 0 go to set rank i (default: equal
    split). Its result is the output, or ``(output, received_splits)`` when ``splits`` is
    given (received splits as an int32 tensor)."""
    return _alltoall_async(tensor, splits, name, process_set, splits is not None)


# ----------------------------------------------------------------------------- reducescatter


def _reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str], op: int,
                         process_set: ProcessSet, prescale_factor: float,
                         postscale_factor: float, kind_name: str, now: bool = False) -> Handle:
    """``now``: the caller synchronizes at once (see :func:`_submit`)."""
    name = _op_name(kind_name, name)
    try:
        op = _api._resolve_op(op, None)
        if op not in (Sum, Average):
            raise _api._BadArgument("Reducescatter currently only supports AVERAGE and SUM.")
        for t in tensors:
            _check_tensor(t, kind_name)
        target = _cuda_target(tensors, _core.REDUCESCATTER, kind_name, int(op), prescale_factor,
                              postscale_factor, process_set)
        if target is not None:
            n = _set_size(process_set)
            srcs = [_on_device(t)[0] for t in tensors]
            outs = [torch.empty((h.shape[0] // n,) + tuple(h.shape[1:]), dtype=h.dtype,
                                device=h.device) for h in srcs]
            descs = [_ddesc(h, o, kind_name) for h, o in zip(srcs, outs)]
            return _submit(_core.REDUCESCATTER, name, kind_name, process_set, descs,
                           lambda _: list(outs), [list(tensors), srcs, outs],
                           op=int(op), prescale=prescale_factor,
                           postscale=postscale_factor, device=target)
        hosts = [_host(t, kind_name)[0] for t in tensors]
        descs = [_desc(h, None, kind_name) for h in hosts]

        def finish(result: Any) -> List[torch.Tensor]:
            outs, _, _ = result
            return [_from_owned(b, s, t.dtype, t.device) for (b, s), t in zip(outs, tensors)]

        return _submit(_core.REDUCESCATTER, name, kind_name, process_set, descs, finish,
                       [list(tensors), hosts], op=int(op), prescale=prescale_factor,
                       postscale=postscale_factor, now=now)
    except _api._BadArgument as e:
        return _refused(_core.REDUCESCATTER, name, process_set, e, now)


def _flat_host(tensor: torch.Tensor, what: str) -> torch.Tensor:
    _check_tensor(tensor, what)
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dim() == 0:
        raise InvalidArgumentError(
            f"{what}: in-place ops take a contiguous CPU tensor of at least one dimension, got "
            f"{tensor.device.type} tensor of shape {tuple(tensor.shape)}")
    return tensor


def _reducescatter_in_place_async(tensor: torch.Tensor, name: str, op: int,
                                  process_set: ProcessSet = global_process_set,
                                  prescale_factor: float = 1.0,
                                  postscale_factor: float = 1.0) -> Handle:
    """Reduces ``tensor`` across the set in place: afterwards this rank's rows of dim 0
    (:func:`ferrovod._host_memory.shard`) hold the reduction, the other rows partial sums.
    The handle's result is the view of this rank's rows. No copy of the input, no output
    allocated: a sharded optimizer reduces its flat gradient buffer this way."""
    if int(op) not in (Sum, Average):
        raise InvalidArgumentError("Reducescatter currently only supports AVERAGE and SUM.")
    t = _flat_host(tensor, "reducescatter")
    first, count = _shard(t.shape[0], _set_size(process_set), _set_rank(process_set))
    share = t[first:first + count]
    nbytes = share.numel() * share.element_size()
    desc = (_addr(t), t.numel() * t.element_size(), _code(t, "reducescatter"), list(t.shape),
            _addr(share) if nbytes else 0)
    return _submit(_core.REDUCESCATTER, name, "reducescatter", process_set, [desc],
                   lambda _: share, [t, share], op=int(op),
                   prescale=prescale_factor, postscale=postscale_factor,
                   out_bytes=[nbytes])


def _allgather_in_place_async(tensor: torch.Tensor, name: str,
                              process_set: ProcessSet = global_process_set) -> Handle:
    """Fills ``tensor`` from every rank of the set: on entry this rank's rows of dim 0
    (:func:`ferrovod._host_memory.shard`) hold its contribution, on return every rank's rows
    are in place. The handle's result is ``tensor``. A sharded optimizer gathers its updated
    parameters this way straight into the flat buffer the model's parameters view."""
    t = _flat_host(tensor, "allgather")
    first, count = _shard(t.shape[0], _set_size(process_set), _set_rank(process_set))
    share = t[first:first + count]
    desc = _desc(share, t, "allgather")
    return _submit(_core.ALLGATHER, name, "allgather", process_set, [desc],
                   lambda _: t, [t, share],
                   out_bytes=[t.numel() * t.element_size()])


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
