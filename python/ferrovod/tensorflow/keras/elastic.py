"""Elastic training with Keras 3: Horovod's ``KerasState``, the state callbacks and ``run``
(see ``ferrovod._keras.elastic``)."""

from ..._keras.elastic import (
    CommitStateCallback,
    KerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

#: Horovod's other name for it here.
TensorFlowKerasState = KerasState

__all__ = ["KerasState", "TensorFlowKerasState", "CommitStateCallback",
           "UpdateBatchStateCallback", "UpdateEpochStateCallback", "run"]
