"""Host memory: one segment per rank that every other rank of the process set maps as well,
when all of them are on this host (see ``transport::host_memory`` in the Rust engine).

A sharded optimizer keeps its gradients and its one copy of the parameters there, so that a
rank reduces its shard straight from its peers' gradients and no allgather of the parameters
is needed (see :mod:`ferrovod.torch.sharded`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

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


__all__ = ["SHARE_TIMEOUT_S", "share", "view"]
