"""Elastic training with Keras (Horovod's ``horovod.tensorflow.keras.elastic`` /
``horovod.keras.elastic``): ``KerasState`` and the callbacks that keep it current during
``model.fit``, on every supported Keras backend.

``KerasState(model, optimizer=None, **kwargs)`` tracks the model's variables, the optimizer's
variables (slots, iterations, learning rate) and any picklable keyword attributes
(``epoch=0, batch=0``). ``commit()`` copies them to host memory, ``restore()`` assigns the
copies back, ``sync()`` broadcasts rank 0's. ``run`` is the elastic loop of
``ferrovod.elastic.state.run_fn`` with a reset that shuts ferrovod down and starts it again.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import numpy as np

from .. import _api
from ..elastic.state import ModelState, run_fn
from .._frameworks import keras_hooks
from . import _backend, _flavor
from .functions import broadcast_variables

keras = _flavor.keras()  # the callbacks below must be of the Keras whose fit runs them

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


class KerasState(ModelState):
    """State of a Keras model and optimizer, plus picklable attributes.

    Args:
        model: a built Keras model.
        optimizer: its optimizer (default: the one the model was compiled with).
        backend: accepted for Horovod compatibility (eager Keras needs no session).
        kwargs: picklable values to keep with the state, exposed as attributes.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None,
                 **kwargs: Any) -> None:
        del backend
        if hasattr(model, "build") and not model.built:
            raise ValueError("Model must be built first. Run `model.build(input_shape)`.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                         None)
        self._save_model()
        super().__init__(bcast_object=_api.broadcast_object, get_rank=_api.rank, **kwargs)

    def _variables(self) -> List[Any]:
        return list(self.model.variables) + _flavor.optimizer_variables(self.optimizer)

    def sync(self) -> None:
        """Sets every rank's variables and attributes to rank 0's, and saves them. An
        optimizer that has made no step yet (a worker that just joined) builds its slots
        first, so that every rank broadcasts the same variables."""
        opt = self.optimizer
        if opt is not None and not _flavor.optimizer_built(opt):
            _flavor.build_optimizer(opt, self.model.trainable_variables)
        broadcast_variables(self._variables(), 0, name="KerasState.sync")
        self._save_model()
        super().sync()

    def _save_model(self) -> None:
        # An optimizer builds its slots on the first step: the variables saved are the ones
        # that exist now, matched by position when restored.
        self._saved = [np.array(_backend.to_numpy(v), copy=True) for v in self._variables()]

    def _load_model(self) -> None:
        for v, value in zip(self._variables(), self._saved):
            _backend.assign(v, value)


class CommitStateCallback(keras.callbacks.Callback):
    """Commits ``state`` every ``batches_per_commit`` batches and at every epoch end."""

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        # Every rank starts counting anew after a reset, so that all commit together.
        self.batches_remaining = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keeps ``state.batch`` at the number of batches of the current epoch done (0 after each
    epoch). After a reset, with ``steps_per_epoch``, the interrupted epoch resumes where its
    last commit left it and ends after the batches it still lacks: none is lost and none is
    trained twice.

    Keras 3 runs every epoch of one ``fit`` for ``steps_per_epoch`` steps whatever
    ``params["steps"]`` says (Horovod's way of shortening it, which Keras 2 honoured): this
    ends the short epoch by setting ``model.stop_training`` after its last batch, which
    makes ``fit`` leave the epoch, and clears it again at that epoch's end, so the following
    epochs run. Put this callback before ``CommitStateCallback``, so that a commit holds the
    batch just done.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.steps_per_epoch: Optional[int] = None
        self._offset = 0  # batches of this epoch done before this fit
        self._ended_epoch = False

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.steps_per_epoch = None
        self._ended_epoch = False

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        self._offset = int(self.state.batch)
        params = self.params or {}
        if params.get("steps"):
            if self.steps_per_epoch is None:
                self.steps_per_epoch = params.get("steps")
            params["steps"] = self.steps_per_epoch - self._offset

    def on_train_batch_end(self, batch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = self._offset + batch + 1
        if (self._offset and self.steps_per_epoch
                and self.state.batch >= self.steps_per_epoch and not self.model.stop_training):
            self.model.stop_training = True
            self._ended_epoch = True

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        self.state.batch = 0
        self._offset = 0
        if self._ended_epoch:
            self.model.stop_training = False
            self._ended_epoch = False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keeps ``state.epoch`` at the number of epochs done, counted across resets.

    Scripts resume a fit in either of two ways after a reset: ``fit(..., initial_epoch=
    state.epoch, epochs=EPOCHS)``, where Keras numbers the epochs from ``state.epoch``, or
    Horovod's ``fit(..., epochs=EPOCHS - state.epoch)``, where it numbers them from 0. The
    first epoch a fit begins says which: epochs done are counted from it."""

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = self.state.epoch
        self._first: Optional[int] = None

    def on_train_begin(self, logs: Optional[dict] = None) -> None:
        self.initial_epoch = self.state.epoch
        self._first = None

    def on_epoch_begin(self, epoch: int, logs: Optional[dict] = None) -> None:
        if self._first is None:
            self._first = epoch

    def on_epoch_end(self, epoch: int, logs: Optional[dict] = None) -> None:
        first = epoch if self._first is None else self._first
        # +1: a reset after state.batch went back to 0 must not repeat the finished epoch.
        self.state.epoch = self.initial_epoch + (epoch - first) + 1


def _reset() -> None:
    from .functions import init

    _api.shutdown()
    init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator running ``func(state, ...)`` elastically (see
    ``ferrovod.elastic.state.run_fn``). On the TensorFlow backend it also turns a failed
    collective inside ``tf.function`` into ``HorovodInternalError``, as
    ``ferrovod.tensorflow.elastic.run`` does."""
    if _backend.backend() == "tensorflow":
        return keras_hooks("tensorflow").elastic_run(func)
    return run_fn(func, _reset)
