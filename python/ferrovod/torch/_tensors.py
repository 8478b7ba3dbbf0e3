"""What every torch op of ferrovod shares: the engine's code of a tensor's dtype, the check
that an argument is a dense tensor, and this rank's place in a process set."""

from __future__ import annotations

from typing import Any

import torch

from .. import _api
from ..process_sets import ProcessSet

_CODES = {
    getattr(torch, n): _api._DTYPES[n]
    for n in ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
              "float64", "bool")
}


def _code(t: torch.Tensor, what: str) -> int:
    code = _CODES.get(t.dtype)
    if code is None:
        names = ", ".join(str(d).replace("torch.", "") for d in _CODES)
        raise _api._BadArgument(f"{what}: dtype {t.dtype} is not supported (supported: {names})")
    return code


def _check_tensor(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _api._BadArgument(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise _api._BadArgument(
            f"{what}: {t.layout} tensors are not supported here (sparse gradients go through "
            "sparse_allreduce_async)")
    return t


def _set_size(process_set: ProcessSet) -> int:
    if process_set.process_set_id == 0 or not process_set.ranks:
        return _api.size()
    return len(process_set.ranks)


def _set_rank(process_set: ProcessSet) -> int:
    if process_set.process_set_id == 0 or not process_set.ranks:
        return _api.rank()
    return process_set.ranks.index(_api.rank())
