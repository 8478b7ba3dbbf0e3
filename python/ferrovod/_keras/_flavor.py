"""Which Keras a script uses: Keras 3 (the ``keras`` package) or Keras 2 (``tf_keras``).

TensorFlow >= 2.16 ships Keras 3 as ``tf.keras``; Horovod-era code keeps running on Keras 2
through the ``tf_keras`` package with ``TF_USE_LEGACY_KERAS=1``, which makes ``tf.keras``
mean ``tf_keras``. The Keras layer follows the same rule where it has no object to look at
(callback base classes, ``load_model``, an optimizer given by name): :func:`keras` is the
Keras ``tf.keras`` means. Where it has one (an optimizer, a model), the object's own
package decides (:func:`of`). A Keras the script does not use is never imported.

The two differ where the Keras layer touches them: Keras 2 optimizers compute and apply
gradients through ``compute_gradients``/``_compute_gradients``/``get_gradients`` and
``apply_gradients`` (Keras 3: one ``apply``); legacy ones (``optimizers.legacy``) create
their slots in ``_create_all_weights`` and list them with ``variables()``; Keras 2 runs only
on TensorFlow. The helpers below answer these questions for either.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any, List, Sequence

__all__ = ["legacy_requested", "keras", "of", "is_keras2", "is_optimizer",
           "optimizer_variables", "optimizer_built", "build_optimizer"]

_KERAS_ROOTS = ("keras", "tf_keras")


def legacy_requested() -> bool:
    """True when ``TF_USE_LEGACY_KERAS`` makes ``tf.keras`` mean ``tf_keras``.

    TensorFlow's own variable, read with TensorFlow's own test (``tensorflow/__init__.py``
    accepts exactly these spellings), so that ferrovod and ``tf.keras`` never disagree.
    """
    return os.environ.get("TF_USE_LEGACY_KERAS", None) in ("true", "True", "1")


def keras() -> ModuleType:
    """The Keras package ``tf.keras`` means in this process (imported on first use)."""
    if legacy_requested():
        try:
            import tf_keras
        except ImportError as e:
            raise ImportError(
                "TF_USE_LEGACY_KERAS is set, so tf.keras means Keras 2 (the tf_keras package), "
                "but tf_keras is not installed: pip install tf_keras~=<your TensorFlow's "
                "major.minor>.0 (with tensorflow-cpu, add --no-deps so that pip does not pull "
                "in the full tensorflow package beside it)") from e
        return tf_keras
    import keras as keras3

    return keras3


def _root_of(cls: type) -> str:
    """The top-level package a class, or the nearest Keras class it derives from, lives in."""
    for c in cls.__mro__:
        root = c.__module__.split(".", 1)[0]
        if root in _KERAS_ROOTS:
            return root
    return ""


def of(obj: Any) -> ModuleType:
    """The Keras package ``obj`` (an optimizer, model, layer or variable) belongs to; the
    default Keras (:func:`keras`) for objects of neither."""
    root = _root_of(type(obj))
    mod = sys.modules.get(root) if root else None
    return mod if mod is not None else keras()


def is_keras2(obj: Any) -> bool:
    """True for an object of Keras 2: ``tf_keras``, or a ``keras`` package of version 2."""
    root = _root_of(type(obj))
    if root == "tf_keras":
        return True
    if root == "keras":
        return str(getattr(sys.modules["keras"], "__version__", "3")).startswith("2.")
    return False


def _optimizer_bases(mod: ModuleType) -> tuple:
    opts = getattr(mod, "optimizers", None)
    found = []
    for owner in (opts, getattr(opts, "legacy", None)):
        cls = getattr(owner, "Optimizer", None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def is_optimizer(obj: Any) -> bool:
    """True for an optimizer of any Keras already imported (current or legacy class)."""
    for root in _KERAS_ROOTS:
        mod = sys.modules.get(root)
        if mod is not None and isinstance(obj, _optimizer_bases(mod)):
            return True
    return False


def optimizer_variables(optimizer: Any) -> List[Any]:
    """An optimizer's variables as a list: ``variables`` is a list (Keras 3), a callable
    list (Keras 2's current optimizers) or a method (Keras 2's legacy ones)."""
    if optimizer is None:
        return []
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def optimizer_built(optimizer: Any) -> bool:
    """True once the optimizer has created its slots.

    Keras 3 says so in ``built``, Keras 2's current optimizers in ``_built``; a legacy one
    creates its slots with its first update, after which it has slot variables."""
    if hasattr(optimizer, "built"):
        return bool(optimizer.built)
    if hasattr(optimizer, "_built"):
        return bool(optimizer._built)
    return bool(getattr(optimizer, "_slots", None))


def build_optimizer(optimizer: Any, variables: Sequence[Any]) -> None:
    """Creates the optimizer's slots for ``variables`` now, as its first update would."""
    variables = list(variables)
    if hasattr(optimizer, "_create_all_weights"):  # Keras 2 legacy (OptimizerV2)
        optimizer._create_all_weights(variables)
        return
    optimizer.build(variables)
    if hasattr(optimizer, "built"):
        optimizer.built = True
