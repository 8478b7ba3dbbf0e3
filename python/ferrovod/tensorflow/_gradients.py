"""Gradient reduction shared by ``DistributedGradientTape``, the TF1 ``DistributedOptimizer``
and the Keras ``DistributedOptimizer`` (``ferrovod.tensorflow.keras``, ``ferrovod.keras``).

:func:`reduce_gradients` reduces a list of gradients across a process set in ONE host op:
eagerly it calls the engine directly; inside ``tf.function`` it is a single stateful
``tf.numpy_function`` that submits every group at once (so the engine negotiates them
together) and waits for all of them.

Names are positional — ``<name_prefix>.<group index>`` for the dense groups and
``<name_prefix>.sparse`` for the sparse gradients — not derived from variable names. Variable
names may legitimately differ between ranks (Keras numbers layers ``dense_1``, ``dense_2`` in
creation order), and an op whose name differs between ranks would wait forever; with
positional names, ranks whose gradient lists differ in number, shape or dtype all get the
engine's mismatch error, extended with this rank's list of gradients. Inside a graph the prefix
is made unique per graph (``DistributedGradientTape``, ``DistributedGradientTape_1``, ...), so
two tapes in one ``tf.function`` never share names and every step reuses the same ones.
"""

from __future__ import annotations

import warnings
from typing import Any, List, Optional, Sequence, Set, Union

import numpy as np
import tensorflow as tf

from .. import _api
from .. import process_sets as _ps
from .._api import Average
from .._groups import plan_groups
from ..exceptions import FerrovodError, MismatchError
from ..process_sets import ProcessSet, global_process_set
from . import mpi_ops as _ops
from .compression import Compression, Compressor

__all__ = ["reduce_gradients", "variable_keys"]

Grad = Union[None, tf.Tensor, tf.IndexedSlices]


def variable_keys(v: Any) -> Set[int]:
    """Identity keys of a variable: the object itself and, for a Keras 3 variable, the
    ``tf.Variable`` it wraps (so either may be registered as local)."""
    keys = {id(v)}
    inner = getattr(v, "_value", None)
    if isinstance(inner, tf.Variable):
        keys.add(id(inner))
    return keys


def _scale(g: Grad, factor: float) -> Grad:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(_scale(g.values, factor), g.indices, g.dense_shape)
    g = tf.convert_to_tensor(g)
    if g.dtype.is_floating:
        return g * tf.cast(factor, g.dtype)
    return tf.cast(tf.cast(g, tf.float64) * factor, g.dtype)


def _describe(grads: List[Any], variables: Optional[List[Any]], idx: List[int]) -> str:
    parts = []
    for i in idx[:12]:
        label = _ops._var_label(variables[i], i) if variables is not None else f"#{i}"
        g = grads[i]
        parts.append(f"{label} {list(g.shape)} {g.dtype.name}")
    more = f", ... ({len(idx) - 12} more)" if len(idx) > 12 else ""
    return ", ".join(parts) + more


