"""What depends on the Keras backend: reducing gradient tensors, detecting XLA, reading values.

The optimizer wrapper and the callbacks are written against Keras 3's backend-neutral API;
only the gradient reduction needs framework ops. It goes to ``ferrovod.tensorflow`` (host op
through ``tf.numpy_function`` inside ``tf.function``; reached through the hooks it registers,
:mod:`ferrovod._frameworks`) on the TensorFlow backend and to
``ferrovod.torch`` (zero-copy on CPU tensors) on the torch backend. Each framework is imported
only when its backend is the one in use.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np

from .._api import Average
from .._frameworks import keras_hooks
from .._groups import plan_groups
from ..process_sets import ProcessSet
from . import _flavor
from .compression import kind_of

SUPPORTED_BACKENDS = ("tensorflow", "torch")


def backend() -> str:
    """The Keras backend in use (``keras.backend.backend()``); TensorFlow when ``tf.keras``
    is Keras 2 (``TF_USE_LEGACY_KERAS``), the only backend Keras 2 has."""
    if _flavor.legacy_requested():
        return "tensorflow"
    import keras

    return keras.backend.backend()


def check_backend(what: str) -> str:
    """Returns the backend, or raises when ferrovod cannot reduce its tensors."""
    b = backend()
    if b not in SUPPORTED_BACKENDS:
        raise NotImplementedError(
            f"{what}: ferrovod's Keras adapter supports the {' and '.join(SUPPORTED_BACKENDS)} "
            f"backends; Keras runs on {b!r} (set KERAS_BACKEND=tensorflow or torch)")
    return b


def in_xla_context() -> bool:
    """True while TensorFlow traces a function that XLA will compile (``jit_compile=True``).

    TF enters an ``XLAControlFlowContext`` while tracing a ``tf.function(jit_compile=True)``;
    that private marker is the only signal available at trace time, so any failure to read
    it counts as "not XLA" rather than breaking training.
    """
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        if tf.executing_eagerly():
            return False
        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # noqa: BLE001 - a TF without the private helper: cannot tell
        return False


JIT_MESSAGE = (
    "{what}: the training step is being compiled with XLA (jit_compile=True), but ferrovod "
    "exchanges gradients through a host-side op (tf.numpy_function) that XLA cannot compile; "
    "the step would fail with an InvalidArgumentError when it runs. Compile the model with "
    "model.compile(..., jit_compile=False) (on a CPU-only machine the default "
    "jit_compile=\"auto\" also works: Keras then turns XLA off), or drop jit_compile=True "
    "from your tf.function.")


def check_not_xla(what: str) -> None:
    """Raises a ValueError saying what to do when called inside an XLA-compiled trace."""
    if backend() == "tensorflow" and in_xla_context():
        raise ValueError(JIT_MESSAGE.format(what=what))


def in_v1_graph() -> bool:
    """True in Keras 2 with eager execution disabled (TF1-style code), where a variable is
    read and written by running ops in Keras' session."""
    if not _flavor.legacy_requested():
        return False
    import tensorflow as tf

    return not tf.executing_eagerly()


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy array (0-d stays 0-d) from a Python value, array, backend tensor or variable."""
    if isinstance(value, np.ndarray):
        return value
    if in_v1_graph() and hasattr(value, "graph"):
        return np.asarray(_flavor.keras().backend.get_value(value))
    if hasattr(value, "numpy") and callable(value.numpy):
        try:
            return np.asarray(value.numpy())  # keras Variable, TF eager tensor
        except Exception:  # noqa: BLE001 - e.g. a torch tensor that requires grad
            pass
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def assign(variable: Any, value: Any) -> None:
    """``variable.assign(value)``, run at once: eagerly, or in Keras' session in a v1 graph,
    where ``assign`` only builds the op."""
    if in_v1_graph():
        _flavor.keras().backend.set_value(variable, to_numpy(value))
    else:
        variable.assign(value)


def backend_compressor(compression: Any, table: Any) -> Any:
    """The backend's compressor of the same kind as ``compression`` (see ``kind_of``)."""
    kind = kind_of(compression)
    return compression if kind is None else getattr(table, kind)


def _keys(v: Any) -> set:
    """Identity keys of a variable: the object itself and the tensor it wraps."""
    return {id(v), id(getattr(v, "value", v))}


def _torch_reduce(grads: List[Any], variables: Sequence[Any], *, op: int, compression: Any,
                  gradient_predivide_factor: float, num_groups: int, groups: Any,
                  process_set: ProcessSet, local_ids: set, scale_local_gradients: bool,
                  name_prefix: str) -> List[Any]:
    import torch

    from ..torch import ops as tops
    from ..torch.compression import Compression as TorchCompression

    comp = backend_compressor(compression, TorchCompression)
    n = process_set.size() or 1
    out = list(grads)
    to_reduce = []
    for i, (g, v) in enumerate(zip(grads, variables)):
        if g is None:
            continue
        if id(v) in local_ids:
            if scale_local_gradients and n > 1:
                out[i] = g / n
            continue
        to_reduce.append(i)
    pre, post = ((1.0 / gradient_predivide_factor, gradient_predivide_factor)
                 if op == Average else (1.0, 1.0))
    pending = []
    spec = groups if groups else (num_groups or None)
    plan = plan_groups([_keys(variables[i]) for i in to_reduce], len(to_reduce), spec, _keys)
    chunks = [[to_reduce[p] for p in members] for members in plan]
    for k, chunk in enumerate(chunks):
        pairs = [comp.compress(torch.as_tensor(grads[i]).contiguous()) for i in chunk]
        h = tops.grouped_allreduce_async([c for c, _ in pairs], name=f"{name_prefix}.{k}", op=op,
                                         prescale_factor=pre, postscale_factor=post,
                                         process_set=process_set)
        pending.append((chunk, pairs, h))
    for chunk, pairs, h in pending:
        for i, r, (_, ctx) in zip(chunk, tops.synchronize(h), pairs):
            out[i] = comp.decompress(r, ctx)
    return out


def reduce_gradients(grads: List[Any], variables: Sequence[Any], *, op: int, compression: Any,
                     sparse_as_dense: bool, gradient_predivide_factor: float, num_groups: int,
                     groups: Any, process_set: ProcessSet, local_variables: Sequence[Any],
                     scale_local_gradients: bool, name_prefix: str,
                     keras2: bool = False) -> List[Any]:
    """Reduces ``grads`` (None entries stay None) across ``process_set`` on the active backend
    (TensorFlow for Keras 2, which runs on nothing else)."""
    b = "tensorflow" if keras2 else check_backend("DistributedOptimizer")
    if b == "tensorflow":
        tf_hooks = keras_hooks("tensorflow")
        return tf_hooks.reduce_gradients(
            list(grads), list(variables), op=op,
            compression=backend_compressor(compression, tf_hooks.compression),
            sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor,
            num_groups=num_groups, groups=groups, process_set=process_set,
            local_variables=tuple(local_variables), scale_local_gradients=scale_local_gradients,
            name_prefix=name_prefix)
    local_ids = set().union(*(_keys(v) for v in local_variables))
    return _torch_reduce(list(grads), variables, op=op, compression=compression,
                         gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups,
                         groups=groups, process_set=process_set, local_ids=local_ids,
                         scale_local_gradients=scale_local_gradients, name_prefix=name_prefix)
