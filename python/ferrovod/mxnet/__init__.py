"""``ferrovod.mxnet``: a drop-in for ``horovod.mxnet`` (MXNet 1.9, NDArrays and Gluon).

``import ferrovod.mxnet as hvd`` in place of ``import horovod.mxnet as hvd``: the collectives
take and return NDArrays (see :mod:`ferrovod.mxnet.mpi_ops`), ``DistributedOptimizer`` wraps an
``mx.optimizer.Optimizer`` and ``DistributedTrainer`` is a Gluon ``Trainer`` whose gradients are
averaged across ranks, and ``broadcast_parameters`` copies rank 0's parameters everywhere,
including Gluon parameters whose initialization is deferred to the first forward pass. Nothing
is compiled against MXNet: the same wheel serves every framework.
"""

from __future__ import annotations

from .._api import exit_if_parameter_server

# Before MXNet is imported: importing it in a server or scheduler process starts that role.
exit_if_parameter_server()

import types  # noqa: E402
import warnings
from collections import OrderedDict, defaultdict
from typing import Any, Dict, List, Optional, Union

import mxnet as mx

from ..common.util import split_list
from .compression import Compression
from .functions import allgather_object, broadcast_object
from .kvstore import KVStore
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ProcessSet,
    Sum,
    add_process_set,
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    init,
    is_homogeneous,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    reducescatter,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

__all__ = [
    "init", "shutdown", "is_initialized", "start_timeline", "stop_timeline",
    "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size", "is_homogeneous",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather",
    "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "barrier", "join", "broadcast_object", "allgather_object",
    "broadcast_parameters", "DistributedOptimizer", "DistributedTrainer", "Compression", "KVStore",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "split_list",
]


def _averaging(gradient_predivide_factor: float, process_set: ProcessSet) -> Dict[str, Any]:
    """The reduction arguments of a gradient average split by ``gradient_predivide_factor``
    (``1 / factor`` before the sum, ``factor / size`` after it)."""
    return dict(op=Average, prescale_factor=1.0 / gradient_predivide_factor,
                postscale_factor=gradient_predivide_factor, process_set=process_set)


