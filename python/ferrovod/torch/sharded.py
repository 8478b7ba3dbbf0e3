"""The sharded update of ``DistributedOptimizer(..., sharded=True)`` (ZeRO stage 1-2).

Each rank updates only its shard of the parameters: the gradients are reduce-scattered in
place in the flat gradient buffer, so each rank finds the average of its shard where its
update reads it; the wrapped optimizer steps over that shard alone (its state, momentum or
Adam's moments, exists for the shard only); then the updated shards are allgathered in place
into one flat parameter buffer that every model parameter is a view of. The bytes on the wire
are those of one allreduce (a reduce-scatter and an allgather), and the update reads and
writes 1/n of the parameters, gradients and state: on CPU ranks that share one memory bus the
update is memory-bound and all ranks run it at the same moment, so halving it on two ranks
is what lifts a step past allreduce-then-update.

**Host memory.** When every rank of the process set is on one host (and shared memory is not
off), the flat gradient buffer of each rank lives in a segment every other rank maps, and
the flat parameter buffer is one buffer in set rank 0's segment that every rank's model
views: the engine's step object (:mod:`ferrovod._host_memory`) holds both and chooses this
route. A step then needs no ring at all: once every rank's gradients are final (the object's
agreement, a one-element allreduce), each rank sums its shard straight from its peers'
buffers into its own, updates its shard of the one copy of the parameters, and the object
publishes them (a meeting), after which every rank sees every updated shard and none reads
another's gradients any more. Each rank reads its shard of every gradient buffer once and
writes its own: against the reduce-scatter and allgather rings, which copy every byte into a
shared ring and out again, that is about half the memory traffic. The ranks of a host then
hold one copy of the parameters, and whatever any rank writes into a parameter, every rank
sees. On either route each rank writes its shard of the parameters at construction and the
object publishes them: every rank starts from each shard's owner's values (all the same
after ``broadcast_parameters``).

The shard of a rank is its rows of the flat buffer under Horovod's reducescatter split; a
parameter may straddle two shards. This is right for optimizers whose update is elementwise
(:data:`ELEMENTWISE`): an update that looks at a whole tensor (LAMB's trust ratio, Adafactor's
factored moments, LBFGS) would see a slice of it, and is refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import _host_memory
from .._api import allgather_object
from . import ops

#: Optimizers whose update of an element reads only that element's parameter, gradient and
#: state (and scalars), so that updating a slice of a tensor equals slicing the update.
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad",
               "Adadelta", "ASGD", "Rprop")


def check_shardable(cls: type, why_not_flat: Optional[str], overlap: Any) -> None:
    """Raises ``ValueError`` naming what keeps the sharded update from an optimizer of class
    ``cls`` whose gradients cannot live in one flat buffer for ``why_not_flat`` (None: they
    can)."""
    base = next((c.__name__ for c in cls.__mro__ if c.__module__.startswith("torch.optim")),
                cls.__name__)
    if base not in ELEMENTWISE:
        raise ValueError(
            f"sharded=True updates a slice of each parameter, which is right only for "
            f"elementwise optimizers ({', '.join(ELEMENTWISE)}); {cls.__name__} is not one "
            "of them")
    if overlap:
        raise ValueError("sharded=True reduces every gradient at step(): overlap=True cannot "
                         "apply")
    if why_not_flat is not None:
        raise ValueError(f"sharded=True needs the gradients in one flat buffer: {why_not_flat}")


class Shards:
    """The flat parameter buffer, the rank's shard of it per parameter group, and the
    layout that maps shard state to and from the unsharded ``state_dict`` format.

    ``flat``: the step object's parameter buffer (on one host the one copy every rank views);
    each rank writes its shard of the parameters there, and the caller publishes them."""

    def __init__(self, groups: List[Dict[str, Any]], params: List[torch.Tensor],
                 grad_flat: torch.Tensor, flat: torch.Tensor, n: int, rank: int) -> None:
        self.groups_params = [list(g["params"]) for g in groups]
        self.grad_flat = grad_flat
        self.flat = flat
        total = sum(p.numel() for p in params)
        lo, count = _host_memory.shard(total, n, rank)
        hi = lo + count
        offsets: Dict[torch.Tensor, int] = {}
        at = 0
        with torch.no_grad():
            for p in params:
                # This rank's rows of p, where they fall in its shard.
                a, b = max(at, lo), min(at + p.numel(), hi)
                if a < b:
                    self.flat[a:b].copy_(p.reshape(-1)[a - at:b - at])
                p.data = self.flat[at:at + p.numel()].view_as(p)
                offsets[p] = at
                at += p.numel()
        self.offsets = offsets
        # Per group: its range of the flat buffer (its parameters that need gradients are
        # consecutive there) and its part of this rank's shard.
        self.ranges: List[Tuple[int, int]] = []
        self.starts: List[int] = []
        self.views: List[torch.Tensor] = []
        for gp in self.groups_params:
            mine = [p for p in gp if p in offsets]
            start = offsets[mine[0]] if mine else 0
            end = start + sum(p.numel() for p in mine)
            self.ranges.append((start, end))
            a, b = max(start, lo), min(end, hi)
            b = max(a, b)
            self.starts.append(a)
            self.views.append(self.flat[a:b])

    def attach_grads(self) -> None:
        """Points each shard's ``.grad`` at its slice of the flat gradient buffer (the
        optimizer's ``zero_grad`` may have cleared it)."""
        for v, start in zip(self.views, self.starts):
            v.grad = self.grad_flat[start:start + v.numel()]

    # ------------------------------------------------------------------ state_dict

    def gather_state(self, optimizer: torch.optim.Optimizer, name: str,
                     process_set: Any) -> Dict[str, Any]:
        """The optimizer's state in the unsharded format (as the wrapped optimizer would hold
        it over the model's parameters), gathered from every rank: a collective."""
        local = []
        for gi, v in enumerate(self.views):
            st = optimizer.state.get(v, {})
            local.append({k: ("tensor" if _elementwise(x, v) else "value")
                          for k, x in st.items()})
        every = allgather_object(local, name=f"{name}.layout", process_set=process_set)
        state: Dict[int, Dict[str, Any]] = {}
        groups = []
        index = 0
        for gi, (g, gp) in enumerate(zip(optimizer.param_groups, self.groups_params)):
            kinds = every[0][gi]
            for r, theirs in enumerate(every):
                if theirs[gi] != kinds:
                    raise ValueError(
                        f"{name}: the optimizer state of parameter group {gi} has keys "
                        f"{sorted(theirs[gi])} on set rank {r} but {sorted(kinds)} on set rank 0")
            st = optimizer.state.get(self.views[gi], {})
            full: Dict[str, torch.Tensor] = {}
            for key in sorted(kinds):
                if kinds[key] == "tensor":
                    full[key] = ops.synchronize(ops.allgather_async(
                        st[key].detach(), name=f"{name}.{gi}.{key}", process_set=process_set))
            start = self.ranges[gi][0]
            ids = []
            for p in gp:
                ids.append(index)
                if p in self.offsets and kinds:
                    a = self.offsets[p] - start
                    ps: Dict[str, Any] = {}
                    for key, kind in kinds.items():
                        ps[key] = (full[key][a:a + p.numel()].view_as(p).clone()
                                   if kind == "tensor" else _copy(st[key]))
                    state[index] = ps
                index += 1
            groups.append({**{k: x for k, x in g.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def shard_state(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's shard of an unsharded ``state_dict``, in the format the wrapped
        optimizer loads over its shards (one parameter per group)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.groups_params) or any(
                len(s["params"]) != len(gp) for s, gp in zip(saved_groups, self.groups_params)):
            raise ValueError(
                "load_state_dict: the saved state has parameter groups of sizes "
                f"{[len(s['params']) for s in saved_groups]}, this optimizer "
                f"{[len(gp) for gp in self.groups_params]}")
        saved = state_dict["state"]
        state: Dict[int, Dict[str, Any]] = {}
        groups = []
        for gi, (sg, gp) in enumerate(zip(saved_groups, self.groups_params)):
            mine = [(p, saved.get(i, saved.get(str(i), {})))
                    for p, i in zip(gp, sg["params"]) if p in self.offsets]
            keys = sorted({k for _, s in mine for k in s})
            shard: Dict[str, Any] = {}
            a = self.starts[gi] - self.ranges[gi][0]
            n = self.views[gi].numel()
            for key in keys:
                vals = [s.get(key) for _, s in mine]
                if all(isinstance(x, torch.Tensor) and x.shape == p.shape
                       for (p, _), x in zip(mine, vals)):
                    whole = torch.cat([x.reshape(-1) for x in vals])
                    shard[key] = whole[a:a + n].clone()
                else:
                    shard[key] = _copy(next(x for x in vals if x is not None))
            if shard:
                state[gi] = shard
            groups.append({**{k: x for k, x in sg.items() if k != "params"}, "params": [gi]})
        return {"state": state, "param_groups": groups}


def clear_grads(params: List[torch.Tensor], set_to_none: bool) -> None:
    """Clears the model's gradients as ``torch.optim.Optimizer.zero_grad`` would: the wrapped
    optimizer of a sharded update holds only the shards, not the model's parameters."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            if p.grad.grad_fn is not None:
                p.grad.detach_()
            else:
                p.grad.requires_grad_(False)
            p.grad.zero_()


def _elementwise(x: Any, shard: torch.Tensor) -> bool:
    return isinstance(x, torch.Tensor) and x.dim() == 1 and x.shape == shard.shape


def _copy(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


__all__ = ["ELEMENTWISE", "Shards", "check_shardable", "clear_grads"]