# Plain Python on values known when it is traced: AutoGraph has nothing to convert, and fails
# to convert its early return beside the annotated locals after it.
@tf.autograph.experimental.do_not_convert
def reduce_gradients(grads: Sequence[Grad], variables: Optional[Sequence[Any]] = None, *,
                     op: int = Average, compression: Compressor = Compression.none,
                     sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                     num_groups: int = 0, groups: Any = None,
                     process_set: ProcessSet = global_process_set,
                     local_variables: Sequence[Any] = (), scale_local_gradients: bool = True,
                     name_prefix: str = "DistributedGradient") -> List[Grad]:
    """Reduces ``grads`` across ``process_set`` and returns them in the same order.

    * ``None`` entries stay ``None``.
    * Dense gradients go in one grouped allreduce (or ``groups``: an int n for n contiguous
      groups, or lists of variables; ``num_groups`` is the deprecated int form), each one
      compressed by ``compression`` on the way and decompressed after.
    * ``tf.IndexedSlices`` are allgathered (values and indices, all in one grouped allgather;
      values divided by the set size for Average), or densified first with ``sparse_as_dense``.
    * ``op``: Average (default), Sum, Adasum (power-of-two sets), Min, Max or Product.
      ``gradient_predivide_factor`` f (Average only) splits the average into a 1/f pre-scale
      and an f/size post-scale, as Horovod does.
    * Gradients of ``local_variables`` (matched by identity to ``variables``) are not reduced;
      with ``scale_local_gradients`` they are divided by the set size.
    * On a rank outside ``process_set`` the gradients come back as they are, as in Horovod:
      that rank trains on its own.

    Works eagerly and inside ``tf.function`` (one host op per call). Every rank of the set
    must call it with the same number of gradients, shapes and dtypes; otherwise every rank
    raises ``MismatchError`` naming the disagreement and listing its own gradients.
    """
    _ps._check_known(process_set)
    if process_set.included() is False:
        return list(grads)
    grads = list(grads)
    var_list = None if variables is None else list(variables)
    if var_list is not None and len(var_list) != len(grads):
        raise ValueError(f"reduce_gradients: {len(grads)} gradients but {len(var_list)} "
                         "variables")
    op = int(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in a future version.", DeprecationWarning, stacklevel=3)
        if groups is None:
            groups = int(num_groups)
    n = _ops._set_size(process_set)
    local: Set[int] = set()
    for v in local_variables:
        local |= variable_keys(v)

    out: List[Grad] = list(grads)
    dense: List[int] = []
    sparse: List[int] = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if var_list is not None and variable_keys(var_list[i]) & local:
            if scale_local_gradients:
                out[i] = _scale(g, 1.0 / n)
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                out[i] = tf.convert_to_tensor(g)
                dense.append(i)
            else:
                sparse.append(i)
        else:
            out[i] = _ops._to_tensor(g)
            dense.append(i)
    if not dense and not sparse:
        return out

    for i in dense:
        _ops._check_dtype(out[i], name_prefix, _describe(out, var_list, [i]))
    for i in sparse:
        _ops._check_dtype(out[i].values, name_prefix, _describe(out, var_list, [i]))
    keys = None if var_list is None else [variable_keys(var_list[i]) for i in dense]
    plan = plan_groups(keys, len(dense), groups, variable_keys)
    pairs = [compression.compress(out[i]) for i in dense]
    wire = [c for c, _ in pairs]
    sparse_in: List[tf.Tensor] = []
    for i in sparse:
        sparse_in += [out[i].values, out[i].indices]
    pre, post = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                 if op == Average else (1.0, 1.0))
    if tf.executing_eagerly():
        base = name_prefix
    else:
        base = _ops._unique_graph_name(name_prefix, True)
    nd = len(wire)
    context = (f"{name_prefix}: rank {_api.rank()} reduces {len(dense)} dense and "
               f"{len(sparse)} sparse gradients: "
               + _describe(out, var_list, dense + sparse))

    def body(*arrays: np.ndarray) -> List[np.ndarray]:
        handles = [_api.grouped_allreduce_async([arrays[p] for p in members],
                                                name=f"{base}.{gi}", op=op,
                                                prescale_factor=pre, postscale_factor=post,
                                                process_set=process_set)
                   for gi, members in enumerate(plan)]
        if sparse:
            handles.append(_api.grouped_allgather_async(list(arrays[nd:]), name=f"{base}.sparse",
                                                        process_set=process_set))
        results: List[Any] = []
        error: Optional[BaseException] = None
        for h in handles:  # wait for every handle, even after an error, so none is left behind
            try:
                results.append(_api.synchronize(h))
            except FerrovodError as e:
                error = error or e
        if error is not None:
            if isinstance(error, MismatchError):
                raise MismatchError(f"{error}\n{context}") from error
            raise error
        reduced: List[Any] = [None] * nd
        for members, res in zip(plan, results):
            for p, r in zip(members, res):
                reduced[p] = r
        return reduced + (list(results[-1]) if sparse else [])

    touts = [t.dtype for t in wire + sparse_in]
    results = _ops._execute(body, wire + sparse_in, touts, "FerrovodReduceGradients")
    for k, i in enumerate(dense):
        r = _ops._on_device(_ops._with_shape(results[k], wire[k].shape), wire[k])
        out[i] = compression.decompress(r, pairs[k][1])
    for k, i in enumerate(sparse):
        g = out[i]
        values = _ops._with_shape(results[nd + 2 * k], _ops._rest_shape(g.values))
        indices = _ops._with_shape(results[nd + 2 * k + 1], tf.TensorShape([None]))
        if op == Average:
            # True division, as Horovod's sparse allreduce (integers become floats).
            values = tf.math.truediv(values, tf.cast(n, values.dtype))
        out[i] = tf.IndexedSlices(values, indices, dense_shape=g.dense_shape)
    return out
