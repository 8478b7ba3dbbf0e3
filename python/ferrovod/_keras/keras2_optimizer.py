"""The Keras 2 (``tf_keras``) side of ``DistributedOptimizer``: current and legacy optimizers.

Where a Keras 2 update passes. ``model.fit``'s ``train_step`` and ``minimize`` compute the
gradients with ``compute_gradients`` (current optimizers) or ``_compute_gradients`` (legacy
``OptimizerV2``), then call ``apply_gradients``; the v1 graph loop calls ``get_gradients``.
Horovod reduced in those three, and Horovod's Keras 2 tests call ``_compute_gradients``
then ``apply_gradients`` themselves, expecting reduced gradients in between; so the
reduction sits there too. A custom loop that takes its gradients from a ``tf.GradientTape``
and calls ``apply_gradients`` never passes them (where Horovod silently trained each rank on
its own gradients): ``apply_gradients`` reduces whatever did not come through one of them
since the last update, so every update is reduced exactly once. The mark is set while the
step's Python runs (eagerly, or while ``tf.function`` traces it), which is when the graph's
single reduction is placed.

``backward_passes_per_step=N``: the computed gradients come back unreduced, and
``apply_gradients`` adds them to accumulators; every N-th call reduces the sum and applies
it, the others only advance ``iterations`` (as the Keras 3 wrapper does).

Keras 2 runs only on TensorFlow, so this module may import it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

from . import _backend, _flavor
from .optimizer import _CommonMixin, carry_state_now

__all__ = ["Keras2Mixin"]


def _split(grads_and_vars: Any) -> Tuple[List[Any], List[Any]]:
    pairs = list(grads_and_vars)
    return [g for g, _ in pairs], [v for _, v in pairs]


class Keras2Mixin(_CommonMixin):
    """Put in front of a Keras 2 optimizer's class by ``DistributedOptimizer``."""

    _fv_keras2 = True

    # ------------------------------------------------------------------ gradients

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> List[Any]:
        """The wrapped optimizer's ``(gradient, variable)`` pairs, gradients reduced."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> List[Any]:
        base = super()
        if hasattr(base, "_compute_gradients"):  # legacy OptimizerV2
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)  # type: ignore[misc]
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)  # type: ignore[misc]
        grads, variables = _split(pairs)
        return list(zip(self._fv_reduce_computed(grads, variables), variables))

    def get_gradients(self, loss: Any, params: Any) -> List[Any]:
        """The v1 graph loop's gradients (legacy optimizers), reduced."""
        grads = super().get_gradients(loss, params)  # type: ignore[misc]
        return self._fv_reduce_computed(list(grads), tf.nest.flatten(params))

    def _fv_reduce_computed(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        if self._fv.bpps > 1:
            return grads  # reduced as a sum at the N-th apply_gradients
        self._fv_check_variables(variables)
        self._fv.reduced = True
        return self._fv_reduce(grads, variables)

    # ------------------------------------------------------------------ update

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        """Applies the gradients, reducing them first unless they came through this
        optimizer's ``compute_gradients`` (see the module docstring); with
        ``backward_passes_per_step=N`` only every N-th call updates the variables."""
        grads, variables = _split(grads_and_vars)
        st = self._fv
        already, st.reduced = st.reduced, False
        if _backend.in_xla_context():
            raise ValueError(_backend.JIT_MESSAGE.format(what="DistributedOptimizer"))
        self._fv_build(variables)
        if st.bpps > 1:
            return self._fv_apply_aggregated(grads, variables, args, kwargs)
        if not already and grads:
            self._fv_check_variables(variables)
            grads = self._fv_reduce(grads, variables)
        return super().apply_gradients(zip(grads, variables), *args, **kwargs)  # type: ignore[misc]

    def _fv_build(self, variables: List[Any]) -> None:
        """Creates the slots (and the accumulators) outside any ``tf.cond`` or graph, as the
        wrapped ``apply_gradients`` would on its first call, and takes over the state of the
        optimizer this one was made from."""
        st = self._fv
        with_grads = [v for v in variables if v is not None]
        with tf.init_scope():
            if st.carry is not None:
                carry_state_now(self, with_grads)  # builds the slots too
            elif st.bpps > 1:
                _flavor.build_optimizer(self, with_grads)
            if st.bpps > 1:
                self.iterations  # noqa: B018 - a legacy optimizer creates it on first read
                if st.counter is None:
                    st.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                             name="ferrovod_backward_pass")
                    st.accs = {}
                accs: Dict[Any, Any] = st.accs
                for v in with_grads:
                    if v.ref() not in accs:
                        accs[v.ref()] = tf.Variable(tf.zeros(v.shape, dtype=v.dtype.base_dtype),
                                                    trainable=False,
                                                    name="ferrovod_gradient_sum")

    def _fv_apply_aggregated(self, grads: List[Any], variables: List[Any], args: Sequence[Any],
                             kwargs: Dict[str, Any]) -> Any:
        st = self._fv
        n = st.bpps
        accs: List[Optional[Any]] = [None if g is None else st.accs[v.ref()]
                                     for g, v in zip(grads, variables)]
        for g, a in zip(grads, accs):
            if a is not None:
                a.assign_add(tf.convert_to_tensor(g))  # IndexedSlices become dense here
        count = st.counter.read_value()

        def reduce_and_apply() -> Any:
            total = [None if a is None else a.read_value() for a in accs]
            if st.average_aggregated:
                total = [None if t is None else t / n for t in total]
            self._fv_check_variables(variables)
            reduced = self._fv_reduce(total, variables)
            base = super(Keras2Mixin, self)
            base.apply_gradients(zip(reduced, variables), *args, **kwargs)  # type: ignore[misc]
            for a in accs:
                if a is not None:
                    a.assign(tf.zeros_like(a))
            return tf.constant(True)

        def only_count() -> Any:
            self.iterations.assign_add(1)
            return tf.constant(False)

        tf.cond(tf.equal(count, n - 1), reduce_and_apply, only_count)
        st.counter.assign(tf.math.floormod(count + 1, n))
        return self.iterations

