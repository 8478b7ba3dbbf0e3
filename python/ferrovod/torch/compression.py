"""Gradient compression for allreduce: ``Compression.none``, ``Compression.fp16`` and
``Compression.bf16`` (Horovod's API: classes with static ``compress`` / ``decompress``)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch


class Compressor:
    """Interface: ``compress(tensor) -> (compressed, ctx)``, ``decompress(compressed, ctx)``."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Returns the tensor to send and whatever ``decompress`` needs to undo it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Turns a received (reduced) tensor back into the original dtype."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Tuple[torch.Tensor, Any]:
        """Returns ``tensor`` unchanged."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns ``tensor`` unchanged."""
        return tensor


class _CastCompressor(Compressor):
    wire: torch.dtype = torch.float16

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.dtype]]:
        """Casts floating-point tensors to the wire dtype; others pass unchanged."""
        if tensor.dtype.is_floating_point and tensor.dtype != cls.wire:
            return tensor.type(cls.wire), tensor.dtype
        return tensor, None

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Optional[torch.dtype]) -> torch.Tensor:
        """Casts back to the dtype ``compress`` saw."""
        return tensor if ctx is None else tensor.type(ctx)


class FP16Compressor(_CastCompressor):
    """Sends floating-point tensors as float16 (half the bytes; ~3 significant digits)."""

    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """Sends floating-point tensors as bfloat16 (float32's range, ~2 significant digits)."""

    wire = torch.bfloat16


class Compression:
    """The available compressors: ``none``, ``fp16``, ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
