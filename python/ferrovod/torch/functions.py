"""Model and optimizer state helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``,
and the object collectives ``broadcast_object`` / ``allgather_object`` (from ``ferrovod``)."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import torch

from .. import _api
from .._api import allgather_object, broadcast_object
from ..process_sets import ProcessSet, global_process_set
from . import ops

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "allgather_object"]

Params = Union[Mapping[str, torch.Tensor], Iterable[Union[torch.Tensor, Tuple[str, torch.Tensor]]]]


def broadcast_parameters(params: Params, root_rank: int, prefix: Optional[str] = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrites tensors in place with ``root_rank``'s values on every rank.

    ``params`` is a ``state_dict()`` (broadcast in key order), or a list / iterable of tensors
    or ``(name, tensor)`` pairs such as ``model.named_parameters()``. Named tensors are sent
    under their names (with ``prefix`` in front), so the order may differ between ranks; all
    broadcasts run at once and this returns when every one has finished.
    """
    if isinstance(params, Mapping):
        items: List[Tuple[Optional[str], Any]] = sorted(params.items())
    elif isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
        raise ValueError(f"invalid params of type: {type(params)}")
    else:
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = []
    for name, p in items:
        if not isinstance(p, torch.Tensor):
            raise ValueError(f"broadcast_parameters: {name or 'an entry'} is a "
                             f"{type(p).__name__}, not a tensor")
        full = None if name is None else f"{prefix or ''}{name}"
        handles.append(ops.broadcast_async_(p, root_rank, name=full, process_set=process_set))
    for h in handles:
        ops.synchronize(h)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Makes every rank's optimizer state (hyper-parameters and per-parameter state such as
    momentum buffers or Adam moments) equal to ``root_rank``'s.

    Scalars and the layout of the root's state travel as one pickled object; tensors are then
    broadcast in place, so a rank whose state is missing or differently shaped (e.g. only rank
    0 loaded a checkpoint) ends up with the root's. ``torch.optim.LBFGS`` is rejected. A
    sharded ``DistributedOptimizer`` keeps each shard's state on one rank, so only the
    hyper-parameters are broadcast.

    As in Horovod, a rank whose optimizer has no state yet leaves every parameter that requires
    a gradient with a zero gradient (scripts go on to use ``p.grad``): sparse for
    ``SparseAdam``, and for ``SGD`` on the parameters of ``model``'s sparse embeddings, dense
    otherwise. Unlike Horovod, the optimizer is not stepped with those gradients to create its
    state (the step would advance e.g. Adam's step count and move parameters under weight
    decay): the root's state is copied as it is.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not optimizer.state and not getattr(optimizer, "sharded", False):
        _zero_grads(optimizer, params, model)
    me = _api.rank() == int(root_rank)
    layout: Optional[Dict[str, Any]] = None
    if me:
        entries = []
        # A sharded optimizer's shards differ by rank and each one's state lives on that rank
        # alone: there is no copy to make equal, only the hyper-parameters are the root's.
        for i, p in enumerate([] if getattr(optimizer, "sharded", False) else params):
            for key, v in sorted(optimizer.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(v, torch.Tensor):
                    entries.append((i, key, "tensor", (tuple(v.shape), str(v.dtype),
                                                       v.device == p.device)))
                else:
                    entries.append((i, key, "value", v))
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        layout = {"groups": groups, "entries": entries, "nparams": len(params)}
    layout = broadcast_object(layout, root_rank, name="broadcast_optimizer_state.layout",
                              process_set=process_set)
    if layout["nparams"] != len(params) or len(layout["groups"]) != len(optimizer.param_groups):
        raise ValueError(
            f"broadcast_optimizer_state: rank {_api.rank()}'s optimizer has {len(params)} "
            f"parameters in {len(optimizer.param_groups)} groups, root rank {root_rank}'s has "
            f"{layout['nparams']} in {len(layout['groups'])}")
    for group, opts in zip(optimizer.param_groups, layout["groups"]):
        group.update(opts)
    handles = []
    for i, key, kind, value in layout["entries"]:
        p = params[i]
        st = optimizer.state[p]
        if kind == "value":
            st[key] = value
            continue
        shape, dtype, on_param_device = value
        dt = getattr(torch, dtype.replace("torch.", ""))
        cur = st.get(key)
        if not (isinstance(cur, torch.Tensor) and tuple(cur.shape) == shape and cur.dtype == dt):
            cur = torch.zeros(shape, dtype=dt, device=p.device if on_param_device else "cpu")
            st[key] = cur
        handles.append(ops.broadcast_async_(cur, root_rank,
                                            name=f"broadcast_optimizer_state.{i}.{key}",
                                            process_set=process_set))
    for h in handles:
        ops.synchronize(h)


def _zero_grads(optimizer: torch.optim.Optimizer, params: List[torch.Tensor],
                model: Optional[torch.nn.Module]) -> None:
    """Gives every parameter that requires a gradient a zero one, as Horovod's
    state-initialising step leaves them: sparse where that step needed sparse gradients
    (``SparseAdam``; ``SGD`` on sparse embeddings, which only ``model`` can name)."""
    sparse_ids = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse:
                sparse_ids.update(id(p) for p in m.parameters())
    every_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    by_sgd = isinstance(optimizer, torch.optim.SGD)
    for p in params:
        if not p.requires_grad:
            continue
        zero = torch.zeros_like(p, memory_format=torch.contiguous_format)
        p.grad = zero.to_sparse() if every_sparse or (by_sgd and id(p) in sparse_ids) else zero
