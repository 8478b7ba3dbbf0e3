"""Gradient compression for ``DistributedTrainer`` (Horovod's ``horovod.mxnet.compression``),
on the compressors every framework module shares (``ferrovod._compression``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._compression import CastCompressor, Compressor, NoneCompressor

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class FP16Compressor(CastCompressor):
    """Sends floating-point NDArrays as float16."""

    wire = np.dtype(np.float16)

    @staticmethod
    def _is_float(tensor: Any) -> bool:
        return np.dtype(tensor.dtype).kind == "f"

    @staticmethod
    def _cast(tensor: Any, dtype: Any) -> Any:
        return tensor.astype(dtype, copy=False)


class Compression:
    """The compression algorithms: ``none`` (default) and ``fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
