"""Host memory: one segment per rank that every other rank of the process set maps as well,
when all of them are on this host (see ``transport::host_memory`` in the Rust engine).

A sharded optimizer keeps its gradients and its one copy of the parameters there, so that a
rank reduces its shard straight from its peers' gradients and no allgather of the parameters
is needed (see :mod:`ferrovod.torch.sharded`). :class:`SharedFlat` is the unsharded form: a
flat buffer per rank that one :meth:`SharedFlat.allreduce` averages (or sums) into every
rank's buffer: the torch optimizer's flat gradients when it is not sharded.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

import numpy as np

from . import _api, _core
from .process_sets import ProcessSet

_log = logging.getLogger("ferrovod")

#: How long ranks wait for each other's answers while mapping the segments; they arrive
#: together, straight from an allgather, so this bounds only a failure.
SHARE_TIMEOUT_S = 10.0


def share(nbytes: int, name: str, process_set: ProcessSet, rank: int) -> Optional[Any]:
    """A collective over ``process_set`` (``rank``: this rank's index in it): a segment of
    ``nbytes`` zero bytes per rank, each rank mapping every other's, as a
    ``ferrovod._core.HostMemory``; or ``None`` on every rank when some rank cannot map them
    all (a rank on another host, ``FERROVOD_SHM_DISABLE=1``, no memfd)."""
    exposed = None
    try:
        exposed = _core.expose_host_memory(nbytes)
    except Exception as e:  # noqa: BLE001 - any failure here means "not shared", on every rank
        _log.warning("rank %d: no host memory of %d bytes for %s: %s", rank, nbytes, name, e)
    address = exposed.address() if exposed is not None else b""
    addresses = _api.allgather_object(address, name=f"{name}.addresses", process_set=process_set)
    mem = None
    if exposed is not None and all(addresses):
        try:
            mem = exposed.share(list(addresses), rank, SHARE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - as above: the agreement below must be reached
            _log.warning("rank %d: host memory for %s not shared: %s", rank, name, e)
    ok = mem is not None and all(mem.mapped())
    agreed = _api.allreduce(np.array([int(ok)], dtype=np.int32), op=_api.Min,
                            name=f"{name}.mapped", process_set=process_set)
    return mem if int(agreed[0]) else None


def view(mem: Any, rank: int) -> np.ndarray:
    """Rank ``rank``'s whole segment as a writable uint8 array (which keeps it mapped)."""
    return np.asarray(mem.segment(rank))


def shard(rows: int, n: int, r: int) -> Tuple[int, int]:
    """Rank ``r``'s rows of ``rows`` split over ``n`` ranks, as (first row, row count):
    Horovod's reducescatter split, the lowest ``rows % n`` ranks one row more."""
    return r * (rows // n) + min(r, rows % n), rows // n + int(r < rows % n)


def meet(name: str, process_set: ProcessSet) -> None:
    """Returns once every rank of the set has called it with ``name`` (the engine's meeting:
    a one-element allreduce, which the fast path agrees when the ranks share a host)."""
    _core.meet(name, _api._set_id(process_set))


class SharedFlat:
    """A flat buffer of ``count`` elements of ``itemsize`` bytes (engine dtype ``code``) per
    rank of ``process_set``, in host memory every rank maps, as uint8 arrays (so any dtype the
    engine reduces fits, bfloat16 included); :meth:`create` makes one (a collective) or finds
    it cannot."""

    def __init__(self, mem: Any, count: int, itemsize: int, code: int, rank: int, name: str,
                 process_set: ProcessSet) -> None:
        self.mem, self.count, self.itemsize, self.code = mem, count, itemsize, code
        self.rank, self.name, self.process_set = rank, name, process_set
        self.own: np.ndarray = view(mem, rank)[:count * itemsize]

    @classmethod
    def create(cls, count: int, itemsize: int, code: int, name: str, process_set: ProcessSet,
               rank: int, n: int) -> Optional["SharedFlat"]:
        """A collective over ``process_set`` (``rank`` of ``n``): the buffers, or None on every
        rank when some rank cannot map them all (see :func:`share`)."""
        if n < 2:
            return None
        mem = share(max(count * itemsize, 1), name, process_set, rank)
        return None if mem is None else cls(mem, count, itemsize, code, rank, name, process_set)

    def allreduce(self, op: int, postscale: float = 1.0) -> None:
        """Reduces every rank's buffer into each with ``op`` (Sum or Average; Average divides
        by the ranks), times ``postscale``: the engine's allreduce in host memory (each rank
        sums its shard of all buffers, the ranks meet, each copies the other shards from their
        owners, and they meet again before anyone writes a buffer; every rank ends with the
        same bits). Every rank's buffer must be final: the caller's last meeting ensured it."""
        self.mem.allreduce(self.name, _api._set_id(self.process_set), self.count * self.itemsize,
                           self.code, op, postscale)

__all__ = ["SHARE_TIMEOUT_S", "SharedFlat", "meet", "shard", "share", "view"]
