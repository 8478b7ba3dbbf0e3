"""``ferrovod.tensorflow``: a drop-in for ``horovod.tensorflow`` on TensorFlow 2.

``import ferrovod.tensorflow as hvd`` and a Horovod TensorFlow script runs unchanged, with
nothing compiled: the same names, arguments and semantics (``hvd.init()``, ``hvd.allreduce``,
``hvd.DistributedGradientTape``, ``hvd.broadcast_variables``, ...). Ops take tensors (or
anything ``tf.convert_to_tensor`` accepts) and return tensors, eagerly and inside
``tf.function``; see :mod:`ferrovod.tensorflow.mpi_ops` for how they run and how they are
named. Every engine dtype works: uint8, int8, int16, int32, int64, float16, bfloat16, float32,
float64, and bool, uint16, uint32, uint64 for allgather, broadcast and alltoall.

Errors are the classes Horovod raises: ranks that disagree ->
``tf.errors.FailedPreconditionError``, invalid arguments -> ``tf.errors.InvalidArgumentError``
(eagerly these are also ``ferrovod.MismatchError`` / ``ferrovod.InvalidArgumentError``); a
lost peer eagerly raises ferrovod's ``RankFailureError`` (a ``HorovodInternalError``), inside
a graph a ``tf.errors.UnknownError`` carrying its message. In TF1 graphs (``tf.compat.v1.Session``) the
collectives run in the order they were created (see ``_host_op._tf1_predecessor``).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import tensorflow as tf

from .. import _api, _frameworks
from .._api import build_info
from ..common.util import (
    get_average_backwards_compatibility_fun,
    gpu_available,
    num_rank_is_power_2,
    split_list,
)
from ..exceptions import (
    FerrovodError,
    FerrovodTimeoutError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    RankFailureError,
    ShutdownError,
)
from ..process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from . import mpi_ops as _ops
from ._gradients import reduce_gradients
from .compression import Compression
from .functions import (
    allgather_object,
    broadcast_global_variables,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
)
from . import util
from .gradient_aggregation import LocalGradientAggregationHelper
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (
    _allreduce,
    _grouped_allreduce,
    _grouped_reducescatter,
    _reducescatter,
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    process_set_included_op,
    rank,
    rank_op,
    rocm_built,
    shutdown,
    size,
    size_op,
    start_timeline,
    stop_timeline,
)
from .util import _cache, _executing_eagerly, _make_subgraph, refs_to_vars, vars_to_refs

#: Horovod's rule for the deprecated ``average`` argument (``op`` wins; both is an error).
handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_api)
check_num_rank_power_of_2 = num_rank_is_power_2

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_variables", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "allgather_object",
    "Compression", "DistributedGradientTape", "PartialDistributedGradientTape",
    "BroadcastGlobalVariablesHook", "handle_average_backwards_compatibility",
    "check_num_rank_power_of_2", "split_list", "gpu_available",
    "DistributedOptimizer", "SyncBatchNormalization", "LocalGradientAggregationHelper",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "FerrovodError", "HorovodInternalError", "HostsUpdatedInterrupt", "RankFailureError",
    "FerrovodTimeoutError", "ShutdownError", "MismatchError", "InvalidArgumentError",
    "NotInitializedError",
    "build_info", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "cuda_built", "ddl_built", "ccl_built", "rocm_built",
]


def _resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    return int(_api._resolve_op(op, average))


def _check_sparse(op: int, prescale_factor: float, postscale_factor: float) -> None:
    """Horovod's rules (and exception classes) for ``tf.IndexedSlices``."""
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse "
                                  "tensors. As a workaround please pass sparse_as_dense=True")
    if op not in (Average, Sum):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _average_values(values: tf.Tensor, n: int) -> tf.Tensor:
    """``values / n`` with TensorFlow's true division, as Horovod averages sparse values:
    floats keep their dtype, integers become floats (int8/16, uint8 -> float32; int32/64 ->
    float64) rather than being truncated."""
    return tf.math.truediv(values, tf.cast(n, values.dtype))


