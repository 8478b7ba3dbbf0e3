"""``DistributedOptimizer(op=Adasum)`` (Horovod's ``_DistributedAdasumOptimizer``): each rank
takes the wrapped optimizer's step on its own gradients, and what that step changed in each
parameter (its delta) is combined across the ranks by Adasum (see
``src/collective/adasum.rs``); every rank then sets each parameter to where it started the
step plus the combined delta. Combining deltas rather than gradients is what lets Adasum work
with any optimizer: the deltas already carry the optimizer's own scaling (Adam's moments, the
learning rate).

Every rank keeps its own optimizer state (as in Horovod). The set needs a power-of-two number
of ranks: a step on another size fails on every rank, naming it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch

from .._api import Adasum
from ..process_sets import ProcessSet
from . import ops
from .compression import Compressor

__all__ = ["adasum_optimizer"]


class _DistributedAdasumMixin:
    """Methods mixed in front of the wrapped optimizer's class."""

    def __init__(self, params: Any, named_parameters: Optional[Sequence[Tuple[str, torch.Tensor]]],
                 compression: Compressor, process_set: ProcessSet) -> None:
        super().__init__(params)  # type: ignore[call-arg]
        self._compression = compression
        self.process_set = process_set
        self.op = Adasum
        every = [p for g in self.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        self._updated = [p for p in every if p.requires_grad]
        # One grouped allreduce a step, named after the first parameter it updates.
        first = next((n for n, p in (named_parameters or []) if self._updated
                      and p is self._updated[0]), "0")
        self._name = f"DistributedAdasumOptimizer.{first}"

    def step(self, closure: Any = None) -> Any:
        """The local step, then the parameters set to their start plus the Adasum of every
        rank's delta (one grouped allreduce: one dot product per parameter)."""
        starts = [p.detach().clone() for p in self._updated]
        loss = super().step(closure)  # type: ignore[misc]
        if not self._updated or not self.process_set.included():
            return loss
        deltas, ctxs = [], []
        with torch.no_grad():
            for p, start in zip(self._updated, starts):
                delta, ctx = self._compression.compress(p.detach() - start)
                deltas.append(delta)
                ctxs.append(ctx)
            combined = ops.synchronize(ops.grouped_allreduce_async(
                deltas, op=Adasum, name=self._name,
                process_set=self.process_set))
            for p, start, delta, ctx in zip(self._updated, starts, combined, ctxs):
                p.copy_(start + self._compression.decompress(delta, ctx))
        return loss

    def synchronize(self) -> None:
        """Nothing to wait for: ``step()`` combines the deltas itself (Horovod's API)."""

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Horovod's API; ``step()`` always combines the deltas."""
        yield


def adasum_optimizer(optimizer: torch.optim.Optimizer,
                     named_parameters: Optional[Sequence[Tuple[str, torch.Tensor]]],
                     compression: Compressor, backward_passes_per_step: int,
                     process_set: ProcessSet) -> torch.optim.Optimizer:
    """The Adasum form of ``DistributedOptimizer`` (see the module doc)."""
    if backward_passes_per_step != 1:
        raise ValueError("DistributedOptimizer(op=Adasum) takes backward_passes_per_step=1 "
                         "only: accumulate gradients over passes before calling step()")
    cls = type(optimizer.__class__.__name__, (_DistributedAdasumMixin, optimizer.__class__), {})
    out: Any = cls(optimizer.param_groups, named_parameters, compression, process_set)
    return out