class DistributedOptimizer(mx.optimizer.Optimizer):
    """Wraps an ``mx.optimizer.Optimizer``: each update first averages the gradient across
    the set, in place (split ``1 / gradient_predivide_factor`` before the sum and
    ``gradient_predivide_factor / size`` after it), then lets the wrapped optimizer update.
    With several indices at once, ``num_groups > 0`` reduces them in that many groups."""

    def __init__(self, optimizer: mx.optimizer.Optimizer, gradient_predivide_factor: float = 1.0,
                 num_groups: int = 0, process_set: ProcessSet = global_process_set) -> None:
        # The wrapped optimizer holds the state; this object only forwards (see __getattr__).
        self._optimizer = optimizer
        self._gradient_predivide_factor = gradient_predivide_factor
        self._num_groups = num_groups
        self._process_set = process_set

    def __getattr__(self, item: str) -> Any:
        return getattr(self._optimizer, item)

    def create_state(self, index: Any, weight: Any) -> Any:
        return self._optimizer.create_state(index, weight)

    def create_state_multi_precision(self, index: Any, weight: Any) -> Any:
        return self._optimizer.create_state_multi_precision(index, weight)

    def _do_allreduce(self, index: Any, grad: Any) -> None:
        if self._process_set.size() == 1:
            return
        scale = _averaging(self._gradient_predivide_factor, self._process_set)
        if isinstance(index, (tuple, list)):
            if self._num_groups > 0:
                for grads, indices in zip(split_list(grad, self._num_groups),
                                          split_list(index, self._num_groups)):
                    grouped_allreduce_(grads, name=f"{indices[0]}:{indices[-1]}", **scale)
            else:
                for i, g in zip(index, grad):
                    allreduce_(g, name=str(i), **scale)
        else:
            allreduce_(grad, name=str(index), **scale)

    def update(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        if self._process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update(index, weight, grad, state)

    def update_multi_precision(self, index: Any, weight: Any, grad: Any, state: Any) -> None:
        if self._process_set.included():
            self._do_allreduce(index, grad)
        self._optimizer.update_multi_precision(index, weight, grad, state)

    def set_learning_rate(self, lr: float) -> None:
        self._optimizer.set_learning_rate(lr)

    def set_lr_mult(self, args_lr_mult: Dict[Any, float]) -> None:
        self._optimizer.set_lr_mult(args_lr_mult)

    def set_wd_mult(self, args_wd_mult: Dict[Any, float]) -> None:
        self._optimizer.set_wd_mult(args_wd_mult)


class DistributedTrainer(mx.gluon.Trainer):
    """A Gluon ``Trainer`` that averages gradients across the set (instead of a KVStore's
    push/pull) before each update.

    ``compression`` is applied to each gradient for the reduction; ``gradient_predivide_factor``
    splits the average (``1 / factor`` before the sum, ``factor / size`` after it); ``prefix``
    tells apart the gradient names of several trainers in one program; ``num_groups > 0``
    reduces the gradients in that many grouped allreduces (per dtype).
    """

    def __init__(self, params: Any, optimizer: Any, optimizer_params: Optional[dict] = None,
                 compression: Any = Compression.none, gradient_predivide_factor: float = 1.0,
                 prefix: Optional[str] = None, num_groups: int = 0,
                 process_set: ProcessSet = global_process_set) -> None:
        self._compression = compression
        self._process_set = process_set
        if isinstance(optimizer, DistributedOptimizer):
            optimizer = optimizer._optimizer
            warnings.warn("DistributedTrainer does not take DistributedOptimizer as its "
                          "optimizer. We have unwrapped it for you.")
        # The same parameter order on every rank: gradient names are positions.
        if isinstance(params, dict):
            params = OrderedDict(params)
        elif isinstance(params, (list, tuple)):
            params = sorted(params)
        super().__init__(params, optimizer, optimizer_params=optimizer_params, kvstore=None)
        if prefix is not None and not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string, got {prefix!r}")
        self._gradient_predivide_factor = gradient_predivide_factor
        self._prefix = prefix or ""
        self._num_groups = num_groups

    def _allreduce_grads(self) -> None:
        if self._process_set.size() == 1 or not self._process_set.included():
            return
        scale = _averaging(self._gradient_predivide_factor, self._process_set)
        entries = []
        for i, param in enumerate(self._params):
            if param.grad_req != "null":
                grad = param.list_grad()[0]
                compressed, ctx = self._compression.compress(grad)
                entries.append((grad, compressed, ctx, self._prefix + str(i)))
        if self._num_groups > 0:
            for group in split_list(entries, self._num_groups):
                by_dtype: Dict[Any, List[Any]] = defaultdict(list)
                for e in group:
                    by_dtype[e[1].dtype].append(e)
                for same in by_dtype.values():
                    grouped_allreduce_([e[1] for e in same],
                                       name=f"{same[0][3]}:{same[-1][3]}", **scale)
        else:
            for _, compressed, _, name in entries:
                allreduce_(compressed, name=name, **scale)
        if self._compression is not Compression.none:
            for grad, compressed, ctx, _ in entries:
                grad[:] = self._compression.decompress(compressed, ctx)


def _broadcast_after_init(param: Any, root_rank: int, name: str) -> Any:
    """``param._init_impl`` followed by a broadcast of the initialized data: a deferred
    parameter is broadcast when the first forward pass initializes it."""
    init_impl = param._init_impl

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        init_impl(*args, **kwargs)
        broadcast_(self.data(), root_rank=root_rank, name=name)

    return wrapped


def broadcast_parameters(params: Union[Dict[str, Any], Any], root_rank: int = 0,
                         prefix: Optional[str] = None) -> None:
    """Sets every rank's parameters to ``root_rank``'s: a dict of NDArrays (e.g.
    ``Module.get_params()``) or of Gluon ``Parameter`` s, or a Gluon ``ParameterDict``
    (``Block.collect_params()``). Parameters whose initialization is deferred are broadcast
    right after the first forward pass initializes them. ``prefix`` tells apart the names of
    several calls in one program."""
    if size() == 1:
        return
    if prefix is not None and not isinstance(prefix, str):
        raise ValueError(f"prefix must be a string, got {prefix!r}")
    prefix = prefix or ""
    valid: tuple = (dict,)
    param_dict = getattr(mx.gluon.parameter, "ParameterDict", None)
    if param_dict is not None:
        valid = (dict, param_dict)
    if not isinstance(params, valid):
        raise ValueError(f"invalid params of type: {type(params)}")
    tensors, names = [], []
    for name, p in sorted(params.items()):
        try:
            tensors.append(p.data() if isinstance(p, mx.gluon.parameter.Parameter) else p)
            names.append(prefix + str(name))
        except mx.gluon.parameter.DeferredInitializationError:
            p._init_impl = types.MethodType(_broadcast_after_init(p, root_rank, prefix + str(name)),
                                            p)
    for tensor, name in zip(tensors, names):
        broadcast_(tensor, root_rank, name=name)
