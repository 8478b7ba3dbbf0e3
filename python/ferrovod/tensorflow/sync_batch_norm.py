"""``SyncBatchNormalization``: a Keras ``BatchNormalization`` whose training-time batch
statistics span every rank's batch (Horovod's ``hvd.SyncBatchNormalization``).

Each training call allreduces one small tensor: per-channel sums of x and x², and the count,
in float64 so the one-pass variance stays accurate; ranks may have different batch sizes.
The allreduce is differentiable, so the gradient flows to every rank's inputs. With a mask,
only unmasked positions count. In inference, or on one rank, it is plain batch normalization.
"""

from __future__ import annotations

from typing import Any, Tuple

import keras
import tensorflow as tf

from .. import _api
from .._api import Sum
from . import mpi_ops as _ops

__all__ = ["SyncBatchNormalization"]


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with statistics from every rank's batch (TensorFlow backend).

    Arguments as ``keras.layers.BatchNormalization``; ``fused`` is accepted for Horovod
    compatibility and must be False (there is no fused kernel here).
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> Tuple[tf.Tensor, tf.Tensor]:
        if _api.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.cast(inputs, tf.float64)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), tf.float64)
            x = x * weights
        local = tf.stack([tf.reduce_sum(x, axes), tf.reduce_sum(x * x, axes),
                          tf.reduce_sum(weights, axes)])
        total = _ops._allreduce(local, op=Sum)
        count = tf.maximum(total[2], 1.0)
        mean = total[0] / count
        variance = tf.maximum(total[1] / count - mean * mean, 0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
