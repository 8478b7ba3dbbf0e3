"""The differentiable collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and their grouped forms, as ``torch.autograd.Function`` s.

Gradients follow Horovod 0.28.1:

* allreduce: the allreduce of the incoming gradient with the same op and scale factors (for Sum
  and Average, the exact gradient of the sum of every rank's loss);
* allgather: the *average* of the incoming gradients over the set, sliced to this rank's rows;
* broadcast: the average of the incoming gradients on the root, zeros elsewhere (allgather and
  broadcast thus differentiate the mean of the ranks' losses, as Horovod does since #2687);
* alltoall: an alltoall of the gradient with the received splits;
* reducescatter: an allgather of the incoming gradients, times the scale factors and, for Sum,
  the set size (Average: 1): ``size`` times the exact gradient of the sum of the ranks' losses,
  the counterpart of allgather's averaging, so that an allgather of a reducescatter
  differentiates as the allreduce it computes (Horovod's convention, kept so that code written
  against Horovod trains the same).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from .. import _api
from .._api import Average, Sum
from ..process_sets import ProcessSet, global_process_set
from . import ops
from .compression import Compression, Compressor


def _grad_name(name: Optional[str]) -> Optional[str]:
    return None if name is None else f"{name}.grad"


def _row_offsets(rows: Sequence[int], process_set: ProcessSet) -> List[int]:
    """This rank's first row in each gathered tensor, from every rank's row counts."""
    counts = ops.synchronize(ops.allgather_async(torch.tensor([list(rows)], dtype=torch.int64),
                                                 process_set=process_set))
    r = ops._set_rank(process_set)
    return [int(v) for v in counts[:r].sum(0).tolist()] if r else [0] * len(rows)


class HorovodAllreduce(torch.autograd.Function):
    """Differentiable allreduce."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: Optional[bool], name: Optional[str],
                op: Optional[int], prescale_factor: float, postscale_factor: float,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.args = (average, name, op, prescale_factor, postscale_factor, process_set)
        return ops._allreduce_blocking(tensor, False, average, name, op, prescale_factor,
                                       postscale_factor, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        average, name, op, pre, post, ps = ctx.args
        g = ops._allreduce_blocking(grad, False, average, _grad_name(name), op, pre, post, ps)
        return (g,) + (None,) * 6


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Differentiable grouped allreduce."""

    @staticmethod
    def forward(ctx: Any, average: Optional[bool], name: Optional[str], op: Optional[int],
                prescale_factor: float, postscale_factor: float, process_set: ProcessSet,
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.args = (average, name, op, prescale_factor, postscale_factor, process_set)
        return tuple(ops.synchronize(ops.grouped_allreduce_async(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Any, ...]:
        average, name, op, pre, post, ps = ctx.args
        gs = ops.synchronize(ops.grouped_allreduce_async(list(grads), average, _grad_name(name),
                                                         op, pre, post, ps))
        return (None,) * 6 + tuple(gs)


class HorovodAllgather(torch.autograd.Function):
    """Differentiable allgather."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                process_set: ProcessSet) -> torch.Tensor:
        # Anything but a tensor is refused by the op itself, on every rank.
        rows = int(tensor.shape[0]) if isinstance(tensor, torch.Tensor) and tensor.dim() else 0
        ctx.rows, ctx.name, ctx.process_set = rows, name, process_set
        # Waited for at once: a small one may take the engine's fast path.
        return ops.synchronize(_api._single(ops._allgather_async([tensor], name, process_set,
                                                                      "allgather", now=True)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        ps = ctx.process_set
        reduced = ops.synchronize(ops.allreduce_async(grad, name=_grad_name(ctx.name), op=Average,
                                                      process_set=ps))
        offset = _row_offsets([ctx.rows], ps)[0]
        return reduced.narrow(0, offset, ctx.rows), None, None


class HorovodGroupedAllgather(torch.autograd.Function):
    """Differentiable grouped allgather."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], process_set: ProcessSet,
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.rows = [int(t.shape[0]) if isinstance(t, torch.Tensor) and t.dim() else 0
                    for t in tensors]
        ctx.name, ctx.process_set = name, process_set
        return tuple(ops.synchronize(ops.grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Any, ...]:
        ps = ctx.process_set
        reduced = ops.synchronize(ops.grouped_allreduce_async(
            list(grads), name=_grad_name(ctx.name), op=Average, process_set=ps))
        offsets = _row_offsets(ctx.rows, ps)
        return (None, None) + tuple(g.narrow(0, o, n) for g, o, n in zip(reduced, offsets, ctx.rows))


class HorovodBroadcast(torch.autograd.Function):
    """Differentiable broadcast."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.name, ctx.process_set = int(root_rank), name, process_set
        return ops.synchronize(ops.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        reduced = ops.synchronize(ops.allreduce_async(grad, name=_grad_name(ctx.name), op=Average,
                                                      process_set=ctx.process_set))
        if _api.rank() != ctx.root_rank:
            reduced = torch.zeros_like(reduced)
        return reduced, None, None, None


class HorovodAlltoall(torch.autograd.Function):
    """Differentiable alltoall; the received splits are not differentiable."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str],
                process_set: ProcessSet) -> Tuple[torch.Tensor, torch.Tensor]:
        out, received = ops.synchronize(ops._alltoall_async(tensor, splits, name, process_set,
                                                            True, now=True))
        ctx.received, ctx.name, ctx.process_set = received, name, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Tuple[Any, ...]:
        g, _ = ops.synchronize(ops._alltoall_async(grad, ctx.received, _grad_name(ctx.name),
                                                   ctx.process_set, True))
        return g, None, None, None


def _reducescatter_grad_scale(op: int, process_set: ProcessSet, scale: float) -> float:
    """The factor on the allgathered gradient of a reducescatter: the scale factors, times the
    set size for Sum (see the module doc)."""
    return scale * ops._set_size(process_set) if int(op) == Sum else scale


class HorovodReducescatter(torch.autograd.Function):
    """Differentiable reducescatter."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: int,
                process_set: ProcessSet, prescale_factor: float,
                postscale_factor: float) -> torch.Tensor:
        ctx.args = (name, op, process_set, prescale_factor * postscale_factor)
        return ops.synchronize(_api._single(ops._reducescatter_async(
            [tensor], name, op, process_set, prescale_factor, postscale_factor, "reducescatter",
            now=True)))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Any, ...]:
        name, op, ps, scale = ctx.args
        g = ops.synchronize(ops.allgather_async(grad, _grad_name(name), ps))
        scale = _reducescatter_grad_scale(op, ps, scale)
        return (g * scale if scale != 1.0 else g), None, None, None, None, None


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Differentiable grouped reducescatter."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: int, process_set: ProcessSet,
                prescale_factor: float, postscale_factor: float,
                *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.args = (name, op, process_set, prescale_factor * postscale_factor)
        return tuple(ops.synchronize(ops.grouped_reducescatter_async(
            tensors, name, op, process_set, prescale_factor, postscale_factor)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Any, ...]:
        name, op, ps, scale = ctx.args
        gs = ops.synchronize(ops.grouped_allgather_async(list(grads), _grad_name(name), ps))
        scale = _reducescatter_grad_scale(op, ps, scale)
        return (None,) * 5 + tuple(g * scale if scale != 1.0 else g for g in gs)


# ----------------------------------------------------------------------------- public wrappers


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Compressor = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduces ``tensor`` across ranks (default: Average) into a new tensor of the same dtype
    and device. Differentiable. ``compression`` compresses before and decompresses after."""
    compressed, cctx = compression.compress(tensor)
    if torch.is_grad_enabled() and compressed.requires_grad:
        out = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor,
                                     postscale_factor, process_set)
    else:
        # Nothing to differentiate: the autograd function's frames would only cost time.
        out = ops._allreduce_blocking(compressed, False, average, name, op, prescale_factor,
                                      postscale_factor, process_set)
    return compression.decompress(out, cctx)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Compressor = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reduces a list of tensors as one unit (negotiated and fused together). Differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedAllreduce.apply(average, name, op, prescale_factor, postscale_factor,
                                         process_set, *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenates every rank's ``tensor`` along dim 0 in rank order (dim 0 may differ per
    rank). Differentiable."""
    return HorovodAllgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Allgathers a list of tensors as one unit. Differentiable."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Returns global rank ``root_rank``'s ``tensor`` on every rank, as a new tensor.
    Differentiable."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Sends ``splits[i]`` rows of dim 0 to set rank i (default: equal split) and concatenates
    what arrives. Returns the output, or ``(output, received_splits)`` when ``splits`` is given.
    Differentiable."""
    out, received = HorovodAlltoall.apply(tensor, splits, name, process_set)
    return (out, received) if splits is not None else out


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Compressor = Compression.none, op: int = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduces across ranks (Sum or Average) and returns this rank's rows of dim 0.
    Differentiable."""
    compressed, cctx = compression.compress(tensor)
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor,
                                     postscale_factor)
    return compression.decompress(out, cctx)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Compressor = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """Reducescatters a list of tensors as one unit. Differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor,
                                             postscale_factor, *[c for c, _ in pairs])
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


__all__ = ["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
           "alltoall", "reducescatter", "grouped_reducescatter", "Sum", "Average"]
