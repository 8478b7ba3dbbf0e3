"""A training step's flat buffer: the engine's ``FlatStep`` (``engine::flat_step`` in the Rust
engine), one buffer per rank that the optimizer's tensors view without a copy.

The torch optimizer keeps its flat gradients there and, with a sharded update, the one copy of
its parameters (see :mod:`ferrovod.torch.sharded`). The engine chooses the route: when every
rank of the process set is on this host (and shared memory is on), each rank maps every other
rank's buffer and reduces its shard straight from its peers' gradients; otherwise the same
calls are in-place ops over the rings. The object's ``allreduce``, ``reduce_shard`` and
``publish`` hold the step's agreements and meetings; nothing here calls a collective.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _api, _core
from .process_sets import ProcessSet


def flat_step(name: str, count: int, code: int, process_set: ProcessSet, rank: int, n: int,
              sharded: bool = False, alone: bool = False) -> Optional[Any]:
    """A ``ferrovod._core.FlatStep`` of ``count`` elements of engine dtype ``code`` for the
    ranks of ``process_set`` (``rank`` of ``n``), named ``name``, with room for a sharded
    update's parameters when ``sharded``: a collective over the set unless ``alone``, which
    makes it without meeting anyone (an elastic worker, whose peers may be busy). ``None`` on
    every rank when some rank has no memory for it."""
    return _core.flat_step(name, _api._set_id(process_set), rank, n, count, code, sharded,
                           alone)


def view(segment: Any) -> np.ndarray:
    """A ``HostSegment`` (``FlatStep.grads()`` or ``.params()``) as a writable uint8 array,
    which keeps it mapped."""
    return np.asarray(segment)


def shard(rows: int, n: int, r: int) -> Tuple[int, int]:
    """Rank ``r``'s rows of ``rows`` split over ``n`` ranks, as (first row, row count):
    Horovod's reducescatter split, the lowest ``rows % n`` ranks one row more."""
    return r * (rows // n) + min(r, rows % n), rows // n + int(r < rows % n)


__all__ = ["flat_step", "shard", "view"]
