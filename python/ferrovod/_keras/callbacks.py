"""Keras callbacks for data-parallel training (Horovod's ``hvd.callbacks``).

* ``BroadcastGlobalVariablesCallback`` — every rank starts from the root's weights.
* ``MetricAverageCallback`` — epoch-end metrics averaged over ranks.
* ``LearningRateScheduleCallback`` / ``LearningRateWarmupCallback`` — lr schedules with
  momentum correction (Goyal et al., "Accurate, Large Minibatch SGD", 2017).
* ``BestModelCheckpoint`` — ``ModelCheckpoint(save_best_only=True)``.

They work on every Keras backend ferrovod supports: values travel through the
framework-free API as NumPy arrays, outside the compiled training step. They derive from the
``Callback`` of the Keras ``tf.keras`` means (Keras 2's ``tf_keras`` with
``TF_USE_LEGACY_KERAS=1``, otherwise Keras 3), since each Keras' ``fit`` takes only its own.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from .. import _api
from .._api import Average
from . import _backend, _flavor
from .functions import broadcast_variables, model_variables

keras = _flavor.keras()

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback",
           "LearningRateScheduleCallback", "LearningRateWarmupCallback", "BestModelCheckpoint"]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Broadcasts the model's and the optimizer's variables from ``root_rank`` to every rank.

    When: at train begin — Keras 3's ``fit`` builds the optimizer (creates its slots) before
    ``on_train_begin``, so weights *and* slots are the root's before the first step, and every
    rank computes its first gradients on the same weights (weights stay identical from step 1
    on). Horovod broadcasts at the end of the first batch, because tf.keras created slots
    lazily; this callback does that too when the optimizer's variables were not all there at
    train begin (a custom ``train_step`` that builds lazily), so nothing is missed. It runs
    once per callback object (a second ``fit`` with the same callback does not broadcast).

    What: ``model.variables`` (trainable and not, e.g. BatchNorm statistics) and
    ``model.optimizer.variables``, except ``local_variables``, variables registered with the
    optimizer's ``register_local_var``, and layers' random-seed states (so that Dropout masks
    differ between ranks). The ranks first compare shapes and dtypes and all raise the same
    ValueError when their models differ.

    Args:
        root_rank: the rank whose values everyone takes.
        device: accepted for Horovod compatibility.
        local_variables: variables to leave alone.
    """

    def __init__(self, root_rank: int, device: str = "",
                 local_variables: Optional[Sequence[Any]] = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.local_variables = list(local_variables or [])
        self.broadcast_done = False
        self._sent = -1

    def _broadcast(self) -> int:
        if not getattr(self.model, "built", True):
            # A Keras 2 model given no input shape is built by its first batch: nothing to
            # send yet, and the first batch's end sends everything (as Horovod always did).
            return 0
        variables = model_variables(self.model, exclude=self.local_variables)
        broadcast_variables(variables, self.root_rank, name="BroadcastGlobalVariablesCallback")
        return len(variables)

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        """Broadcasts everything that exists now (weights and, in ``fit``, optimizer slots)."""
        if not self.broadcast_done and self._sent < 0:
            self._sent = self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """After the first batch: broadcasts again if the step created new variables."""
        if self.broadcast_done:
            return
        if len(model_variables(self.model, exclude=self.local_variables)) != self._sent:
            self._broadcast()
        self.broadcast_done = True


def _is_number(value: Any) -> bool:
    """A real scalar (Python number, NumPy scalar or 0-d array/tensor)."""
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - whatever NumPy cannot read is not a metric
        return False
    return arr.ndim == 0 and (arr.dtype.kind in "biuf")


class MetricAverageCallback(keras.callbacks.Callback):
    """Averages every metric in ``logs`` over the ranks at the end of each epoch (sorted key
    order, one allreduce), so callbacks after it and ``History`` see the job's values.

    Put it before callbacks that read the metrics (checkpointing, early stopping, lr on
    plateau). The ranks must report the same metric names; when they do not, every rank
    raises a ValueError naming the difference.
    """

    def __init__(self, device: str = "") -> None:
        super().__init__()
        self.device = device
        self._checked: Optional[List[str]] = None

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Replaces each scalar value in ``logs`` by its mean over the ranks."""
        if logs is None:
            return
        keys = sorted(k for k, v in logs.items() if _is_number(v))
        if keys != self._checked:
            everyone = _api.allgather_object(keys, name="MetricAverageCallback.keys")
            for r, other in enumerate(everyone):
                if other != keys:
                    raise ValueError(f"MetricAverageCallback: ranks report different metrics: "
                                     f"rank {_api.rank()} has {keys}, rank {r} has {other}")
            self._checked = keys
        if not keys:
            return
        values = np.array([float(logs[k]) for k in keys], dtype=np.float64)
        avg = _api.allreduce(values, op=Average, name="MetricAverageCallback")
        for k, a in zip(keys, avg):
            logs[k] = float(a)


def _lr_variable(optimizer: Any, who: str) -> Any:
    lr = optimizer.learning_rate  # LossScaleOptimizer forwards to its inner optimizer
    if not callable(getattr(lr, "assign", None)):  # a Keras 3 or a TF variable
        raise ValueError(f"{who} sets the optimizer's learning rate batch by batch, so the "
                         "optimizer needs a constant learning rate (a float), not a "
                         "LearningRateSchedule or a callable")
    return lr


def _value(x: Any) -> float:
    return float(np.asarray(_backend.to_numpy(x)))


def _momentum_slots(optimizer: Any, model: Any) -> List[Any]:
    """The momentum buffers of optimizers that fold the learning rate into them (SGD,
    RMSprop): those are what Goyal et al.'s momentum correction rescales. Keras 3 and Keras
    2's current optimizers keep them in a list; Keras 2's legacy ones as slots per variable."""
    opt = getattr(optimizer, "inner_optimizer", optimizer)
    momentum = getattr(opt, "momentum", 0)
    if not _value(momentum):
        return []
    for attr in ("momentums", "_momentums"):
        slots = getattr(opt, attr, None)
        if slots:
            return [s for s in slots if s is not None]
    if "momentum" in getattr(opt, "get_slot_names", lambda: [])():
        if not getattr(model, "built", True):
            return []  # built by its first batch (no input shape): no buffers yet
        try:
            return [opt.get_slot(v, "momentum") for v in model.trainable_variables]
        except KeyError:  # before the first update: no buffers to rescale yet
            return []
    return []


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Sets ``lr = initial_lr * multiplier(epoch)`` for epochs in ``[start_epoch, end_epoch)``.

    ``multiplier`` is a function of the epoch, or a constant ``m`` meaning exponential decay,
    ``m ** (epoch - start_epoch)``. With ``staircase=True`` the lr changes at the first batch
    of each epoch, otherwise at every batch, with the fractional epoch
    ``epoch + batch / steps_per_epoch`` (``steps_per_epoch`` is read from ``fit`` when not
    given).

    Momentum correction: when the lr changes from ``old`` to ``new``, SGD/RMSprop momentum
    buffers (which hold lr-scaled velocities in Keras) are multiplied by ``new / old`` before
    the step — the same update as Horovod's temporary momentum ``m * new / old`` for one
    batch, done on the buffers because Keras 3 bakes the momentum coefficient into the
    compiled step. The lr at the end of an epoch is logged as ``logs["lr"]``.
    """

    def __init__(self, initial_lr: float, multiplier: Union[float, Callable[[float], float]],
                 start_epoch: int = 0, end_epoch: Optional[int] = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: Optional[int] = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = float(initial_lr)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch: Optional[int] = None
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            self.multiplier = lambda epoch: multiplier ** (epoch - start_epoch)

    def _autodetect_steps_per_epoch(self) -> int:
        params = self.params or {}
        steps = params.get("steps")
        if steps:
            return int(steps)
        if params.get("samples") and params.get("batch_size"):  # Keras 2's v1 graph loop
            return -(-int(params["samples"]) // int(params["batch_size"]))
        raise ValueError(f"Could not autodetect the number of steps per epoch (fit() did not "
                         f"report it); pass steps_per_epoch to {type(self).__name__}()")

    def _adjust_learning_rate(self, epoch: float) -> None:
        lr = _lr_variable(self.model.optimizer, type(self).__name__)
        old = _value(lr)
        new = self.initial_lr * self.multiplier(epoch)
        _backend.assign(lr, new)
        if self.momentum_correction and old != 0 and new != old:
            ratio = new / old
            for slot in _momentum_slots(self.model.optimizer, self.model):
                _backend.assign(slot, _backend.to_numpy(slot) * ratio)

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        """Finds steps per epoch when the schedule changes within epochs."""
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._autodetect_steps_per_epoch()

    def on_epoch_begin(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Remembers the epoch for the per-batch adjustment."""
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Sets the lr for this batch (first batch of the epoch only with ``staircase``)."""
        epoch = self.current_epoch or 0
        if epoch < self.start_epoch or (self.end_epoch is not None and epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(epoch)
        else:
            self._adjust_learning_rate(epoch + float(batch) / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Logs the current lr as ``logs["lr"]``."""
        if logs is not None:
            lr = self.model.optimizer.learning_rate
            logs["lr"] = _value(lr)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Gradual warm-up (Goyal et al.): over ``warmup_epochs`` the lr rises linearly, batch by
    batch, from ``initial_lr / size`` to ``initial_lr`` (the lr scaled for the job's size).

    At epoch ``e``, batch ``b`` (``s`` steps per epoch, ``n`` ranks, ``w`` warm-up epochs):
    ``lr = initial_lr / n * ((e + (b + 1) / s) * (n - 1) / w + 1)`` — reaching ``initial_lr``
    exactly at the last batch of the warm-up. Afterwards the lr is left as it is.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: Optional[int] = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # +1/steps: the last batch of an epoch lands on a round number (Horovod's choice).
            epoch += 1.0 / self.steps_per_epoch
            n = _api.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.warmup_epochs = warmup_epochs
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        """Logs the lr; says when the warm-up has finished (``verbose``)."""
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and _api.rank() == 0:
            lr = _value(self.model.optimizer.learning_rate)
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {lr:g}.")


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``).

    Horovod leaves ``filepath`` to be set later (its Spark estimator does); here it may be
    given, or assigned to ``.filepath`` before training. Add it on rank 0 only.
    """

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: Union[str, int] = "epoch", filepath: Optional[str] = None) -> None:
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or placeholder, monitor=monitor, verbose=verbose,
                         save_best_only=True, save_weights_only=save_weights_only, mode=mode,
                         save_freq=save_freq)
        self.filepath = filepath

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        """Checks that a file path was set."""
        if not self.filepath:
            raise ValueError("BestModelCheckpoint needs a filepath: pass filepath= or set "
                             "callback.filepath before training")
        super().on_train_begin(logs)
