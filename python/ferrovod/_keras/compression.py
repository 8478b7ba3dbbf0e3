"""Backend-neutral gradient compression for the Keras adapters.

``ferrovod.keras`` must not import TensorFlow when Keras runs on another backend, so its
``Compression`` holds these NumPy compressors. They double as *markers*: when the optimizer
reduces backend tensors, :func:`kind_of` names the compressor (``none``, ``fp16``, ``bf16``)
and the backend's own compressor of that kind does the work (``ferrovod.tensorflow``'s or
``ferrovod.torch``'s), so ``ferrovod.tensorflow.Compression.fp16`` and
``ferrovod.keras.Compression.fp16`` are interchangeable everywhere.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "kind_of"]


class _NumpyCast(CastCompressor):
    @staticmethod
    def _as_tensor(tensor: Any) -> np.ndarray:
        return np.asarray(tensor)

    @staticmethod
    def _is_float(tensor: np.ndarray) -> bool:
        return tensor.dtype.kind == "f"

    @staticmethod
    def _cast(tensor: Any, dtype: Any) -> np.ndarray:
        return np.asarray(tensor).astype(dtype)


class FP16Compressor(_NumpyCast):
    """Sends floating-point arrays as float16 (half the bytes; ~3 significant digits)."""

    wire = np.dtype(np.float16)


class BF16Compressor(_NumpyCast):
    """Sends floating-point arrays as bfloat16 (needs ``ml_dtypes``)."""

    @classmethod
    def wire_dtype(cls) -> Any:
        """bfloat16, from ``ml_dtypes`` (imported only when this compressor is used)."""
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)


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
