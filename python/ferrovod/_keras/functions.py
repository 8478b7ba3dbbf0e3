"""Keras-level helpers: collectives on NumPy-compatible values, broadcasting variables, and
``load_model``.

The value ops (``allreduce``, ``allgather``, ``broadcast``, ``reducescatter``) take anything
NumPy can read (Python numbers, arrays, backend tensors, Keras variables) and return the
evaluated result as a NumPy array, like Horovod's Keras ops. Variables are broadcast through
host memory with the framework-free API, which works the same on every Keras backend; these
calls run outside the training step (at train begin, after loading), where a host copy is
what the backend would make anyway.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .. import _api
from .._api import Average
from ..process_sets import ProcessSet, global_process_set
from .._frameworks import keras_hooks
from . import _backend, _flavor
from .compression import Compression
from .compression import kind_of as _kind_of
from .optimizer import (DistributedOptimizer, carry_state_now, is_distributed,
                        variable_signature_check)

__all__ = ["init", "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_variables",
           "broadcast_global_variables", "model_variables", "load_model"]


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Starts ferrovod (``ferrovod.init``). On the TensorFlow backend it goes through
    ``ferrovod.tensorflow.init``, which also gives TensorFlow's thread pools this rank's share
    of the cores when several ranks share a host."""
    if _backend.backend() == "tensorflow":
        keras_hooks("tensorflow").init(comm=comm, process_sets=process_sets)
    else:
        _api.init(comm=comm, process_sets=process_sets)


def _numpy_compressor(compression: Any) -> Any:
    kind = _kind_of(compression)
    return compression if kind is None else getattr(Compression, kind)


