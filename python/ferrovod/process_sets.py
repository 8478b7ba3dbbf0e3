"""Process sets: subsets of ranks that run collectives among themselves (Horovod's API)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from . import _core

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


class ProcessSet:
    """A sorted list of global ranks. ``process_set_id`` is None until registered."""

    def __init__(self, ranks: Sequence[int]) -> None:
        if isinstance(ranks, ProcessSet):
            ranks = ranks.ranks
        self.ranks: List[int] = sorted(int(r) for r in ranks)
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"process set ranks contain duplicates: {list(ranks)}")
        self.process_set_id: Optional[int] = None
        self.mpi_comm = None

    def _registered(self) -> bool:
        return self.process_set_id is not None and _core.is_initialized()

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or None if not registered."""
        return len(self.ranks) if self._registered() else None

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None if not a member or not registered)."""
        if not self._registered():
            return None
        me = _core.topology()[0]
        return self.ranks.index(me) if me in self.ranks else None

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None if not registered)."""
        if not self._registered():
            return None
        return _core.topology()[0] in self.ranks

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))


#: Every rank; id 0. Its ranks are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: List[ProcessSet] = []


def _on_init(static_sets: Sequence[ProcessSet]) -> None:
    global_process_set.ranks = list(range(_core.topology()[1]))
    global_process_set.process_set_id = 0
    _registered.clear()
    for i, ps in enumerate(static_sets, start=1):
        ps.process_set_id = i
        _registered.append(ps)


def _on_shutdown() -> None:
    for ps in _registered:
        ps.process_set_id = None
    _registered.clear()


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Registers a process set. Every rank must call this, in the same order, after
    ``init(process_sets="dynamic")``."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    if any(p.ranks == ps.ranks for p in _registered) or ps.ranks == global_process_set.ranks:
        raise ValueError(f"a process set with ranks {ps.ranks} is already registered")
    ps.process_set_id = _core.add_process_set(ps.ranks)
    _registered.append(ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set; False for the global set or an unregistered set."""
    if process_set.process_set_id in (None, 0):
        return False
    removed = _core.remove_process_set(process_set.process_set_id)
    if removed:
        if process_set in _registered:
            _registered.remove(process_set)
        process_set.process_set_id = None
    return bool(removed)
