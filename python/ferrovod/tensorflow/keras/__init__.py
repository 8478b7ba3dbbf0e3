"""``ferrovod.tensorflow.keras``: a drop-in for ``horovod.tensorflow.keras``.

``import ferrovod.tensorflow.keras as hvd`` and a Horovod tf.keras script runs on
TensorFlow >= 2.16 (which Horovod 0.28 does not support), with whichever Keras ``tf.keras``
means: Keras 3, or Keras 2 (the ``tf_keras`` package) with ``TF_USE_LEGACY_KERAS=1``, which
is how Horovod-era Keras 2 code runs there. ``hvd.init()``, ``hvd.DistributedOptimizer(opt)``
around any Keras optimizer of either (Keras 2's legacy ones too), ``hvd.callbacks.*``,
``hvd.load_model``, and value collectives that return what Horovod's did: a ``tf.Tensor``
when executing eagerly, a NumPy array in a v1 graph (evaluated in Keras' session). Compile
models with ``jit_compile=False`` (or Keras 3's default ``"auto"`` on CPU-only machines):
gradients are exchanged by a host op that XLA cannot compile, and a step compiled with XLA
raises a ValueError saying so. See ``docs/keras.md``.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from ..._api import (
    Average,
    Sum,
    allgather_object,
    broadcast_object,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
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
from ..._keras import functions as _functions
from ..._keras.functions import (
    init,
    broadcast_global_variables,
    broadcast_variables,
    load_model,
)
from ..._keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from ...exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ...process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ..compression import Compression
from . import callbacks, elastic



def _as_tensor(value: Any) -> Any:
    # Horovod evaluated these ops with Keras' backend: the tensor itself when eager.
    return tf.convert_to_tensor(value) if tf.executing_eagerly() else value


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Any = Compression.none,
              process_set: ProcessSet = global_process_set) -> Any:
    """Reduces ``value`` across ranks (default: Average)."""
    return _as_tensor(_functions.allreduce(
        value, name=name, average=average, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor, op=op, compression=compression,
        process_set=process_set))


def allgather(value: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """Concatenates every rank's ``value`` along dim 0, in rank order."""
    return _as_tensor(_functions.allgather(value, name=name, process_set=process_set))


def broadcast(value: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``value`` on every rank."""
    return _as_tensor(_functions.broadcast(value, root_rank, name=name,
                                           process_set=process_set))


def reducescatter(value: Any, name: Optional[str] = None, op: int = Average,
                  process_set: ProcessSet = global_process_set) -> Any:
    """Reduces ``value`` across ranks; this rank's rows of dim 0."""
    return _as_tensor(_functions.reducescatter(value, name=name, op=op,
                                               process_set=process_set))


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Compression", "callbacks", "elastic",
    "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables",
    "broadcast_variables", "allreduce", "allgather", "broadcast", "reducescatter", "load_model",
    "broadcast_object", "allgather_object", "HorovodInternalError", "HostsUpdatedInterrupt",
]
