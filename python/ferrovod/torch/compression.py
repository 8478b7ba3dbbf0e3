"""Gradient compression for allreduce: ``Compression.none``, ``Compression.fp16`` and
``Compression.bf16`` (Horovod's API: classes with static ``compress`` / ``decompress``)."""

from __future__ import annotations

from typing import Any

import torch

from .._compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor"]


class _TorchCast(CastCompressor):
    @staticmethod
    def _is_float(tensor: torch.Tensor) -> bool:
        return tensor.dtype.is_floating_point

    @staticmethod
    def _cast(tensor: torch.Tensor, dtype: Any) -> torch.Tensor:
        return tensor.type(dtype)


class FP16Compressor(_TorchCast):
    """Sends floating-point tensors as float16 (half the bytes; ~3 significant digits)."""

    wire = torch.float16


class BF16Compressor(_TorchCast):
    """Sends floating-point tensors as bfloat16 (float32's range, ~2 significant digits)."""

    wire = torch.bfloat16


class Compression:
    """The available compressors: ``none``, ``fp16``, ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
