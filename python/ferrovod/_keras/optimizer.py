"""``DistributedOptimizer`` for Keras: any Keras optimizer, gradients reduced before the update.

This module holds what both Kerases share and the Keras 3 wrapper; the Keras 2 (``tf_keras``)
wrapper is in :mod:`.keras2_optimizer`.

How it hooks in. Keras 3's ``BaseOptimizer.apply(grads, variables)`` is the single entry
point of an update: ``apply_gradients`` calls it, ``model.fit``'s ``train_step`` calls it
(inside ``tf.function`` on the TensorFlow backend, eagerly on torch), and wrappers such as
``LossScaleOptimizer`` call their inner optimizer through it. The wrapper overrides
``apply``: it reduces the gradients across ranks as one grouped allreduce, then hands them to
the wrapped class's ``apply``, so clipping, weight decay, loss-scale checks, EMA and
constraints all see the reduced gradient, identical on every rank — as in Horovod, where the
allreduce sits in ``_aggregate_gradients``, before clipping. (Keras' own private hooks run
later: ``_backend_update_step`` comes after clipping, and ``_clip_gradients`` only inside
Keras' accumulation branch.)

The wrapper is a subclass created on the fly with the wrapped class's name and module, built
with ``from_config`` from the wrapped optimizer's config: a model saved with it reloads as
the plain optimizer in a process without ferrovod, and its variables (slots) are exactly the
plain optimizer's, so checkpoints are interchangeable. Anything ferrovod keeps (gradient
accumulators for ``backward_passes_per_step``) lives outside Keras' variable tracking.

``backward_passes_per_step=N`` follows Horovod: each call adds the local gradients to
accumulators; every N-th call reduces the sum (divided by N with
``average_aggregated_gradients=True``) and applies it; the other calls only advance
``iterations``. Keras' own ``gradient_accumulation_steps`` is not used for this because it
always averages, adds its accumulators to the optimizer's saved variables and config, and
offers no public point between "accumulated" and "clipped" where the reduction could go.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .. import _api
from ..elastic import membership as _elastic
from .._api import Adasum, Average, Sum
from .._arguments import _instance_number
from ..process_sets import ProcessSet, global_process_set
from . import _backend, _flavor
from .compression import Compression

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "is_distributed",
           "variable_signature_check"]


class _CallableList(list):
    """A list that also answers ``()``: ``opt.variables`` and ``opt.variables()`` both work, as
    Horovod's wrapper allows for code written against older tf.keras optimizers."""

    def __call__(self) -> "_CallableList":
        return self


class _State:
    """ferrovod's per-optimizer settings and variables, kept in a plain object so that neither
    Keras' tracker nor TensorFlow's checkpoint tracking adds them to the optimizer's state."""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def _describe_var(v: Any) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", "?"))


def variable_signature_check(variables: Sequence[Any], process_set: ProcessSet, what: str,
                             name: str) -> None:
    """Raises the same ValueError on every rank of ``process_set`` when the ranks hold
    variables of different count, shapes or dtypes (one small allgather of the signatures), so
    a collective over mismatched models fails clearly instead of waiting for a missing tensor."""
    sig = [(tuple(int(d) for d in v.shape), _dtype_name(v), _describe_var(v))
           for v in variables]
    everyone = _api.allgather_object(sig, name=name, process_set=process_set)
    ranks = process_set.ranks
    ref_rank, ref = ranks[0], everyone[0]
    for r, other in zip(ranks[1:], everyone[1:]):
        if [s[:2] for s in other] == [s[:2] for s in ref]:
            continue
        if len(other) != len(ref):
            detail = f"rank {ref_rank} has {len(ref)} variables, rank {r} has {len(other)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(ref, other)) if a[:2] != b[:2])
            detail = (f"first difference at variable #{i}: {ref[i][2]!r} is {ref[i][1]}"
                      f"{list(ref[i][0])} on rank {ref_rank}, {other[i][2]!r} is {other[i][1]}"
                      f"{list(other[i][0])} on rank {r}")
        raise ValueError(f"{what}: the ranks hold different variables (a different model on "
                         f"some rank?): {detail}")


def _dtype_name(v: Any) -> str:
    dt = getattr(v, "dtype", "float32")
    return getattr(dt, "name", None) or str(dt).replace("torch.", "")


