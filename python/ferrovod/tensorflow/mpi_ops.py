"""The TensorFlow collectives of ``ferrovod.tensorflow`` (Horovod's ``horovod.tensorflow.mpi_ops``).

There is no custom C++ op: every collective runs the framework-free engine (``ferrovod._api``)
on NumPy arrays.

* Eager mode: ``tensor.numpy()`` -> engine -> ``tf.convert_to_tensor``.
* Inside ``tf.function`` (graph mode): one ``tf.numpy_function(..., stateful=True)`` per
  collective. Stateful, so tf.function's automatic control dependencies run the collectives in
  program order: every rank then submits them in the same order, and two blocking host ops
  never race for TensorFlow's inter-op threads. Static output shapes are set where known
  (allreduce, broadcast: the input's; allgather, alltoall, reducescatter: all but dim 0).
* In a TF1 graph (``tf.compat.v1.Session``) nothing orders stateful ops, so each collective
  gets a control dependency on the one created before it (see
  :func:`._host_op._tf1_predecessor`).
* Errors: a mismatch between ranks is ``tf.errors.FailedPreconditionError``, an invalid
  argument ``tf.errors.InvalidArgumentError``, eagerly and in graphs (see :func:`_execute`).

Names: ops are matched across ranks by name. Inside a graph an unnamed op gets a name derived
at trace time from its input tensor's name (``HorovodAllreduce_<tensor name>``, under the
current name scope unless ``ignore_name_scope``), made unique within the graph by a ``_<n>``
suffix, so every step of a traced function reuses the same names and the engine's response
cache hits. In eager mode unnamed ops are named by ``ferrovod._api``'s call-order counters,
so every rank must issue them in the same order.

Gradients follow Horovod 0.28.1 and ``ferrovod.torch`` (registered with ``tf.custom_gradient``,
eager and graph): allreduce -> allreduce of the gradient with the same op and scale factors;
allgather -> Average-allreduce of the gradient, this rank's rows; broadcast -> Average-allreduce
on the root, zeros elsewhere; alltoall -> alltoall back with the received splits;
reducescatter -> allgather of the gradient times the scale factors (and the set size for Sum).

The host-op plumbing (running a body eagerly or as a ``numpy_function``, the error classes,
dtype checks and op names) is in ``_host_op``, the collectives and their gradients in
``_collectives``; this module adds ``init`` and the graph-time queries, and holds every name
of Horovod's ``mpi_ops`` and the helpers the rest of ``ferrovod.tensorflow`` uses from it.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import numpy as np
import tensorflow as tf

from .. import _api
from .. import process_sets as _ps
from .._api import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
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
from ..exceptions import InvalidArgumentError, MismatchError
from ..common.basics import HorovodBasics
from ..process_sets import ProcessSet, global_process_set
from ._collectives import (
    _allreduce,
    _assign_broadcast,
    _gather,
    _grouped_allreduce,
    _grouped_reducescatter,
    _reducescatter,
    _var_label,
    allgather,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_reducescatter,
    join,
    reducescatter,
)
from ._host_op import (
    TFInvalidArgumentError,
    TFMismatchError,
    _check_dtype,
    _execute,
    _normalize_name,
    _on_device,
    _rest_shape,
    _set_size,
    _to_tensor,
    _unique_graph_name,
    _with_shape,
    tf_error,
)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "join", "barrier",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "cuda_built", "ddl_built", "ccl_built", "rocm_built",
]

# Horovod's per-framework basics object (see ferrovod.common.basics).
_basics = HorovodBasics()


# ----------------------------------------------------------------------------- init


def init(comm: Optional[Any] = None, process_sets: Optional[Any] = None) -> None:
    """Starts ferrovod (``ferrovod.init``), then gives TensorFlow's thread pools this rank's
    share of the cores.

    When several ranks run on this host and the launcher gave this process a thread share
    (``OMP_NUM_THREADS``, set by ``ferrovodrun`` or by ``init()`` under mpirun/srun), and
    TensorFlow's runtime has not started yet and the user has not configured it, TensorFlow's
    intra-op parallelism is set to that share and its inter-op parallelism to 2 — otherwise
    two ranks on two cores would each run a pool as wide as the machine. Once TensorFlow's
    runtime has started (any tensor was created) its pools cannot change; they are left as
    they are and a debug message says so.
    """
    _api.init(comm=comm, process_sets=process_sets)
    _share_tf_threads()


def _share_tf_threads() -> None:
    import os

    from .. import _logging

    if _api.local_size() <= 1:
        return
    try:
        share = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return
    if share <= 0:
        return
    threading = tf.config.threading
    try:
        if threading.get_intra_op_parallelism_threads() == 0:
            threading.set_intra_op_parallelism_threads(share)
        if threading.get_inter_op_parallelism_threads() == 0:
            threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:
        _logging.LOGGER.debug("TensorFlow's runtime is already initialised: its thread pools "
                              "keep their sizes (call ferrovod.tensorflow.init() before "
                              "creating tensors to give each rank its share of the cores)")
        return
    _logging.LOGGER.debug("TensorFlow threads: intra-op %d, inter-op %d",
                          threading.get_intra_op_parallelism_threads(),
                          threading.get_inter_op_parallelism_threads())


# ----------------------------------------------------------------------------- graph-time queries


def _set_by_id(process_set_id: int) -> ProcessSet:
    if int(process_set_id) == 0:
        return global_process_set
    for ps in _ps._registered:
        if ps.process_set_id == int(process_set_id):
            return ps
    raise TFInvalidArgumentError(f"no registered process set has id {process_set_id}")


def _query_op(fn: Callable[[], int], name: Optional[str]) -> tf.Tensor:
    """An int32 scalar whose value is read when the op runs (graph) or now (eager)."""
    def body() -> List[np.ndarray]:
        return [np.asarray(fn(), dtype=np.int32)]

    out = _execute(body, [], [tf.int32], name or "FerrovodQuery", collective=False)[0]
    return _with_shape(out, tf.TensorShape([]))


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's global rank, read when the graph runs."""
    return _query_op(_api.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's local rank, read when the graph runs."""
    return _query_op(_api.local_rank, name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set ``process_set_id``, read when the graph runs."""
    return _query_op(lambda: _set_size(_set_by_id(process_set_id)), name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host, read when the graph runs."""
    return _query_op(_api.local_size, name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 when this process belongs to process set ``process_set_id``, else 0 (int32)."""
    return _query_op(lambda: int(bool(_set_by_id(process_set_id).included())), name)
