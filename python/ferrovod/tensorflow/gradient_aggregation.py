"""Horovod's ``LocalGradientAggregationHelper``: gradients summed locally over
``backward_passes_per_step`` calls and reduced across ranks only on the last of them.

The legacy (``tf.compat.v1.train.Optimizer``) ``DistributedOptimizer`` uses it for
``backward_passes_per_step > 1``, as Horovod's does, and scripts that built their own
optimizer wrappers on Horovod's class can keep using it. Unlike Horovod's (graph mode only),
it works eagerly, inside ``tf.function`` and in TF1 graphs: its state is TensorFlow variables
created outside any function (``tf.init_scope``) on the first call, and every decision is a
``tf.cond`` on the pass counter, which every rank advances alike, so every rank takes the same
branch and the reduction (a host op) runs only on the passes that reduce.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import tensorflow as tf

from ..process_sets import ProcessSet, global_process_set


class LocalGradientAggregationHelper:
    """Aggregates gradients locally and reduces them across ranks once every
    ``backward_passes_per_step`` calls of :meth:`compute_gradients`; :meth:`apply_gradients`
    applies them on those calls only (Horovod's class and arguments; ``rank`` and
    ``optimizer_type`` are accepted for compatibility: the variables need no session of their
    own here).

    ``allreduce_func(grads, variables)`` reduces a list of gradients (None entries allowed);
    ``average_aggregated_gradients`` divides the sum of the passes by their number; gradients
    of variables given to :meth:`register_local_var` are not reduced, and are divided by the
    set size when ``scale_local_gradients``.
    """

    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(self, backward_passes_per_step: int,
                 allreduce_func: Callable[[List[Any], List[Any]], List[Any]],
                 sparse_as_dense: bool, average_aggregated_gradients: bool, rank: int,
                 optimizer_type: str, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True, name: str = "") -> None:
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self._allreduce_grads = allreduce_func
        self.name = name
        self.backward_passes_per_step = int(backward_passes_per_step)
        self.average_aggregated_gradients = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.rank = rank
        self.optimizer_type = optimizer_type
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.locally_aggregated_grads: List[tf.Variable] = []
        self.counter: Optional[tf.Variable] = None
        # Position of each gradient that is not None among the aggregation variables.
        self.not_none_indexes: Dict[int, int] = {}
        self.num_none_grad_updates = 0
        self._local_vars: set = set()

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var``'s gradient local: never reduced across ranks."""
        self._local_vars.add(var.ref())

    def _maybe_convert_grad(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if self.sparse_as_dense:
                return tf.convert_to_tensor(grad)
            raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 "
                             "and `sparse_as_dense` is False.")
        return grad

    def _init_aggregation_vars(self, grads: Sequence[Any]) -> None:
        if self.counter is not None:
            return
        grads = [None if g is None else self._maybe_convert_grad(g) for g in grads]
        with tf.init_scope():
            scope = f"aggregation_variables_{self.name}{self.rank}"
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                       name=f"{scope}/aggregation_counter")
            for idx, grad in enumerate(grads):
                if grad is None:
                    self.num_none_grad_updates += 1
                    continue
                self.not_none_indexes[idx] = len(self.locally_aggregated_grads)
                self.locally_aggregated_grads.append(tf.Variable(
                    tf.zeros(grad.shape, dtype=grad.dtype), trainable=False,
                    name=f"{scope}/{idx}"))

    def _reduce_aggregated(self, variables: Sequence[Any]) -> List[Any]:
        """The aggregated gradients reduced across ranks (local ones kept, scaled), the counter
        reset, divided by the number of passes when averaging."""
        sums = [a.read_value() for a in self.locally_aggregated_grads]
        present = [v for i, v in enumerate(variables) if i in self.not_none_indexes]
        shared = [(g, v) for g, v in zip(sums, present) if v.ref() not in self._local_vars]
        reduced = iter(self._allreduce_grads([g for g, _ in shared], [v for _, v in shared])
                       if shared else [])
        size = float(self.process_set.size() or 1)
        out = []
        for g, v in zip(sums, present):
            if v.ref() not in self._local_vars:
                out.append(next(reduced))
            else:
                out.append(g / size if self.scale_local_gradients else g)
        with tf.control_dependencies(out):
            reset = self.counter.assign(0)
        with tf.control_dependencies([reset]):
            divisor = self.backward_passes_per_step if self.average_aggregated_gradients else 1
            return [tf.identity(g / tf.cast(divisor, g.dtype)) for g in out]

    def compute_gradients(self, grads: Sequence[Any], vars: Sequence[Any]) -> List[Any]:
        """Adds ``grads`` to the local sums and, on every ``backward_passes_per_step``-th call,
        returns the sums reduced across ranks; on the other calls, ``grads`` as given (dense).
        None gradients stay None."""
        grads, variables = list(grads), list(vars)
        self._init_aggregation_vars(grads)
        present = [self._maybe_convert_grad(g) for g in grads if g is not None]
        first = tf.equal(self.counter, 0)
        updates = [a.assign(tf.where(first, g, a + g))
                   for a, g in zip(self.locally_aggregated_grads, present)]
        with tf.control_dependencies(updates):
            counted = self.counter.assign_add(1)
        with tf.control_dependencies([counted]):
            result = tf.cond(tf.equal(self.counter, self.backward_passes_per_step),
                             lambda: self._reduce_aggregated(variables),
                             lambda: [tf.identity(g) for g in present])
        if not isinstance(result, (list, tuple)):
            result = [result]
        return [result[self.not_none_indexes[i]] if i in self.not_none_indexes else None
                for i in range(len(grads))]

    def apply_gradients(self, apply_grads_closure: Callable[[], Any], optimizer: Any,
                        *args: Any, **kwargs: Any) -> Any:
        """Runs ``apply_grads_closure`` on the calls that reduced (the counter back at 0); on
        the others advances ``optimizer.iterations`` (where it has one) and ``global_step``
        (a keyword argument) instead, so step counts stay as without aggregation."""
        pairs = list(args[0]) if args else []
        grads = [g for g, _ in pairs if g is not None]

        def skip() -> Any:
            its = getattr(optimizer, "iterations", None)
            ops = [] if its is None else [its.assign_add(1)]
            step = kwargs.get("global_step")
            if step is not None:
                ops.append(step.assign_add(tf.constant(1, dtype=step.dtype)))
            return tf.group(*ops)

        def apply() -> Any:
            done = apply_grads_closure()
            return tf.no_op() if done is None else tf.group(done)

        with tf.control_dependencies(grads):
            return tf.cond(tf.equal(self.counter, 0), apply, skip)