class _CommonMixin:
    """What the Keras 3 and Keras 2 wrappers share: ferrovod's settings, local variables and
    the reduction itself. Put in front of the wrapped optimizer's class."""

    _fv_args: Dict[str, Any] = {}
    #: Keras 2 wrappers reduce on TensorFlow, the only backend Keras 2 has.
    _fv_keras2 = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._fv_setup(**type(self)._fv_args)

    def _fv_setup(self, *, name: Optional[str], compression: Any, sparse_as_dense: bool,
                  gradient_predivide_factor: float, op: int, backward_passes_per_step: int,
                  average_aggregated_gradients: bool, num_groups: int, groups: Any,
                  process_set: ProcessSet, scale_local_gradients: bool) -> None:
        prefix = name or f"DistributedGradient.{_instance_number('DistributedGradient', process_set)}"
        self._fv = _State(
            prefix=prefix, compression=compression, sparse_as_dense=sparse_as_dense,
            predivide=gradient_predivide_factor, op=op, bpps=backward_passes_per_step,
            average_aggregated=average_aggregated_gradients, num_groups=num_groups,
            groups=groups, process_set=process_set, scale_local=scale_local_gradients,
            local=[], checked=False, counter=None, accs=None, reduced=False, carry=None)

    # ------------------------------------------------------------------ public extras

    def register_local_var(self, var: Any) -> None:
        """Keeps ``var``'s gradient out of the allreduce (with ``scale_local_gradients`` it is
        divided by the process-set size instead, as Horovod does)."""
        self._fv.local.append(var)

    @property
    def _agg_helper(self) -> Any:
        """Horovod's name for the state of ``backward_passes_per_step`` (None without it):
        its ``counter`` variable counts the backward passes since the last update."""
        return self._fv if self._fv.bpps > 1 else None

    # ------------------------------------------------------------------ internals

    def _fv_active(self) -> bool:
        ps = self._fv.process_set
        _api.size()  # raises NotInitializedError before init(): never train undistributed silently
        return bool(ps.included()) and (ps.size() or 0) > 1

    def _fv_is_local(self, v: Any) -> bool:
        return any(v is l or getattr(v, "value", None) is l or getattr(l, "value", None) is v
                   for l in self._fv.local)

    def _fv_check_variables(self, variables: Sequence[Any]) -> None:
        """Checks once that every rank trains the same variables (one small allgather)."""
        st = self._fv
        # In an elastic job a worker that joins builds its optimizer in the state sync, while
        # the others built theirs long ago: a collective here would never meet its peers.
        # A variable the ranks disagree on still fails every rank at the first step, by name.
        if not st.checked and self._fv_active() and not _elastic.enabled():
            variable_signature_check([v for v in variables if not self._fv_is_local(v)],
                                     st.process_set, "DistributedOptimizer",
                                     f"{st.prefix}.variables")
        st.checked = True

    def _fv_reduce(self, grads: List[Any], variables: List[Any]) -> List[Any]:
        st = self._fv
        if not self._fv_active():
            return grads
        return _backend.reduce_gradients(
            grads, variables, op=st.op, compression=st.compression,
            sparse_as_dense=st.sparse_as_dense, gradient_predivide_factor=st.predivide,
            num_groups=st.num_groups, groups=st.groups, process_set=st.process_set,
            local_variables=st.local, scale_local_gradients=st.scale_local,
            name_prefix=st.prefix, keras2=self._fv_keras2)


class _DistributedMixin(_CommonMixin):
    """The Keras 3 wrapper: the reduction sits in ``apply``."""

    @property
    def variables(self) -> _CallableList:  # type: ignore[override]
        """The wrapped optimizer's variables; also callable, like Horovod's wrapper."""
        return _CallableList(super().variables)  # type: ignore[misc]

    def build(self, variables: Sequence[Any]) -> None:
        """Builds the wrapped optimizer, then checks that every rank trains the same variables
        and creates the gradient accumulators ``backward_passes_per_step`` needs."""
        super().build(variables)  # type: ignore[misc]
        st = self._fv
        variables = list(variables)
        self._fv_check_variables(variables)
        if st.bpps > 1 and st.accs is None:
            import keras

            st.counter = keras.Variable(0, dtype="int32", trainable=False,
                                        name="ferrovod_backward_pass")
            st.accs = [keras.Variable(keras.ops.zeros(v.shape, dtype=v.dtype), trainable=False,
                                      name="ferrovod_gradient_sum") for v in variables]

    def apply(self, grads: Sequence[Any], trainable_variables: Optional[Sequence[Any]] = None) -> Any:
        """Reduces ``grads`` across ranks (one grouped allreduce), then applies them with the
        wrapped optimizer; with ``backward_passes_per_step=N`` only every N-th call does."""
        grads = list(grads)
        if not grads:
            return super().apply(grads, trainable_variables)  # type: ignore[misc]
        if trainable_variables is None:
            if not self.built:  # type: ignore[attr-defined]
                return super().apply(grads)  # type: ignore[misc]  # Keras' own error
            variables = list(self._trainable_variables)  # type: ignore[attr-defined]
        else:
            variables = list(trainable_variables)
            if not self.built:  # type: ignore[attr-defined]
                self.build(variables)
                self.built = True
        _backend.check_not_xla("DistributedOptimizer")
        if self._fv.bpps == 1:
            return super().apply(self._fv_reduce(grads, variables), variables)  # type: ignore[misc]
        return self._fv_apply_aggregated(grads, variables)

    def _fv_apply_aggregated(self, grads: List[Any], variables: List[Any]) -> None:
        import keras

        ops = keras.ops
        st = self._fv
        n = st.bpps
        accs = [None if g is None else st.accs[self._get_variable_index(v)]  # type: ignore[attr-defined]
                for g, v in zip(grads, variables)]
        for g, a in zip(grads, accs):
            if g is not None:
                self.assign_add(a, g)  # type: ignore[attr-defined]  # handles IndexedSlices
        count = ops.convert_to_tensor(st.counter)

        def reduce_and_apply() -> None:
            total = [None if a is None else ops.convert_to_tensor(a) for a in accs]
            if st.average_aggregated:
                total = [None if t is None else t / n for t in total]
            reduced = self._fv_reduce(total, variables)
            super(_DistributedMixin, self).apply(reduced, variables)  # type: ignore[misc]
            for a in accs:
                if a is not None:
                    self.assign(a, ops.zeros_like(a))  # type: ignore[attr-defined]

        def only_count() -> None:
            self._iterations.assign_add(1)  # type: ignore[attr-defined]

        ops.cond(ops.equal(count, n - 1), reduce_and_apply, only_count)
        st.counter.assign(ops.mod(count + 1, n))