def allreduce(value: Any, name: Optional[str] = None, average: Optional[bool] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              op: Optional[int] = None, compression: Any = Compression.none,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduces ``value`` across ranks (default: Average) and returns the result as NumPy."""
    comp = _numpy_compressor(compression)
    wire, ctx = comp.compress(_backend.to_numpy(value))
    out = _api.allreduce(wire, average=average, name=name, op=op,
                         prescale_factor=prescale_factor, postscale_factor=postscale_factor,
                         process_set=process_set)
    return comp.decompress(out, ctx)


def allgather(value: Any, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenates every rank's ``value`` along dim 0 (in rank order); returns NumPy."""
    return _api.allgather(_backend.to_numpy(value), name=name, process_set=process_set)


def broadcast(value: Any, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """``root_rank``'s ``value`` on every rank, as NumPy."""
    return _api.broadcast(_backend.to_numpy(value), root_rank, name=name, process_set=process_set)


def reducescatter(value: Any, name: Optional[str] = None, op: int = Average,
                  process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduces ``value`` across ranks and returns this rank's rows of dim 0, as NumPy."""
    return _api.reducescatter(_backend.to_numpy(value), name=name, op=op, process_set=process_set)


# Unsigned types the engine does not carry are sent bit for bit as the signed type of the
# same width: a broadcast only copies bytes.
_WIRE_VIEW = {np.dtype("uint16"): np.int16, np.dtype("uint32"): np.int32,
              np.dtype("uint64"): np.int64}


def _identity_set(variables: Optional[Sequence[Any]]) -> set:
    ids = set()
    for v in variables or ():
        ids.add(id(v))
        ids.add(id(getattr(v, "value", v)))
    return ids


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        name: str = "broadcast_variables", check: bool = True) -> None:
    """Assigns ``root_rank``'s values to ``variables`` (Keras variables, or anything with
    ``assign`` and a NumPy view) on every rank of ``process_set``.

    With ``check`` (default), the ranks first compare their variables' shapes and dtypes and
    all raise the same ValueError if they differ, instead of waiting on each other."""
    variables = list(variables)
    if not variables or not process_set.included():
        return
    if check:
        variable_signature_check(variables, process_set, "broadcast_variables",
                                 f"{name}.signature")
    arrays, dtypes = [], []
    for v in variables:
        a = np.array(_backend.to_numpy(v), copy=True)  # 0-d stays 0-d; owned and contiguous
        dtypes.append(a.dtype)
        view = _WIRE_VIEW.get(a.dtype)
        arrays.append(a.view(view) if view is not None else a)
    handles = [_api.broadcast_async_(a, root_rank, name=f"{name}.{i}", process_set=process_set)
               for i, a in enumerate(arrays)]
    for h in handles:
        _api.synchronize(h)
    for v, a, dt in zip(variables, arrays, dtypes):
        _backend.assign(v, a.view(dt) if a.dtype != dt else a)


def model_variables(model: Any, include_optimizer: bool = True,
                    exclude: Optional[Sequence[Any]] = None) -> List[Any]:
    """The variables :func:`broadcast_global_variables` sends for ``model``: its weights
    (trainable and not, e.g. BatchNorm statistics) and, when compiled and built, its
    optimizer's variables — minus ``exclude``, the optimizer's registered local variables and
    the random-seed states of layers such as Dropout (each rank keeps its own masks)."""
    skip = _identity_set(exclude)
    opt = getattr(model, "optimizer", None)
    if opt is not None and is_distributed(opt):
        skip |= _identity_set(opt._fv.local)
    out = []
    for v in model.variables:
        if id(v) in skip or str(getattr(v, "path", "")).endswith("seed_generator_state"):
            continue
        out.append(v)
    if include_optimizer and opt is not None and _flavor.optimizer_built(opt):
        out += [v for v in _flavor.optimizer_variables(opt) if id(v) not in skip]
    return out


def broadcast_global_variables(root_rank: int, model: Any = None,
                               process_set: ProcessSet = global_process_set) -> None:
    """Makes every rank hold ``root_rank``'s variables of ``model``.

    Eager Keras (Keras 3, and Keras 2 outside a v1 graph) keeps no collection of "global
    variables" (Horovod's TF1 notion), so the variables are named through ``model``: a Keras
    model or layer (its weights plus, once it is compiled and built, its optimizer's
    variables; see :func:`model_variables`), an optimizer (its variables), or a list of
    variables. In a v1 graph (Keras 2 with eager execution disabled) ``model`` may be left
    out: the graph's global variables are broadcast in Keras' session, as Horovod did.
    """
    if model is None:
        if _backend.in_v1_graph():
            _broadcast_graph_globals(root_rank)
            return
        raise ValueError("broadcast_global_variables(root_rank, model): eager Keras has no "
                         "global variable collection; pass the model (or optimizer, or list "
                         "of variables) whose variables should be broadcast")
    if _flavor.is_optimizer(model):
        variables = _flavor.optimizer_variables(model)
    elif isinstance(model, (list, tuple)):
        variables = list(model)
    else:
        variables = model_variables(model)
    broadcast_variables(variables, root_rank, process_set=process_set,
                        name="broadcast_global_variables")


def _broadcast_graph_globals(root_rank: int) -> None:
    """Horovod's ``broadcast_global_variables`` of a Keras 2 v1 graph, run in Keras'
    session."""
    import tensorflow as tf

    session = tf.compat.v1.keras.backend.get_session()  # Keras 2's v1 API
    session.run(keras_hooks("tensorflow").broadcast_global_variables(root_rank))


def load_model(filepath: Any, custom_optimizers: Optional[Sequence[type]] = None,
               custom_objects: Optional[Dict[str, Any]] = None,
               compression: Any = Compression.none, legacy_opts: bool = False,
               **distributed_kwargs: Any) -> Any:
    """Loads a saved Keras model and wraps its optimizer in :func:`DistributedOptimizer`,
    keeping the optimizer state the file holds. The Keras ``tf.keras`` means loads it
    (Keras 3: ``.keras``; Keras 2 with ``TF_USE_LEGACY_KERAS=1``: ``.keras``, ``.h5`` or a
    SavedModel folder).

    Works whether the model was saved with a distributed optimizer or a plain one (both are
    stored as the plain class). ``custom_optimizers`` lists optimizer classes of your own that
    the file refers to; ``custom_objects`` is passed to ``keras.saving.load_model``.
    ``legacy_opts`` is accepted for Horovod compatibility: the file says which class its
    optimizer is, legacy or not.
    Every rank must call it (the wrapping checks that the ranks agree on the variables).
    Extra keyword arguments go to ``DistributedOptimizer`` (e.g. ``op``,
    ``backward_passes_per_step``).
    """
    keras = _flavor.keras()
    objects: Dict[str, Any] = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    opt = getattr(model, "optimizer", None)
    if opt is None or is_distributed(opt):
        return model
    # A built optimizer (the file held its state) is copied over, slots and all.
    dist = DistributedOptimizer(opt, compression=compression, **distributed_kwargs)
    carry_state_now(dist, model.trainable_variables)
    model.optimizer = dist
    # Keep compile config and optimizer in agreement, so saving again serialises this one.
    cc = getattr(model, "_compile_config", None)
    if cc is not None and isinstance(getattr(cc, "config", None), dict) and "optimizer" in cc.config:
        cc.config["optimizer"] = dist
    model.train_function = None  # trace a new step that calls the wrapped optimizer
    return model
