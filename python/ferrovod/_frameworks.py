"""The framework adapters the Keras layer works through, registered by the adapters themselves.

``ferrovod._keras`` is written against Keras' backend-neutral API; what needs the framework
under Keras (its ``init``, its gradient reduction inside ``tf.function``, its elastic ``run``)
comes from the adapter of that framework. The adapter registers a :class:`KerasHooks` here when
it is imported, so the Keras layer never imports it: it asks :func:`keras_hooks`, which loads
the adapter by name the first time (Keras runs on that framework, so it is installed).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List

__all__ = ["KerasHooks", "register_keras_hooks", "keras_hooks"]


@dataclass(frozen=True)
class KerasHooks:
    """What a framework adapter gives the Keras layer when Keras runs on that framework."""

    #: ``init(comm, process_sets)``: starts ferrovod the adapter's way.
    init: Callable[..., None]
    #: Reduces gradient tensors of the framework (``reduce_gradients(grads, variables, *,
    #: op, compression, ...)``).
    reduce_gradients: Callable[..., List[Any]]
    #: The adapter's ``Compression`` table (compressors of the framework's tensors).
    compression: Any
    #: The adapter's elastic ``run`` decorator.
    elastic_run: Callable[[Callable[..., Any]], Callable[..., Any]]
    #: ``broadcast_global_variables(root_rank)``: the op that broadcasts a v1 graph's global
    #: variables (Keras 2 with eager execution disabled).
    broadcast_global_variables: Callable[[int], Any]


#: Keras backend -> the module of ferrovod's adapter for it.
_ADAPTERS = {"tensorflow": "ferrovod.tensorflow"}
_hooks: Dict[str, KerasHooks] = {}


def register_keras_hooks(backend: str, hooks: KerasHooks) -> None:
    """Called by an adapter at import: the Keras layer's way to ``backend``."""
    _hooks[backend] = hooks


def keras_hooks(backend: str) -> KerasHooks:
    """The hooks of ``backend``'s adapter, importing it the first time."""
    if backend not in _hooks:
        importlib.import_module(_ADAPTERS[backend])
    return _hooks[backend]
