"""Backend-neutral gradient compression for the Keras adapters.

``ferrovod.keras`` must not import TensorFlow when Keras runs on another backend, so its
``Compression`` holds these NumPy compressors. They double as *markers*: when the optimizer
reduces backend tensors, :func:`kind_of` names the compressor (``none``, ``fp16``, ``bf16``)
and the backend's own compressor of that kind does the work (``ferrovod.tensorflow``'s or
``ferrovod.torch``'s), so ``ferrovod.tensorflow.Compression.fp16`` and
``ferrovod.keras.Compression.fp16`` are interchangeable everywhere.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

__all__ = ["Compression", "Compressor", "kind_of"]


class Compressor:
    """Interface: ``compress(array) -> (compressed, ctx)``, ``decompress(compressed, ctx)``."""

    @staticmethod
    def compress(tensor: np.ndarray) -> Tuple[np.ndarray, Any]:
        """Returns the array to send and whatever ``decompress`` needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        """Turns a received (reduced) array back into the original dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends arrays as they are."""

    @staticmethod
    def compress(tensor: np.ndarray) -> Tuple[np.ndarray, Any]:
        """Returns ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: np.ndarray, ctx: Any) -> np.ndarray:
        """Returns ``tensor`` unchanged."""
        return tensor


class _CastCompressor(Compressor):
    wire: Any = np.float16

    @classmethod
    def compress(cls, tensor: np.ndarray) -> Tuple[np.ndarray, Optional[np.dtype]]:
        """Casts floating-point arrays to the wire dtype; others pass unchanged."""
        tensor = np.asarray(tensor)
        wire = np.dtype(cls.wire)
        if tensor.dtype.kind == "f" and tensor.dtype != wire:
            return tensor.astype(wire), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: np.ndarray, ctx: Optional[np.dtype]) -> np.ndarray:
        """Casts back to the dtype ``compress`` saw."""
        return tensor if ctx is None else np.asarray(tensor).astype(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point arrays as float16 (half the bytes; ~3 significant digits)."""

    wire = np.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point arrays as bfloat16 (needs ``ml_dtypes``)."""

    @classmethod
    def compress(cls, tensor: np.ndarray) -> Tuple[np.ndarray, Optional[np.dtype]]:
        """Casts floating-point arrays to bfloat16."""
        import ml_dtypes  # only this compressor needs it

        cls.wire = ml_dtypes.bfloat16
        return super().compress(tensor)


class Compression:
    """The available compressors: ``none``, ``fp16``, ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_KINDS = {"NoneCompressor": "none", "FP16Compressor": "fp16", "BF16Compressor": "bf16"}


def kind_of(compression: Any) -> Optional[str]:
    """``"none"``, ``"fp16"`` or ``"bf16"`` for any framework's built-in compressor (matched by
    class name, which ferrovod's TensorFlow, torch and NumPy compressors share); None for a
    user-defined compressor, which is then used as it is."""
    if compression is None:
        return "none"
    name = getattr(compression, "__name__", type(compression).__name__)
    return _KINDS.get(name)
