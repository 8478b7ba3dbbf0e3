"""Where a torch op's CUDA tensors go: the engine's NCCL path as they are (:func:`_cuda_target`
says so, with the device and its current stream), or through host memory, saying once why.
Every rank decides alike from what the negotiation checks to be the same everywhere. Also the
descriptions of device tensors the engine reads and writes where they lie, and the host-side
exchange that sizes an allgather's or alltoall's device outputs before the op."""

from __future__ import annotations

import warnings
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import _api, _build_info, _core
from .._api import Sum
from ..process_sets import ProcessSet, global_process_set
from ._tensors import _code, _set_size

_staging_warned: set = set()


def _warn_staging(device: torch.device, why: str) -> None:
    """Says once per process and reason that device tensors go through host memory."""
    if why in _staging_warned:
        return
    _staging_warned.add(why)
    warnings.warn(
        f"ferrovod: {device.type} tensors are copied to host memory for this collective and "
        f"back ({why}); expect host-memory speed, not NCCL's",
        RuntimeWarning, stacklevel=4,
    )


_device_path_answer: Optional[Tuple[bool, str]] = None


def _device_path() -> Tuple[bool, str]:
    """``(usable, why)``: whether CUDA tensors can take the engine's NCCL path in this process
    (the native core's answer: NCCL found and accepted, CUDA driver working), asked once — the
    first time a CUDA tensor is seen, so a CPU job never loads the GPU libraries."""
    global _device_path_answer
    if _device_path_answer is None:
        usable, why = _core.device_path(_build_info._nccl_wheel_dirs())
        _device_path_answer = (bool(usable), str(why))
    return _device_path_answer


def _cuda_target(tensors: Sequence[torch.Tensor], kind: int, what: str, op: int = Sum,
                 prescale: float = 1.0, postscale: float = 1.0,
                 process_set: ProcessSet = global_process_set) -> Optional[Tuple[int, int]]:
    """``(device ordinal, current stream)`` when ``tensors`` go to the NCCL path as they are;
    ``None`` when they are staged through host memory (CPU tensors; CUDA tensors with a
    one-time warning saying why). Every rank decides alike from what the negotiation checks to
    be the same everywhere (kind, dtype, shape, op, scale factors), so ranks never split
    between the two paths unless their setups differ, which the negotiation reports."""
    devices = {t.device for t in tensors}
    if not any(d.type == "cuda" for d in devices):
        return None
    dev = next(d for d in devices if d.type == "cuda")
    if len(devices) != 1:
        _warn_staging(dev, "the tensors of one op are on different devices")
        return None
    usable, why = _device_path()
    if not usable:
        _warn_staging(dev, f"the NCCL path cannot be used: {why}")
        return None
    sized = kind in (_core.ALLGATHER, _core.ALLTOALL)
    # An allgather's or alltoall's rows differ between ranks, so they cannot decide on them;
    # a 0-d tensor is refused after the sizes are exchanged (see _device_sizes).
    if not sized and any(t.numel() == 0 for t in tensors):
        return None
    n = _set_size(process_set)
    for t in tensors:
        shape = list(t.shape) if t.dim() or not sized else [1]
        reason = _core.device_op_check(int(kind), _code(t, what), int(op), float(prescale),
                                       float(postscale), n, shape)
        if reason is not None:
            _warn_staging(dev, reason)
            return None
    return int(dev.index), _raw_stream(dev)


def _raw_stream(dev: torch.device) -> int:
    """The handle of ``dev``'s current stream. torch's private accessor returns it without
    building a ``torch.cuda.Stream`` (about 3.5 us of a 4 B allreduce's 40 on one H200);
    ``current_stream`` where a torch lacks it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(dev.index))
    return int(torch.cuda.current_stream(dev).cuda_stream)


def _on_device(t: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """A contiguous tensor on ``t``'s device holding its values, and whether it is a copy."""
    h = t.detach()
    if h.is_contiguous():
        return h, False
    return h.contiguous(), True


def _ddesc(h: torch.Tensor, out: Optional[torch.Tensor], what: str) -> Tuple[int, int, int, List[int], int]:
    """A device tensor's description (an empty one at a placeholder address, see
    :func:`_dev_addr`)."""
    return (_dev_addr(h), h.numel() * h.element_size(), _code(h, what), list(h.shape),
            0 if out is None else _dev_addr(out))


_DEVICE_EMPTY: dict = {}


def _dev_addr(t: torch.Tensor) -> int:
    """``t``'s device address; for an empty tensor (whose address may be 0) that of a
    placeholder on its device, which the engine never reads or writes."""
    if t.numel():
        return int(t.data_ptr())
    e = _DEVICE_EMPTY.get(t.device)
    if e is None:
        e = _DEVICE_EMPTY[t.device] = torch.empty(1, dtype=torch.uint8, device=t.device)
    return int(e.data_ptr())


def _device_sizes(kind: int, mine: List[int], name: str,
                  process_set: ProcessSet) -> Optional[np.ndarray]:
    """The sizes a CUDA allgather's or alltoall's outputs are allocated with, exchanged on the
    host before the op (the engine allocates no device memory): every rank's first dimensions
    (``ALLGATHER``, a ``(ranks, tensors)`` array) or the rows each rank sends this one
    (``ALLTOALL``). ``None`` when a rank marked its arguments refused (-1): then every rank
    takes the host path, where the refusal is negotiated and raised on every rank."""
    sizes = np.asarray(mine, dtype=np.int64)
    if kind == _core.ALLGATHER:
        got = _api.allgather(sizes, f"{name}.sizes", process_set).reshape(-1, len(mine))
    else:
        got, _ = _api.alltoall(sizes, [1] * len(mine), f"{name}.sizes", process_set)
    # This rank's own sizes are among those it gets back.
    if (got < 0).any():
        return None
    return got


def _device_out(h: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty((int(rows), *h.shape[1:]), dtype=h.dtype, device=h.device)
