"""``ferrovod.tensorflow.keras``: a drop-in for ``horovod.tensorflow.keras`` on Keras 3.

``import ferrovod.tensorflow.keras as hvd`` and a Horovod tf.keras script runs on
TensorFlow >= 2.16 / Keras 3 (which Horovod 0.28 does not support): ``hvd.init()``,
``hvd.DistributedOptimizer(opt)`` around any Keras 3 optimizer, ``hvd.callbacks.*``,
``hvd.load_model``, and value collectives that return NumPy arrays. Compile models with
``jit_compile=False`` (or the default ``"auto"`` on CPU-only machines): gradients are
exchanged by a host op that XLA cannot compile, and a step compiled with XLA raises a
ValueError saying so. See ``docs/keras.md``.
"""

from __future__ import annotations

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
from ..._keras.functions import (
    init,
    allgather,
    allreduce,
    broadcast,
    broadcast_global_variables,
    broadcast_variables,
    load_model,
    reducescatter,
)
from ..._keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from ...exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ...process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ..compression import Compression
from . import callbacks, elastic

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
