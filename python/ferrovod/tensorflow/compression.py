"""Gradient compression for allreduce: ``Compression.none``, ``Compression.fp16`` and
``Compression.bf16`` (Horovod's API: classes with static ``compress`` / ``decompress``), made
of TensorFlow casts so they work eagerly and inside ``tf.function``."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import tensorflow as tf

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


class Compressor:
    """Interface: ``compress(tensor) -> (compressed, ctx)``, ``decompress(compressed, ctx)``."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        """Returns the tensor to send and whatever ``decompress`` needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Turns a received (reduced) tensor back into the original dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> Tuple[tf.Tensor, Any]:
        """Returns ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        """Returns ``tensor`` unchanged."""
        return tensor


class _CastCompressor(Compressor):
    wire: tf.DType = tf.float16

    @classmethod
    def compress(cls, tensor: tf.Tensor) -> Tuple[tf.Tensor, Optional[tf.DType]]:
        """Casts floating-point tensors to the wire dtype; others pass unchanged."""
        tensor = tf.convert_to_tensor(tensor)
        if tensor.dtype.is_floating and tensor.dtype != cls.wire:
            return tf.cast(tensor, cls.wire), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: tf.Tensor, ctx: Optional[tf.DType]) -> tf.Tensor:
        """Casts back to the dtype ``compress`` saw."""
        return tensor if ctx is None else tf.cast(tensor, ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16 (half the bytes; ~3 significant digits)."""

    wire = tf.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (float32's range, ~2 significant digits)."""

    wire = tf.bfloat16


class Compression:
    """The available compressors: ``none``, ``fp16`` (as in Horovod) and ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
