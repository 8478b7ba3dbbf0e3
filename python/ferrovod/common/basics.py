"""``horovod.common.basics``: the object behind each framework's ``mpi_ops._basics``.

In Horovod every framework module builds a ``HorovodBasics`` over its own library and takes
``init``, ``rank`` and the other process queries from it; scripts and Horovod's own tests reach
it as ``hvd.mpi_ops._basics`` for what the public API does not say, chiefly the process sets
and their ids. ferrovod has one engine for every framework, so each ``mpi_ops._basics`` is a
view of the same state.
"""

from __future__ import annotations

from typing import Any, Dict, List

from .. import _api
from .. import process_sets as _ps

__all__ = ["HorovodBasics"]


class HorovodBasics:
    """Horovod's basics object: every public process query of ``ferrovod`` (``init``,
    ``rank``, ``size``, ``mpi_built`` ...) as an attribute, plus the process-set internals
    Horovod's tests read."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return getattr(_api, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} has no attribute {name!r}") from None

    def _get_process_set_ids_and_ranks(self) -> Dict[int, List[int]]:
        """Every registered process set's id and its ranks, the global set (id 0) included."""
        _api.size()  # raises, as Horovod does, before init()
        return _ps._ids_and_ranks()

    def _process_set_rank(self, process_set_id: int) -> int:
        """This process's rank within the set with that id (-1 when not a member)."""
        ranks = self._get_process_set_ids_and_ranks()[process_set_id]
        me = _api.rank()
        return ranks.index(me) if me in ranks else -1

    def _process_set_size(self, process_set_id: int) -> int:
        """The number of ranks of the set with that id."""
        return len(self._get_process_set_ids_and_ranks()[process_set_id])