def _sparse_allreduce(t: tf.IndexedSlices, op: int, name: Optional[str],
                      ignore_name_scope: bool, process_set: ProcessSet) -> tf.IndexedSlices:
    """``tf.IndexedSlices``: allgather of values and indices (one group), values divided by
    the set size for Average — duplicates across ranks add up when densified."""
    values, indices = _ops._gather([t.values, t.indices], name, ignore_name_scope, process_set,
                                   False)
    if op == Average:
        values = _average_values(values, _ops._set_size(process_set))
    return tf.IndexedSlices(values, indices, dense_shape=t.dense_shape)


def allreduce(tensor: Any, average: Optional[bool] = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none,
              op: Optional[int] = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set,
              ignore_name_scope: bool = False) -> Any:
    """Reduces ``tensor`` across the set (default: Average) and returns a tensor of the same
    shape and dtype. Differentiable (the gradient is the allreduce of the gradient with the
    same op and scale factors).

    ``tf.IndexedSlices`` are allgathered (values and indices) instead, values divided by the
    set size for Average; only Sum and Average, without scale factors. ``compression``
    compresses dense tensors before and decompresses after. ``average`` is the deprecated
    boolean form of ``op``. ``device_dense`` / ``device_sparse`` are accepted and ignored.
    """
    del device_dense, device_sparse
    rop = _resolve_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        _check_sparse(rop, prescale_factor, postscale_factor)
        return _sparse_allreduce(tensor, rop, name, ignore_name_scope, process_set)
    t = _ops._to_tensor(tensor)
    compressed, ctx = compression.compress(t)
    out = _ops._allreduce(compressed, name=name, op=rop, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, ignore_name_scope=ignore_name_scope,
                          process_set=process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors: Sequence[Any], average: Optional[bool] = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: Optional[int] = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set,
                      ignore_name_scope: bool = False, name: Optional[str] = None) -> List[Any]:
    """Reduces a list of tensors negotiated as ONE engine group (one host op in a graph).
    Differentiable. ``tf.IndexedSlices`` entries are reduced as in :func:`allreduce`, each on
    its own (named ``<name>.<i>`` when ``name`` is given)."""
    del device_dense, device_sparse
    rop = _resolve_op(op, average)
    tensors = list(tensors)
    out: List[Any] = [None] * len(tensors)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    if len(dense) < len(tensors):
        _check_sparse(rop, prescale_factor, postscale_factor)
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            out[i] = _sparse_allreduce(t, rop, None if name is None else f"{name}.{i}",
                                       ignore_name_scope, process_set)
    pairs = [compression.compress(_ops._to_tensor(tensors[i])) for i in dense]
    reduced = _ops._grouped_allreduce([c for c, _ in pairs], name=name, op=rop,
                                      prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor,
                                      ignore_name_scope=ignore_name_scope,
                                      process_set=process_set)
    for i, r, (_, ctx) in zip(dense, reduced, pairs):
        out[i] = compression.decompress(r, ctx)
    return out


def _takes_part(process_set: ProcessSet) -> bool:
    return bool(process_set.included()) and _ops._set_size(process_set) > 1


def _allreduce_cond(tensor: Any, *args: Any, process_set: ProcessSet = global_process_set,
                    **kwargs: Any) -> Any:
    """Horovod's helper: :func:`allreduce` when this rank is in ``process_set`` and the set has
    more than one rank, else ``tensor`` unchanged."""
    if not _takes_part(process_set):
        return tensor
    return allreduce(tensor, *args, process_set=process_set, **kwargs)


