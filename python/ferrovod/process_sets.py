"""Process sets: subsets of ranks that run collectives among themselves (Horovod's API)."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional, Sequence, Union

from . import _core
from .exceptions import InvalidArgumentError

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]


def _comm_world_ranks(comm: Any) -> Optional[List[int]]:
    """The ``MPI.COMM_WORLD`` ranks (ferrovod's ranks under mpirun) of an mpi4py communicator's
    members; ``None`` when ``comm`` is not one."""
    # An mpi4py communicator exists only once mpi4py is imported: look it up, never import it.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(comm, mpi.Comm):
        return None
    if comm == mpi.COMM_NULL:
        raise ValueError("ProcessSet(MPI.COMM_NULL): this process is in no group of the split; "
                         "give it the communicator of the group it belongs to")
    group, world = comm.Get_group(), mpi.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in
                mpi.Group.Translate_ranks(group, list(range(group.Get_size())), world)]
    finally:
        group.Free()
        world.Free()


class ProcessSet:
    """A sorted list of global ranks. ``process_set_id`` is None until registered.

    ``ranks`` may be an mpi4py communicator (Horovod's ``ProcessSet(mpi_comm)``): the set is its
    members. Registered at ``init(process_sets=[...])``, every process's communicator counts, as
    in Horovod: after ``MPI.COMM_WORLD.Split(color)`` each process passes its own group's
    communicator, and every group becomes a process set (ids in the order of their ranks).
    """

    def __init__(self, ranks: Union[Sequence[int], Any]) -> None:
        if isinstance(ranks, ProcessSet):
            ranks = ranks.ranks
        members = _comm_world_ranks(ranks)
        self.mpi_comm = None if members is None else ranks
        if members is None:
            members = [int(r) for r in ranks]
        self.ranks: List[int] = sorted(members)
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"process set ranks contain duplicates: {members}")
        self.process_set_id: Optional[int] = None

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
        # Horovod's form, which scripts and Horovod's tests compare against.
        return (f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
                f"mpi_comm={self.mpi_comm})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(tuple(self.ranks))


#: Every rank; id 0. Its ranks are filled in by ``init()``.
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: List[ProcessSet] = []


def _with_communicator_sets(static_sets: Sequence[ProcessSet]) -> List[ProcessSet]:
    """The sets ``init`` registers: the rank lists as given (the same on every rank), then every
    set some process described by its communicator, gathered over MPI and sorted, so that every
    rank registers them alike (a communicator set of this process is the object it gave; the
    others with the same ranks get its id in :func:`_on_init`)."""
    if all(p.mpi_comm is None for p in static_sets):
        return list(static_sets)
    mpi = sys.modules["mpi4py.MPI"]  # imported: a communicator was given
    out = [p for p in static_sets if p.mpi_comm is None]
    mine = [tuple(p.ranks) for p in static_sets if p.mpi_comm is not None]
    for ranks in sorted({s for theirs in mpi.COMM_WORLD.allgather(mine) for s in theirs}):
        if any(tuple(p.ranks) == ranks for p in out):
            continue
        own = [p for p in static_sets if p.mpi_comm is not None and tuple(p.ranks) == ranks]
        out.append(own[0] if own else ProcessSet(list(ranks)))
    return out


def _on_init(static_sets: Sequence[ProcessSet], given: Sequence[ProcessSet] = ()) -> None:
    """Records the ids ``init`` registered ``static_sets`` under (1, 2, ... in order); an object
    of ``given`` that describes one of them without being it gets the same id."""
    global_process_set.ranks = list(range(_core.topology()[1]))
    global_process_set.process_set_id = 0
    _registered.clear()
    for i, ps in enumerate(static_sets, start=1):
        ps.process_set_id = i
        _registered.append(ps)
    for ps in given:
        if not any(ps is r for r in _registered):
            ps.process_set_id = next(r.process_set_id for r in _registered if r.ranks == ps.ranks)


def _check_known(ps: ProcessSet) -> None:
    """Raises ``InvalidArgumentError`` (a ``ValueError``) when ``ps`` is no set of this job:
    never registered, removed since, or given an id by hand. Graph builders call it, so that
    the mistake surfaces where the op is made, as in Horovod, not when a graph runs it."""
    if ps.process_set_id == 0:
        return
    if ps.process_set_id is None or not any(
            r.process_set_id == ps.process_set_id and r.ranks == ps.ranks for r in _registered):
        raise InvalidArgumentError(f"{ps} does not exist or has not been registered")


def _ids_and_ranks() -> Dict[int, List[int]]:
    """Every registered set's id and ranks, the global set's (0) first."""
    out = {0: list(global_process_set.ranks)}
    out.update((int(ps.process_set_id), list(ps.ranks)) for ps in _registered)
    return out


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
