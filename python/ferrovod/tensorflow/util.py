"""Horovod's ``horovod.tensorflow.util`` helpers that scripts and tests import."""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import tensorflow as tf

__all__ = ["_executing_eagerly", "_make_subgraph", "_cache", "vars_to_refs", "refs_to_vars"]


def _executing_eagerly() -> bool:
    """Whether TensorFlow executes eagerly here (False inside ``tf.function`` or a TF1 graph)."""
    return tf.executing_eagerly()


def _make_subgraph(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` as a ``tf.function``."""
    return tf.function(f)


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """Memoizes ``f`` on its (hashable) arguments, separately for eager and graph mode."""
    cache: Dict[Tuple[Any, bool], Any] = {}

    def wrapper(*args: Any) -> Any:
        key = (args, _executing_eagerly())
        if key not in cache:
            cache[key] = f(*args)
        return cache[key]

    return wrapper


def vars_to_refs(variables: Any) -> Any:
    """Nested lists of variables -> nested tuples of their hashable ``ref()`` s."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs: Any) -> Any:
    """The inverse of :func:`vars_to_refs`."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()