def _grouped_allreduce_cond(tensors: Sequence[Any], *args: Any,
                            process_set: ProcessSet = global_process_set,
                            **kwargs: Any) -> Any:
    """Horovod's helper: :func:`grouped_allreduce` when this rank is in ``process_set`` and the
    set has more than one rank, else ``tensors`` unchanged."""
    if not _takes_part(process_set):
        return tensors
    return grouped_allreduce(tensors, *args, process_set=process_set, **kwargs)


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: int = Average, name: Optional[str] = None,
                  process_set: ProcessSet = global_process_set, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduces across the set (Sum or Average) and returns this rank's rows of dim 0 (the
    lowest set ranks get one extra row when dim 0 does not divide evenly). Differentiable."""
    del device_dense
    t = _ops._to_tensor(tensor)
    compressed, ctx = compression.compress(t)
    out = _ops.reducescatter(compressed, name=name, op=op, ignore_name_scope=ignore_name_scope,
                             process_set=process_set, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                          name: Optional[str] = None,
                          ignore_name_scope: bool = False) -> List[tf.Tensor]:
    """Reducescatters a list of tensors negotiated as one unit. Differentiable."""
    del device_dense
    pairs = [compression.compress(_ops._to_tensor(t)) for t in tensors]
    outs = _ops.grouped_reducescatter([c for c, _ in pairs], name=name, op=op,
                                      ignore_name_scope=ignore_name_scope,
                                      process_set=process_set, prescale_factor=prescale_factor,
                                      postscale_factor=postscale_factor)
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, pairs)]


# ----------------------------------------------------------------------------- optimizers


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` also reduces the
    gradients across ranks; everything else is forwarded to the wrapped optimizer."""

    def __init__(self, optimizer: tf.compat.v1.train.Optimizer, name: Optional[str],
                 use_locking: bool, compression: Any, sparse_as_dense: bool, op: int,
                 gradient_predivide_factor: float, groups: Any, process_set: ProcessSet,
                 scale_local_gradients: bool, backward_passes_per_step: int = 1,
                 average_aggregated_gradients: bool = False) -> None:
        if name is None:
            name = f"Distributed{type(optimizer).__name__}"
        super().__init__(name=name, use_locking=use_locking)
        self._optimizer = optimizer
        self._fv = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                        gradient_predivide_factor=gradient_predivide_factor, groups=groups,
                        process_set=process_set, scale_local_gradients=scale_local_gradients)
        self._local_vars: List[Any] = []
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._agg_helper: Optional[LocalGradientAggregationHelper] = None
        if backward_passes_per_step > 1:
            shared = dict(self._fv, local_variables=(), scale_local_gradients=False)
            self._agg_helper = LocalGradientAggregationHelper(
                backward_passes_per_step=backward_passes_per_step,
                allreduce_func=lambda grads, variables: reduce_gradients(
                    list(grads), list(variables), name_prefix=self._name, **shared),
                sparse_as_dense=sparse_as_dense,
                average_aggregated_gradients=average_aggregated_gradients,
                rank=rank(), optimizer_type=LocalGradientAggregationHelper._OPTIMIZER_TYPE_LEGACY,
                process_set=process_set, scale_local_gradients=scale_local_gradients, name=name)

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var``'s gradient local (not reduced; divided by the set size when
        ``scale_local_gradients``)."""
        if self._agg_helper is not None:
            self._agg_helper.register_local_var(var)
        self._local_vars.append(var)

    def compute_gradients(self, *args: Any, **kwargs: Any) -> List[Any]:
        """The wrapped optimizer's ``compute_gradients`` (eager with a callable loss, or a
        graph), then every gradient reduced across the set in one host op (with ``Adasum``,
        the local gradients: :meth:`apply_gradients` combines the steps)."""
        gradients = self._optimizer.compute_gradients(*args, **kwargs)
        if not gradients or self._fv["op"] == Adasum:
            return gradients
        grads, variables = zip(*gradients)
        if self._agg_helper is not None:
            return list(zip(self._agg_helper.compute_gradients(grads, variables), variables))
        reduced = reduce_gradients(list(grads), list(variables),
                                   local_variables=self._local_vars,
                                   name_prefix=self._name, **self._fv)
        return list(zip(reduced, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None,
                        name: Optional[str] = None) -> Any:
        """Calls the wrapped optimizer's ``apply_gradients``. With ``op=Adasum`` (Horovod's
        delta optimizer): the local step, then each variable's change combined across the set
        by Adasum, and the variable set to its value before the step plus the combination."""
        if self._agg_helper is not None:
            pairs = list(grads_and_vars)
            return self._agg_helper.apply_gradients(
                lambda: self._optimizer.apply_gradients(pairs, global_step=global_step,
                                                        name=name),
                self._optimizer, pairs, global_step=global_step, name=name)
        if self._fv["op"] != Adasum:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step,
                                                   name=name)
        pairs = list(grads_and_vars)
        variables = [v for g, v in pairs if g is not None]
        # A read is a snapshot: the update kernels copy a buffer that is still referenced.
        starts = [v.read_value() for v in variables]
        with tf.control_dependencies(starts):
            step = self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        with tf.control_dependencies([] if step is None else [step]):
            deltas = [v.read_value() - s for v, s in zip(variables, starts)]
        combined = grouped_allreduce(deltas, op=Adasum, compression=self._fv["compression"],
                                     process_set=self.process_set, name=f"{self._name}.delta")
        return tf.group(*[v.assign(s + c) for v, s, c in zip(variables, starts, combined)])

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, use_locking: bool = False,
                         device_dense: str = "", device_sparse: str = "",
                         compression: Any = Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Any = None, process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wraps an optimizer so that gradients are reduced across ranks before they are applied.

    * A Keras optimizer (``keras.optimizers.Optimizer``) is handed to
      ``ferrovod.tensorflow.keras.DistributedOptimizer`` with these arguments (as Horovod
      does).
    * A ``tf.compat.v1.train.Optimizer`` gets ``compute_gradients`` overridden: the wrapped
      one's gradients, reduced (``op``, ``compression``, ``sparse_as_dense``,
      ``gradient_predivide_factor``, ``groups``), with ``register_local_var`` to keep some
      local. Works eagerly (``minimize`` with a callable loss) and in graphs.
      ``backward_passes_per_step`` > 1 aggregates locally and reduces and applies on every
      N-th call (:class:`LocalGradientAggregationHelper`, as in Horovod, which allowed it in
      graphs only); ``op=Adasum`` combines each rank's step instead (Horovod's delta
      optimizer).
    """
    del device_dense, device_sparse
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if op == Adasum and backward_passes_per_step != 1:
            raise ValueError("op=Adasum combines each step's weight change: "
                             "backward_passes_per_step > 1 is not supported with it")
        if num_groups and groups is None:
            groups = int(num_groups)
        return _DistributedOptimizer(optimizer, name, use_locking, compression, sparse_as_dense,
                                     int(op), float(gradient_predivide_factor), groups,
                                     process_set, scale_local_gradients,
                                     int(backward_passes_per_step),
                                     bool(average_aggregated_gradients))
    from .._keras import _flavor  # the Keras layer: a Keras optimizer's package is imported

    if _flavor.is_optimizer(optimizer):
        from .keras import DistributedOptimizer as _KerasDistributedOptimizer

        return _KerasDistributedOptimizer(
            optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set, scale_local_gradients=scale_local_gradients)
    raise ValueError("Provided optimizer doesn't inherit from either legacy TensorFlow or "
                     f"Keras optimizer: {optimizer}")


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """TF1 ``SessionRunHook`` (``MonitoredTrainingSession``): when the session is created,
    sets every global variable to ``root_rank``'s value (Horovod's hook). ``device`` is
    accepted and ignored (the broadcast runs on the host)."""

    def __init__(self, root_rank: int, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self.bcast_op: Any = None
        self.device = device

    def begin(self) -> None:
        """Builds the broadcast op in the graph being finalized."""
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            self.bcast_op = broadcast_global_variables(self.root_rank)

    def after_create_session(self, session: Any, coord: Any) -> None:
        """Runs the broadcast once the variables are initialized or restored."""
        del coord
        session.run(self.bcast_op)


def __getattr__(name: str) -> Any:
    # SyncBatchNormalization is a Keras layer and elastic reaches Keras' state: import Keras
    # only when they are asked for.
    if name == "SyncBatchNormalization":
        from .sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    if name == "elastic":
        import importlib

        return importlib.import_module(".elastic", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _elastic_run(func: Any) -> Any:
    from .elastic import run

    return run(func)


# The Keras layer (ferrovod._keras) reaches this adapter through these hooks, never by
# importing it: on the TensorFlow backend it loads this module, which registers them.
_frameworks.register_keras_hooks("tensorflow", _frameworks.KerasHooks(
    init=init, reduce_gradients=reduce_gradients, compression=Compression,
    elastic_run=_elastic_run, broadcast_global_variables=broadcast_global_variables))
