"""Gradient compression for allreduce: ``Compression.none``, ``Compression.fp16`` and
``Compression.bf16`` (Horovod's API: classes with static ``compress`` / ``decompress``), made
of TensorFlow casts so they work eagerly and inside ``tf.function``."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from .._compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


class _TFCast(CastCompressor):
    @staticmethod
    def _as_tensor(tensor: Any) -> tf.Tensor:
        return tf.convert_to_tensor(tensor)

    @staticmethod
    def _is_float(tensor: tf.Tensor) -> bool:
        return tensor.dtype.is_floating

    @staticmethod
    def _cast(tensor: tf.Tensor, dtype: Any) -> tf.Tensor:
        return tf.cast(tensor, dtype)


class FP16Compressor(_TFCast):
    """Sends floating-point tensors as float16 (half the bytes; ~3 significant digits)."""

    wire = tf.float16


class BF16Compressor(_TFCast):
    """Sends floating-point tensors as bfloat16 (float32's range, ~2 significant digits)."""

    wire = tf.bfloat16


class Compression:
    """The available compressors: ``none``, ``fp16`` (as in Horovod) and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
