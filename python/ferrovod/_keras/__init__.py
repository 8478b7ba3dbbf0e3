"""Shared implementation of ``ferrovod.tensorflow.keras`` and ``ferrovod.keras`` (Keras 3).

With Keras 3, ``tf.keras`` and the standalone ``keras`` package are the same package, so the
two public modules re-export one implementation and differ only where Horovod's did (the
default of ``allreduce``'s ``average``, which ``Compression`` they expose). Submodules:

* ``optimizer`` — ``DistributedOptimizer`` / ``PartialDistributedOptimizer``;
* ``callbacks`` — broadcast, metric averaging, lr schedule/warm-up, best-model checkpoint;
* ``functions`` — value collectives returning NumPy, variable broadcast, ``load_model``;
* ``compression`` — NumPy compressors (backend-neutral);
* ``_backend`` — the backend-specific parts (gradient reduction, XLA detection).

Importing this package imports ``keras`` (and so its backend), never ferrovod's framework
adapters: those are imported on first use, for the backend Keras runs on.
"""

from __future__ import annotations

from . import callbacks
from .compression import Compression
from .functions import (
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    broadcast_variables,
    load_model,
    model_variables,
    reducescatter,
)
from .optimizer import DistributedOptimizer, PartialDistributedOptimizer, is_distributed

__all__ = [
    "callbacks", "Compression", "DistributedOptimizer", "PartialDistributedOptimizer",
    "is_distributed", "allreduce", "allgather", "broadcast", "reducescatter",
    "broadcast_variables", "broadcast_global_variables", "model_variables", "load_model",
]
