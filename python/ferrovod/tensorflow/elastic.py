"""Elastic training state for TensorFlow (Horovod's ``horovod.tensorflow.elastic``):
``TensorFlowState`` (a list of variables), ``TensorFlowKerasState`` (a Keras model and
optimizer) and the ``run`` decorator. See ``ferrovod.elastic.state`` for the loop and the
meaning of ``commit`` / ``restore`` / ``sync``.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import tensorflow as tf

from .. import _api
from .._api import broadcast_object, rank
from ..elastic.state import ModelState, ObjectState, run_fn
from ..exceptions import HorovodInternalError
from .functions import broadcast_variables
from .mpi_ops import init, shutdown

# The rest of Horovod's module namespace, which elastic scripts reach through it.
__all__ = ["TensorFlowState", "TensorFlowKerasState", "run", "ObjectState", "broadcast_object",
           "broadcast_variables", "init", "rank", "shutdown"]

# Names of ferrovod's HorovodInternalError classes: inside tf.function a failed collective
# reaches Python as a tf.errors.UnknownError whose message names the ferrovod error.
_INTERNAL_ERRORS = ("HorovodInternalError", "RankFailureError", "FerrovodTimeoutError",
                    "ShutdownError")


def _reset() -> None:
    shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator running ``func(state, *args, **kwargs)`` elastically: the state is synced
    before each attempt; a failed collective (``HorovodInternalError``, also when it comes
    out of a ``tf.function`` as ``tf.errors.UnknownError``) restores the last commit, resets
    ferrovod and runs ``func`` again; ``HostsUpdatedInterrupt`` resets and runs again. Do not
    call a collective as the argument of the decorated call: new ranks would run it while the
    others sync."""

    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return func(state, *args, **kwargs)
        except tf.errors.UnknownError as e:
            if any(n in str(e.message) for n in _INTERNAL_ERRORS):
                raise HorovodInternalError(str(e.message)) from e
            raise

    return run_fn(wrapper, _reset)


class TensorFlowState(ModelState):
    """State of a list of TensorFlow variables, plus picklable attributes.

    Args:
        variables: the ``tf.Variable`` s to track (default: the TF1 global variables).
        session: in a TF1 graph, the session that holds the variables (default: the default
            session); eagerly, none.
        kwargs: picklable values to keep with the state, exposed as attributes.
    """

    def __init__(self, variables: Optional[Sequence[Any]] = None, session: Any = None,
                 **kwargs: Any) -> None:
        self.variables: List[Any] = list(variables if variables is not None
                                         else tf.compat.v1.global_variables())
        self._eager = tf.executing_eagerly()
        self.session = None if self._eager else (session or tf.compat.v1.get_default_session())
        # In a TF1 graph the broadcast is one op, built once and run at every sync.
        self._bcast_op = None if self._eager else broadcast_variables(self.variables, 0)
        self._save_model()
        super().__init__(bcast_object=_api.broadcast_object, get_rank=_api.rank, **kwargs)

    def sync(self) -> None:
        """Sets every rank's variables and attributes to rank 0's, and saves them."""
        if self._eager:
            broadcast_variables(self.variables, 0)
        elif self.session is not None:
            self.session.run(self._bcast_op)
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        if self._eager:
            self._values = [v.numpy() for v in self.variables]
        else:
            self._values = self.session.run(self.variables) if self.variables else []

    def _load_model(self) -> None:
        for v, value in zip(self.variables, self._values):
            if self._eager:
                v.assign(value)
            else:
                v.load(value, self.session)


def __getattr__(name: str) -> Any:
    # TensorFlowKerasState is Keras' state: import Keras only when it is asked for.
    if name == "TensorFlowKerasState":
        from .._keras.elastic import KerasState

        return KerasState
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
