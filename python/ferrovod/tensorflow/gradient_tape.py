"""``DistributedGradientTape`` and ``PartialDistributedGradientTape``: a ``tf.GradientTape``
whose ``gradient()`` returns gradients reduced across ranks (Horovod's TF2 training API)."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

import tensorflow as tf

from .._api import Average
from ..process_sets import ProcessSet, global_process_set
from ._gradients import reduce_gradients, variable_keys
from .compression import Compression, Compressor

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape"]


class _DistributedTapeMixin:
    """Put in front of the wrapped tape's class (see :func:`DistributedGradientTape`)."""

    _fv_options: dict
    _fv_local: List[Any]

    def register_local_source(self, source: Any) -> None:
        """Keeps ``source``'s gradient local: it is not reduced (and, with
        ``scale_local_gradients``, divided by the set size)."""
        if not any(variable_keys(source) & variable_keys(s) for s in self._fv_local):
            self._fv_local.append(source)

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 use_generic_names: bool = False, **kwargs: Any) -> Any:
        """``tf.GradientTape.gradient``, then every gradient reduced across the process set
        (one host op; see ``ferrovod.tensorflow._gradients.reduce_gradients``). ``sources``
        may be any nest (list, dict, single variable); the result has the same structure.
        ``use_generic_names`` is accepted for compatibility: the reductions are always named
        by position, never by variable name."""
        del use_generic_names
        grads = super().gradient(target, sources, output_gradients, **kwargs)  # type: ignore[misc]
        flat_sources = tf.nest.flatten(sources)
        flat_grads = tf.nest.flatten(grads)
        o = self._fv_options
        reduced = reduce_gradients(
            flat_grads, flat_sources, op=o["op"], compression=o["compression"],
            sparse_as_dense=o["sparse_as_dense"],
            gradient_predivide_factor=o["gradient_predivide_factor"], groups=o["groups"],
            process_set=o["process_set"], local_variables=list(self._fv_local),
            scale_local_gradients=o["scale_local_gradients"],
            name_prefix="DistributedGradientTape")
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target: Any, sources: Any,
                                       output_gradients: Any = None,
                                       use_generic_names: bool = False
                                       ) -> Tuple[List[Tuple[Any, Any]], List[Tuple[Any, Any]]]:
        """:meth:`gradient`, split into ``(local, global)`` lists of ``(source, gradient)``
        pairs in ``sources`` order: ``local`` holds the registered local sources (their
        gradients not reduced, scaled as :meth:`gradient` scales them), ``global`` the
        others (reduced)."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local_keys: Set[int] = set()
        for s in self._fv_local:
            local_keys |= variable_keys(s)
        local: List[Tuple[Any, Any]] = []
        global_: List[Tuple[Any, Any]] = []
        for s, g in zip(tf.nest.flatten(sources), tf.nest.flatten(grads)):
            (local if variable_keys(s) & local_keys else global_).append((s, g))
        return local, global_


def DistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                            device_sparse: str = "", compression: Compressor = Compression.none,
                            sparse_as_dense: bool = False, op: int = Average,
                            gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                            groups: Any = None, process_set: ProcessSet = global_process_set,
                            scale_local_gradients: bool = True) -> tf.GradientTape:
    """Wraps a ``tf.GradientTape`` so that ``gradient()`` returns gradients averaged (``op``)
    across ``process_set``.

    The result is an instance of a subclass of ``gradtape``'s class with the same name,
    sharing its recording: wrap it after the ``with`` block (or before entering it). Arguments
    as Horovod's: ``compression`` on the wire, ``sparse_as_dense`` densifies
    ``tf.IndexedSlices``, ``gradient_predivide_factor`` splits the average into a pre- and a
    post-scale, ``groups`` (int or lists of variables; ``num_groups`` its deprecated int form)
    groups the allreduces, ``register_local_source(var)`` keeps a gradient local.
    ``device_dense`` / ``device_sparse`` are accepted and ignored (reductions run on the host).
    """
    del device_dense, device_sparse
    if num_groups and groups is None:
        import warnings

        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be "
                      "removed in a future version.", DeprecationWarning, stacklevel=2)
        groups = int(num_groups)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    base = type(gradtape)
    cls = type(base.__name__, (_DistributedTapeMixin, base), {"__module__": __name__})
    tape = cls.__new__(cls)
    # Share the wrapped tape's state (its recording, persistence, watched variables): the
    # new object is the same tape with a distributed gradient().
    tape.__dict__.update(gradtape.__dict__)
    tape._fv_options = dict(op=int(op), compression=compression, sparse_as_dense=sparse_as_dense,
                            gradient_predivide_factor=float(gradient_predivide_factor),
                            groups=groups, process_set=process_set,
                            scale_local_gradients=scale_local_gradients)
    tape._fv_local = list(getattr(gradtape, "_fv_local", []))
    return tape


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",
                                   device_sparse: str = "",
                                   compression: Compressor = Compression.none,
                                   sparse_as_dense: bool = False, op: int = Average,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None,
                                   process_set: ProcessSet = global_process_set,
                                   local_layers: Optional[Any] = None,
                                   scale_local_gradients: bool = True) -> tf.GradientTape:
    """A :func:`DistributedGradientTape` whose gradients for the trainable weights of
    ``local_layers`` (a Keras layer or a list of them) stay local."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    if local_layers is None:
        layers: Sequence[Any] = []
    elif isinstance(local_layers, (list, tuple)):
        layers = local_layers
    else:
        layers = [local_layers]
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise ValueError(f"local_layers must be Keras layers, got {type(layer).__name__}")
        for w in layer.trainable_weights:
            tape.register_local_source(w)  # type: ignore[attr-defined]
    return tape
