"""The shape every framework's gradient compression shares (Horovod's API: classes with static
``compress`` / ``decompress``): the interface, the no-op compressor, and a compressor that
casts floating-point tensors to a narrower wire dtype and back. A framework module
(``ferrovod.torch``, ``ferrovod.tensorflow``, the Keras adapters) supplies only how to tell a
floating-point tensor and how to cast; this module imports no framework.

The class names ``NoneCompressor``, ``FP16Compressor`` and ``BF16Compressor`` are the same in
every framework module: the Keras adapters match compressors by name across frameworks.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple


class Compressor:
    """Interface: ``compress(tensor) -> (compressed, ctx)``, ``decompress(compressed, ctx)``."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """Returns the tensor to send and whatever ``decompress`` needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Turns a received (reduced) tensor back into the original dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """Returns ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Returns ``tensor`` unchanged."""
        return tensor


class CastCompressor(Compressor):
    """Casts floating-point tensors to :meth:`wire_dtype` and back; other dtypes pass unchanged.
    Subclasses define ``_as_tensor``, ``_is_float``, ``_cast`` and the wire dtype."""

    wire: Any = None

    @classmethod
    def wire_dtype(cls) -> Any:
        """The dtype tensors travel in."""
        return cls.wire

    @staticmethod
    def _as_tensor(tensor: Any) -> Any:
        return tensor

    @staticmethod
    def _is_float(tensor: Any) -> bool:
        raise NotImplementedError

    @staticmethod
    def _cast(tensor: Any, dtype: Any) -> Any:
        raise NotImplementedError

    @classmethod
    def compress(cls, tensor: Any) -> Tuple[Any, Optional[Any]]:
        """Casts floating-point tensors to the wire dtype; others pass unchanged."""
        tensor = cls._as_tensor(tensor)
        wire = cls.wire_dtype()
        if cls._is_float(tensor) and tensor.dtype != wire:
            return cls._cast(tensor, wire), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: Any, ctx: Optional[Any]) -> Any:
        """Casts back to the dtype ``compress`` saw."""
        return tensor if ctx is None else cls._cast(tensor, ctx)