def is_distributed(optimizer: Any) -> bool:
    """True for an optimizer made by :func:`DistributedOptimizer`."""
    return isinstance(optimizer, _CommonMixin)


def copy_optimizer_state(src: Any, dst: Any, variables: Sequence[Any]) -> None:
    """Builds ``dst`` on ``variables`` and copies ``src``'s variable values into it (same class
    and config, so the variables correspond one to one)."""
    _flavor.build_optimizer(dst, variables)
    a, b = _flavor.optimizer_variables(src), _flavor.optimizer_variables(dst)
    if len(a) != len(b) or any(tuple(x.shape) != tuple(y.shape) for x, y in zip(a, b)):
        raise ValueError(f"cannot carry the state of {type(src).__name__} over to its "
                         f"distributed copy: {len(a)} variables vs {len(b)}")
    for x, y in zip(a, b):
        _backend.assign(y, _backend.to_numpy(x))


def carry_state_now(dist: Any, variables: Sequence[Any]) -> None:
    """Takes over, now, the state of the optimizer ``dist`` was made from, where that waited
    for the first update to name the variables (Keras 2): ``load_model`` knows them."""
    src = dist._fv.carry
    if src is not None:
        dist._fv.carry = None
        copy_optimizer_state(src, dist, variables)


def DistributedOptimizer(optimizer: Any, name: Optional[str] = None, device_dense: str = "",
                         device_sparse: str = "", compression: Any = Compression.none,
                         sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                         op: int = Average, backward_passes_per_step: int = 1,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups: Optional[Sequence[Sequence[Any]]] = None,
                         process_set: ProcessSet = global_process_set,
                         scale_local_gradients: bool = True) -> Any:
    """Wraps a Keras optimizer so that gradients are averaged (or summed) across ranks.

    Any optimizer of Keras 3, or of Keras 2 (``tf_keras``: its current optimizers and those
    in ``tf_keras.optimizers.legacy``). Returns an instance of a subclass of
    ``type(optimizer)`` with the same class name, built with
    ``from_config(optimizer.get_config())``; when ``optimizer`` is already built, its state
    (slots, iterations) is carried over (a Keras 2 one's at the first update, when the copy
    creates its slots). Use it in ``model.compile`` or in a custom loop; the gradients of one
    update go out as one grouped allreduce (``num_groups`` / ``groups`` split it, as in
    Horovod).

    Where the reduction happens: Keras 3 has one entry for an update, ``apply`` (which
    ``apply_gradients`` calls). Keras 2 reduces where Horovod did, in ``compute_gradients``
    / ``_compute_gradients`` / ``get_gradients`` (``minimize`` and ``model.fit`` go through
    them), and in ``apply_gradients`` when the gradients did not come from those (a custom
    loop with ``tf.GradientTape``): each update is reduced exactly once.

    Args:
        optimizer: a Keras optimizer instance (or a name Keras knows, such as ``"sgd"``,
            looked up in the Keras ``tf.keras`` means: ``tf_keras`` with
            ``TF_USE_LEGACY_KERAS=1``).
        name: prefix of the collective ops' names (default ``DistributedGradient.<k>``, k
            counting the distributed optimizers this process made: all ranks must create
            them in the same order).
        device_dense, device_sparse: accepted for Horovod compatibility; tensors stay where
            the backend keeps them.
        compression: ``Compression.none`` or ``Compression.fp16`` / ``bf16`` (cast for the
            wire only), from any ferrovod module.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors.
        gradient_predivide_factor: divide by this before the sum and by ``size/factor``
            after it (only with ``op=Average``).
        op: ``Average`` or ``Sum``.
        backward_passes_per_step: N: accumulate N calls' gradients locally, reduce and apply
            on every N-th call.
        average_aggregated_gradients: divide the accumulated sum by N.
        num_groups, groups: split the grouped allreduce (int, or lists of variables).
        process_set: the ranks that share gradients.
        scale_local_gradients: divide gradients of variables registered with
            ``register_local_var`` by the set size.

    Raises:
        ValueError: an unsupported op (Min, Max, Product), Adasum with
            ``average_aggregated_gradients``, a predivide factor without Average, a
            bad ``backward_passes_per_step``, an optimizer that is already distributed; at the
            first update, when the step is being compiled with XLA (``jit_compile=True``).
    """
    if op not in (Average, Sum, Adasum):
        raise ValueError("DistributedOptimizer for Keras supports op=Average, op=Sum and "
                         f"op=Adasum (got {op!r})")
    if op == Adasum and average_aggregated_gradients:
        raise ValueError("Adasum does not support average_aggregated_gradients == True")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is supported only with op=Average")
    if int(backward_passes_per_step) != backward_passes_per_step or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be an integer >= 1, "
                         f"got {backward_passes_per_step!r}")
    if num_groups < 0:
        raise ValueError("num_groups must be a non-negative integer")
    if groups is not None and not isinstance(groups, (list, tuple)):
        raise ValueError("groups must be a list of lists of variables")
    if isinstance(optimizer, str):
        optimizer = _flavor.keras().optimizers.get(optimizer)
    if is_distributed(optimizer):
        raise ValueError("the optimizer is already a ferrovod DistributedOptimizer")
    if not _flavor.is_optimizer(optimizer):
        raise TypeError(f"DistributedOptimizer expects a Keras optimizer (Keras 3, or Keras 2 "
                        f"from tf_keras), got "
                        f"{type(optimizer).__module__}.{type(optimizer).__name__}")
    if _flavor.is_keras2(optimizer):
        from .keras2_optimizer import Keras2Mixin as mixin
    else:
        _backend.check_backend("DistributedOptimizer")
        mixin = _DistributedMixin
    base = type(optimizer)
    args = dict(name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                gradient_predivide_factor=float(gradient_predivide_factor), op=op,
                backward_passes_per_step=int(backward_passes_per_step),
                average_aggregated_gradients=bool(average_aggregated_gradients),
                num_groups=int(num_groups), groups=groups, process_set=process_set,
                scale_local_gradients=bool(scale_local_gradients))
    # Same name and module as the wrapped class: Keras serialises the optimizer under them,
    # so a saved model reloads without ferrovod.
    cls = type(base.__name__, (mixin, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__,
                "__doc__": base.__doc__, "_fv_args": args})
    dist = cls.from_config(optimizer.get_config())
    if _flavor.optimizer_built(optimizer):
        if mixin is _DistributedMixin:
            copy_optimizer_state(optimizer, dist, optimizer._trainable_variables)
        else:
            # A Keras 2 optimizer keeps no list of the variables it has slots for: the copy
            # takes the values when its first update creates its slots for the same ones.
            dist._fv.carry = optimizer
    return dist


def PartialDistributedOptimizer(optimizer: Any, name: Optional[str] = None,
                                device_dense: str = "", device_sparse: str = "",
                                compression: Any = Compression.none, sparse_as_dense: bool = False,
                                gradient_predivide_factor: float = 1.0, op: int = Average,
                                groups: Optional[Sequence[Sequence[Any]]] = None,
                                process_set: ProcessSet = global_process_set,
                                local_layers: Any = None,
                                scale_local_gradients: bool = True) -> Any:
    """A :func:`DistributedOptimizer` whose ``local_layers``' trainable weights are registered
    as local: their gradients are not reduced (and, with ``scale_local_gradients``, are
    divided by the set size)."""
    dist = DistributedOptimizer(optimizer, name=name, compression=compression,
                                sparse_as_dense=sparse_as_dense,
                                gradient_predivide_factor=gradient_predivide_factor, op=op,
                                groups=groups, process_set=process_set,
                                scale_local_gradients=scale_local_gradients)
    if local_layers is not None:
        layers = local_layers if isinstance(local_layers, (list, tuple)) else [local_layers]
        for layer in layers:
            for w in layer.trainable_weights:
                dist.register_local_var(w)
    return dist
