"""``SyncBatchNormalization``: a Keras ``BatchNormalization`` whose training-time batch
statistics span every rank's batch (Horovod's ``hvd.SyncBatchNormalization``).

Each training call allreduces one small tensor: per-channel sums of x and x², and the count,
in float64 so the one-pass variance stays accurate; ranks may have different batch sizes.
The allreduce is differentiable, so the gradient flows to every rank's inputs. With a mask,
only unmasked positions count. In inference, or on one rank, it is plain batch normalization.
"""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import tensorflow as tf

from .. import _api
from .._api import Sum
from .._keras._flavor import keras, legacy_requested
from . import mpi_ops as _ops

__all__ = ["SyncBatchNormalization"]

_BatchNormalization = keras().layers.BatchNormalization
_KERAS2 = legacy_requested()  # keras() is tf_keras exactly then


def _global_moments(inputs: Any, axes: Sequence[int], mask: Any) -> Tuple[tf.Tensor, tf.Tensor]:
    """Mean and variance over ``axes`` of every rank's ``inputs`` (the unmasked positions),
    from one allreduce of per-channel sums of x and x² and the count, in float64."""
    axes = list(axes)
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


class SyncBatchNormalization(_BatchNormalization):
    """Batch normalization with statistics from every rank's batch (TensorFlow backend).

    A layer of the Keras ``tf.keras`` means (Keras 2's ``tf_keras`` with
    ``TF_USE_LEGACY_KERAS=1``, otherwise Keras 3). Arguments as its ``BatchNormalization``;
    ``fused`` is accepted for Horovod compatibility and must be False (there is no fused
    kernel here).
    """

    def __init__(self, fused: Any = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if not kwargs.get("name"):
            kwargs["name"] = "sync_batch_normalization"
        if _KERAS2:
            # Keras 2 would pick its fused kernel, which bypasses the moments below.
            kwargs["fused"] = False
        super().__init__(**kwargs)

    if _KERAS2:
        def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Sequence[int],
                                    keep_dims: bool, mask: Any = None
                                    ) -> Tuple[tf.Tensor, tf.Tensor]:
            if _api.size() == 1:
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims,
                                                       mask=mask)
            mean, variance = _global_moments(inputs, reduction_axes, mask)
            if keep_dims:
                shape = [1 if i in reduction_axes else d for i, d in
                         enumerate(tf.unstack(tf.shape(inputs)))]
                mean, variance = tf.reshape(mean, shape), tf.reshape(variance, shape)
            return mean, variance
    else:
        def _moments(self, inputs: Any, mask: Any) -> Tuple[tf.Tensor, tf.Tensor]:
            if _api.size() == 1:
                return super()._moments(inputs, mask)
            return _global_moments(inputs, self._reduction_axes, mask)
