"""Elastic training with PyTorch (Horovod's ``horovod.torch.elastic``): ``run``,
``TorchState`` and ``ElasticSampler``.

``TorchState(model, optimizer, **extras)`` keeps a model, an optimizer, samplers and any
picklable values. ``commit()`` copies them in host memory; after a lost rank ``restore()``
rolls back to that copy; ``sync()`` makes every rank hold rank 0's. The optimizer's state
travels as rank 0's layout first (``broadcast_optimizer_state``), so a new worker whose
optimizer has made no step yet receives every slot instead of disagreeing about them.
"""

from __future__ import annotations

import copy
import math
import random
from typing import Any, Dict, Iterator, List, Optional, Sized, Tuple

import numpy as np
import torch
import torch.utils.data

from .. import _api
from .._api import init, shutdown
from ..elastic.state import ObjectState
from ..elastic import run
from .functions import broadcast_object, broadcast_optimizer_state, broadcast_parameters

# init and shutdown are in Horovod's module too: elastic scripts call them through it.
__all__ = ["run", "TorchState", "ElasticSampler", "init", "shutdown"]


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset over the ranks like ``DistributedSampler``, and after a reset
    over the new ranks, leaving out what the job already processed this epoch.

    The order of an epoch is a shuffle by ``seed + epoch`` (the same on every rank), so the
    samples processed so far are always a prefix of it: ``record_batch`` (or
    ``record_indices``) counts them, and a sampler tracked by a :class:`TorchState` commits,
    restores and syncs that count. Call ``set_epoch(e + 1)`` at the *end* of epoch e.

    Args:
        dataset: anything with a fixed ``len()``.
        shuffle: shuffle the order each epoch (default) or keep the dataset's.
        seed: the shuffle's seed, the same on every rank.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: List[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Starts ``epoch`` with nothing processed (call it when the previous one ended)."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Counts one batch of ``batch_size`` per rank as processed by every rank."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: List[int]) -> None:
        """Counts a batch given by the indices this rank processed (every rank the same
        number)."""
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_num = int(state["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Re-partitions what is left of the epoch over the current ranks."""
        initialized = _api.is_initialized()
        self.num_replicas = _api.size() if initialized else 1
        self.rank = _api.rank() if initialized else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        # Pad by wrapping around so that every rank gets as many samples (as DistributedSampler).
        indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def _copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    # NumPy's copy of host memory measured two to three times faster here than
    # Tensor.copy_ (which splits even a plain memory copy over its thread pool).
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous()
            and src.is_contiguous() and dst.dtype in _NUMPY_SAFE):
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src)


_NUMPY_SAFE = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
               torch.int16, torch.int8, torch.uint8, torch.bool)


def _copy_into(saved: Any, live: Any) -> Any:
    """``live`` (a state dict) copied into ``saved``, the previous commit's copy, reusing its
    tensors where shape and dtype still match: a commit is then one memory copy per tensor,
    without allocating (a deep copy of a 10 M-parameter model with Adam took ten times as
    long)."""
    if isinstance(live, torch.Tensor):
        if (isinstance(saved, torch.Tensor) and saved.shape == live.shape
                and saved.dtype == live.dtype and saved.device == live.device):
            _copy_tensor(saved, live.detach())
            return saved
        return live.detach().clone()
    if isinstance(live, dict):
        old = saved if isinstance(saved, dict) else {}
        return type(live)((k, _copy_into(old.get(k), v)) for k, v in live.items())
    if isinstance(live, (list, tuple)) and type(live) in (list, tuple):
        same = isinstance(saved, (list, tuple)) and len(saved) == len(live)
        return type(live)(_copy_into(saved[i] if same else None, v) for i, v in enumerate(live))
    return copy.deepcopy(live)


class _Handler:
    """Commits, restores and syncs one kind of value a :class:`TorchState` holds."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Any = None
        self.save()

    def save(self) -> None:
        self.saved = _copy_into(self.saved, self.value.state_dict())

    def restore(self) -> None:
        # A copy: load_state_dict may keep the tensors it is given (an optimizer's does), and
        # the next commit writes into these.
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self) -> None:
        raise NotImplementedError()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=0, prefix="elastic.model.")


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(),
                                                    name="elastic.sampler"))


_HANDLERS: List[Tuple[type, type]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
]


class TorchState(ObjectState):
    """The state of a PyTorch training run: ``model``, ``optimizer`` and any keyword
    arguments, exposed as attributes. Modules, optimizers and :class:`ElasticSampler` s are
    committed through their ``state_dict``; everything else must pickle.

    Args:
        model: a ``torch.nn.Module`` (optional).
        optimizer: a ``torch.optim.Optimizer`` (optional).
        kwargs: more values, e.g. ``epoch=0, batch=0``.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: Dict[str, _Handler] = {}
        plain: Dict[str, Any] = {}
        for key, value in kwargs.items():
            cls = next((h for t, h in _HANDLERS if isinstance(value, t)), None)
            if cls is None:
                plain[key] = value
            else:
                handlers[key] = cls(value)
        object.__setattr__(self, "_handlers", handlers)
        for key, handler in handlers.items():
            object.__setattr__(self, key, handler.value)
        super().__init__(bcast_object=lambda obj: broadcast_object(obj, name="elastic.state"),
                         get_rank=_api.rank, **plain)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)

    def save(self) -> None:
        """Copies the model, optimizer, samplers and values to host memory."""
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        """Loads the last committed model, optimizer, samplers and values."""
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        """Makes every rank hold rank 0's model, optimizer, samplers and values."""
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def reset(self) -> None:
        """Re-partitions every sampler over the ranks of the new membership."""
        for handler in self._handlers.values():
            if isinstance(handler, _SamplerHandler):
                handler.value.reset()
