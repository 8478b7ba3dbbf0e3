"""An MXNet KVStore whose ``dist_sync`` semantics are carried by allreduce: no scheduler and
no servers, every worker holds the store's values and applies the optimizer itself.

A script written for ``mx.kv.create('dist_sync')`` migrates by changing that line to
``ferrovod.mxnet.KVStore()`` (or ``mx.kv.create('ferrovod')`` once ``ferrovod.mxnet`` is
imported); Gluon's ``Trainer(..., kvstore=kv)`` and the ``Module`` API take it as they take
MXNet's. What each call does, as a parameter server would:

- ``init`` / ``broadcast``: the store takes rank 0's value for the key (and ``broadcast``
  writes it to ``out``);
- ``push``: every worker's values for the key (a list per worker is summed first, as for
  several devices) are summed across workers; with an optimizer set (``set_optimizer``) the sum
  is the gradient of one update of the stored value, else it becomes the stored value;
- ``pull``: the stored value into ``out``; ``pushpull``: both.

Every worker runs the same updates on the same values in the same order, so the stores stay
equal without a server; the optimizer's state lives in each worker.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import mxnet as mx

from .. import _api
from .mpi_ops import allreduce, broadcast


def _pairs(key: Any, value: Any) -> List[Tuple[Any, List[Any]]]:
    """``(key, [values])`` per key: a key and a value (or a list of values, one per device),
    or a list of keys and a list of such values."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise ValueError(f"{len(key)} keys need as many values")
        return [p for k, v in zip(key, value) for p in _pairs(k, v)]
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, mx.nd.NDArray) for v in values):
        raise ValueError(f"key {key!r}: values must be NDArrays")
    return [(key, values)]


class KVStore(mx.kvstore.KVStoreBase):
    """``dist_sync`` over allreduce (see the module doc). ``init()`` of ferrovod is called if it
    has not been."""

    def __init__(self) -> None:
        if not _api.is_initialized():
            _api.init()
        self._store: Dict[Any, mx.nd.NDArray] = {}
        self._updater: Optional[Any] = None

    @property
    def type(self) -> str:
        """``dist_sync``: frameworks that ask treat the store as distributed and synchronous."""
        return "dist_sync"

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return _api.rank()

    @property
    def num_workers(self) -> int:
        """The number of workers."""
        return _api.size()

    @staticmethod
    def is_capable(capability: str) -> bool:
        """Updates with an optimizer, as a parameter server does."""
        return capability.lower() == mx.kvstore.KVStoreBase.OPTIMIZER

    def _value(self, key: Any) -> mx.nd.NDArray:
        if key not in self._store:
            raise KeyError(f"key {key!r} has not been initialized in the KVStore (init or "
                           f"broadcast it first)")
        return self._store[key]

    def init(self, key: Any, value: Any) -> None:
        """Stores rank 0's value for each key."""
        for k, values in _pairs(key, value):
            # A new NDArray over this op's own result: the store may update it in place.
            self._store[k] = broadcast(values[0], 0, name=f"kvstore.init.{k}")

    def broadcast(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Stores rank 0's ``value`` for ``key`` and writes it to ``out``."""
        self.init(key, value)
        self.pull(key, out=out, priority=priority)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Sums the values across workers; updates the stored value with the optimizer when
        one is set, else stores the sum."""
        del priority
        for k, values in _pairs(key, value):
            stored = self._value(k)
            local = values[0] if len(values) == 1 else mx.nd.add_n(*values)
            total = allreduce(local, op=_api.Sum, name=f"kvstore.push.{k}")
            if self._updater is not None:
                self._updater(k, total.astype(stored.dtype, copy=False), stored)
            else:
                stored[:] = total

    def pull(self, key: Any, out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> None:
        """Writes the stored value of each key to ``out`` (an NDArray or a list of them)."""
        del priority, ignore_sparse
        if out is None:
            raise ValueError("pull needs `out`")
        for k, outs in _pairs(key, out):
            stored = self._value(k)
            for o in outs:
                stored.copyto(o)

    def pushpull(self, key: Any, value: Any, out: Any = None, priority: int = 0) -> None:
        """:meth:`push`, then :meth:`pull` into ``out`` (``value`` when ``out`` is None)."""
        self.push(key, value, priority)
        self.pull(key, out=value if out is None else out, priority=priority)

    def set_optimizer(self, optimizer: mx.optimizer.Optimizer) -> None:
        """Pushes from now on update the stored values with ``optimizer`` (every worker
        applies it, each holding its state)."""
        self._updater = mx.optimizer.get_updater(optimizer)

    def set_gradient_compression(self, compression_params: Dict[str, Any]) -> None:
        """Refused: the parameter server's 2-bit compression has no allreduce counterpart
        here; ``DistributedTrainer(compression=Compression.fp16)`` halves the bytes."""
        raise ValueError("ferrovod.mxnet.KVStore does not compress gradients "
                         f"({compression_params}); use DistributedTrainer with "
                         "compression=Compression.fp16 instead")

    def save_optimizer_states(self, fname: str, dump_optimizer: bool = False) -> None:
        """Saves this worker's optimizer states (the same on every worker) to ``fname``."""
        if self._updater is None:
            raise ValueError("no optimizer is set")
        with open(fname, "wb") as f:
            f.write(self._updater.get_states(dump_optimizer))

    def load_optimizer_states(self, fname: str) -> None:
        """Loads optimizer states saved by :meth:`save_optimizer_states`."""
        if self._updater is None:
            raise ValueError("no optimizer is set")
        with open(fname, "rb") as f:
            self._updater.set_states(f.read())

    def barrier(self) -> None:
        """Returns once every worker has called it."""
        _api.barrier()

    _barrier = barrier


@mx.kvstore.KVStoreBase.register
class Ferrovod(KVStore):
    """:class:`KVStore` under the name ``mx.kv.create('ferrovod')``."""


__all__ = ["KVStore", "Ferrovod"]
