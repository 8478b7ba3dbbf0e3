"""``ferrovod.keras``: a drop-in for ``horovod.keras`` (the standalone ``keras`` package).

With Keras 3 the standalone package *is* tf.keras, so this module has the same surface as
``ferrovod.tensorflow.keras`` (a superset of ``horovod.keras``'s, e.g. ``DistributedOptimizer``
also takes ``backward_passes_per_step`` and ``process_set``), with Horovod's differences:
``allreduce`` averages by default (``average=True``), and ``Adasum`` is exported (the
optimizer rejects it). It imports no framework besides ``keras`` itself: on the TensorFlow
backend ``ferrovod.tensorflow`` is loaded at the first gradient reduction, on the torch
backend ``ferrovod.torch``. ``Compression`` here holds NumPy compressors that stand for the
backend's own (``Compression.fp16`` reduces backend tensors as float16 on either backend).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._api import (
    Adasum,
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
from .._keras import functions as _functions
from .._keras.compression import Compression
from .._keras.functions import (
    init,
    allgather,
    broadcast,
    broadcast_global_variables,
    broadcast_variables,
    load_model,
    reducescatter,
)
from .._keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from . import callbacks, elastic


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = True,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Any = Compression.none,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduces ``value`` across ranks and returns the result as NumPy. Averages by default
    (``average=True``, as ``horovod.keras``); an explicit ``op`` takes precedence over that
    default (Horovod would raise for ``op`` plus the default ``average``)."""
    if op is not None and average is True:
        average = None
    return _functions.allreduce(value, name=name, average=average,
                                prescale_factor=prescale_factor,
                                postscale_factor=postscale_factor, op=op,
                                compression=compression, process_set=process_set)


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Compression", "callbacks", "elastic",
    "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables",
    "broadcast_variables", "allreduce", "allgather", "broadcast", "reducescatter", "load_model",
    "broadcast_object", "allgather_object", "HorovodInternalError", "HostsUpdatedInterrupt",
]
