"""Elastic training with Keras 3: Horovod's ``KerasState``, the state callbacks and ``run``
(see ``ferrovod._keras.elastic``)."""

from .._keras.elastic import (
    CommitStateCallback,
    KerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

__all__ = ["KerasState", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
