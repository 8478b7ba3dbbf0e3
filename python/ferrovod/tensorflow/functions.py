"""Variable and object helpers of ``ferrovod.tensorflow`` (Horovod's
``horovod.tensorflow.functions``): ``broadcast_variables``, ``broadcast_global_variables``,
``broadcast_object``, ``broadcast_object_fn`` and ``allgather_object``."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from .. import _api
from ..process_sets import ProcessSet, global_process_set
from . import mpi_ops as _ops

__all__ = ["broadcast_variables", "broadcast_global_variables", "broadcast_object",
           "broadcast_object_fn", "allgather_object"]


def broadcast_variables(variables: Sequence[Any], root_rank: int,
                        process_set: ProcessSet = global_process_set,
                        inplace: bool = False) -> Any:
    """Assigns ``root_rank``'s value to every variable, on every rank of ``process_set``.

    ``variables`` are ``tf.Variable`` s or Keras variables (e.g. ``model.variables``,
    ``optimizer.variables``). Works eagerly and inside ``tf.function``. Every rank must pass
    the same number of variables with the same shapes and dtypes: a difference is an error on
    every rank naming it (checked before anything is sent, so nothing hangs). ``inplace`` is
    accepted for compatibility; both ways assign. Eager: returns None; in a graph: the group of
    assign ops.
    """
    del inplace  # Horovod's in-place variant avoids a copy in its custom op; we assign either way
    assigns = _ops._assign_broadcast(variables, root_rank, None, "broadcast_variables",
                                     "broadcast_variables", process_set)
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graph mode: broadcasts every global variable from ``root_rank`` (returns the op).
    In eager mode there are no global variables: use :func:`broadcast_variables`."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "hvd.broadcast_global_variables() does not support eager execution. Please use "
            "`hvd.broadcast_variables(<model/optimizer variables>)` instead.")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None,
                     name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Sends a picklable object from ``root_rank`` to every rank (cloudpickle). ``session``
    is accepted for compatibility (nothing runs in a session)."""
    del session
    return _api.broadcast_object(obj, root_rank=root_rank, name=name, process_set=process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: Optional[str] = None,
                        process_set: ProcessSet = global_process_set) -> Callable[[Any], Any]:
    """Returns ``fn(obj)`` that broadcasts ``obj`` from ``root_rank`` (Horovod's reusable form)."""
    del session

    def fn(obj: Any) -> Any:
        return _api.broadcast_object(obj, root_rank=root_rank, name=name,
                                     process_set=process_set)

    return fn


def allgather_object(obj: Any, session: Any = None, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> List[Any]:
    """Gathers a picklable object from every rank of the set; returns them in rank order."""
    del session
    return _api.allgather_object(obj, name=name, process_set=process_set)
