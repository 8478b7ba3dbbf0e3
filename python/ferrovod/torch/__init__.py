"""``ferrovod.torch``: a drop-in for ``horovod.torch``.

``import ferrovod.torch as hvd`` and a Horovod PyTorch script runs unchanged: the same names,
arguments and semantics (``hvd.init()``, ``hvd.allreduce``, ``hvd.DistributedOptimizer``,
``hvd.broadcast_parameters``, ...). Ops take and return torch tensors of the input's dtype
and device; handles are ints for :func:`poll` / :func:`synchronize`.

Tensors: contiguous CPU tensors are handed to the engine by pointer (zero-copy); other
tensors (non-contiguous, or on a CUDA device) are staged through a contiguous host copy and
the result is copied back or moved to the input's device. Every engine dtype works: uint8,
int8, int16, int32, int64, float16, bfloat16, float32, float64, and bool where the op allows.
"""

from __future__ import annotations

from .._api import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    barrier,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    join,
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
from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .compression import Compression
from .functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .ops import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm
from . import elastic  # noqa: E402 - hvd.elastic, as in Horovod; needs the names above
import torch.distributed as _dist  # noqa: E402

if _dist.is_available():
    # torch.distributed's backend "ferrovod" (a torch built without distributed has none).
    from . import process_group  # noqa: E402

    process_group.register()


__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join", "barrier", "poll", "synchronize",
    "broadcast_object", "allgather_object", "broadcast_parameters", "broadcast_optimizer_state",
    "DistributedOptimizer", "Compression", "SyncBatchNorm", "elastic",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "HostsUpdatedInterrupt",
    "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "cuda_built", "ddl_built", "ccl_built", "rocm_built",
]
