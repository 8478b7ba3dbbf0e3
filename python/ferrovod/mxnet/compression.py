"""Gradient compression for ``DistributedTrainer`` (Horovod's ``horovod.mxnet.compression``)."""

from __future__ import annotations

from typing import Any, Tuple


class Compressor:
    """Compresses a tensor before a collective and restores it after."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        """The tensor to send and what :meth:`decompress` needs to restore it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """The received tensor restored."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16."""

    @staticmethod
    def compress(tensor: Any) -> Tuple[Any, Any]:
        if "float" in str(tensor.dtype):
            return tensor.astype("float16", copy=False), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if "float" in str(ctx):
            return tensor.astype(ctx, copy=False)
        return tensor


class Compression:
    """The compression algorithms: ``none`` (default) and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
