"""Which CPUs each rank that ``ferrovodrun`` starts on a host is bound to.

Unbound, a rank's threads go wherever the scheduler puts them: while one rank waits for its
peer in a collective, its threads can land on the core the peer is computing on, and every
step of a synchronous job waits for the slowest rank (Keras' ``fit`` on 2 ranks on 2 cores
reached 0.85 of one process's speed bound, 0.79-0.81 unbound, alternating in one run). Bound,
each local rank owns a share of the host's cores; threads it starts later, and its child
processes, inherit the binding.

The shares are whole physical cores (a core's hyperthreads go to the same rank: two ranks on
the siblings of one core would share its execution units), contiguous in package order (so a
rank's cores share a socket where they can), out of the CPUs the launcher itself may use (a
cpuset or ``taskset`` around the launcher is respected). With more ranks than cores the
shares are single CPUs, and with more ranks than CPUs ranks share them round-robin.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import (Dict, FrozenSet, Iterator, List, Mapping, MutableMapping, Optional,
                    Sequence, Tuple)

__all__ = ["BIND_VAR", "bind_setting", "bind_worker", "bound_cpus", "describe",
           "physical_cores", "share_of", "spawning_bound", "usable_cpu_count"]

#: ``1`` by ``--bind-cores``, ``0`` by ``--no-bind-cores``, unset (``auto``) by default; set to
#: ``1`` in the environment of every worker the launcher bound.
BIND_VAR = "FERROVOD_BIND_CORES"

_SYS_CPU = "/sys/devices/system/cpu"


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def usable_cpu_count() -> int:
    """How many CPUs this process may run on: its affinity mask (a cpuset, ``taskset`` or a
    binding) where the system has one, else every CPU."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def physical_cores(cpus: Sequence[int], sys_cpu: str = _SYS_CPU) -> List[List[int]]:
    """``cpus`` grouped into physical cores (hyperthread siblings together), ordered by package
    and then by their first CPU. A CPU whose topology cannot be read is a core of its own."""
    groups: Dict[Tuple[int, int], List[int]] = {}
    for cpu in sorted(cpus):
        topo = os.path.join(sys_cpu, f"cpu{cpu}", "topology")
        package = _read_int(os.path.join(topo, "physical_package_id"))
        core = _read_int(os.path.join(topo, "core_id"))
        key = (package, core) if package is not None and core is not None else (-1, -1 - cpu)
        groups.setdefault(key, []).append(cpu)
    return [groups[key] for key in sorted(groups, key=lambda k: (k[0], groups[k][0]))]


def share_of(cores: Sequence[Sequence[int]], local_rank: int, local_size: int) -> FrozenSet[int]:
    """The CPUs of ``local_rank`` of ``local_size`` ranks out of ``cores`` (physical cores,
    each a list of CPUs, in the order shares are cut from)."""
    if local_size <= 0 or not 0 <= local_rank < local_size or not cores:
        raise ValueError(f"no share for local rank {local_rank} of {local_size} "
                         f"on {len(cores)} cores")
    # Shares are cut from whole cores while there are enough, else from single CPUs.
    units = cores if len(cores) >= local_size else [[cpu] for core in cores for cpu in core]
    if len(units) < local_size:
        return frozenset(units[local_rank % len(units)])
    lo = local_rank * len(units) // local_size
    hi = (local_rank + 1) * len(units) // local_size
    return frozenset(cpu for unit in units[lo:hi] for cpu in unit)


def bind_setting(env: Mapping[str, str]) -> str:
    """``FERROVOD_BIND_CORES`` in ``env`` as ``on``, ``off`` or ``auto`` (unset or anything
    else)."""
    value = env.get(BIND_VAR, "auto").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return "on"
    return "off" if value in ("0", "false", "no", "off") else "auto"


def bound_cpus(env: Mapping[str, str]) -> Optional[FrozenSet[int]]:
    """The CPUs the worker whose environment is ``env`` is bound to on this host, or None when
    it is left unbound or this system cannot bind. ``FERROVOD_BIND_CORES``: ``1`` binds, ``0``
    does not, unset or ``auto`` binds where every rank of the host gets at least one whole
    physical core (with fewer, shares of single CPUs would still be shared, and the ranks'
    own scheduling does better)."""
    setting = bind_setting(env)
    if setting == "off" or not hasattr(os, "sched_getaffinity"):
        return None
    local_rank = int(env.get("FERROVOD_LOCAL_RANK", "0"))
    local_size = int(env.get("FERROVOD_LOCAL_SIZE", "1"))
    cores = _cores_of(frozenset(os.sched_getaffinity(0)))
    if setting == "auto" and len(cores) < local_size:
        return None
    return share_of(cores, local_rank, local_size)


def bind_worker(env: MutableMapping[str, str]) -> Optional[FrozenSet[int]]:
    """:func:`bound_cpus` for the worker that will start with ``env``, which then says it is
    bound (``FERROVOD_BIND_CORES=1``: the worker's own rules, such as torch's overlap, ask)."""
    cpus = bound_cpus(env)
    if cpus is not None:
        env[BIND_VAR] = "1"
    return cpus


@functools.lru_cache(maxsize=4)
def _cores_of(allowed: FrozenSet[int]) -> List[List[int]]:
    # A launch asks once per worker (and the environment of every slot, remote ones included,
    # asks again): the topology is read from sysfs once per set of allowed CPUs.
    return physical_cores(sorted(allowed))


@contextlib.contextmanager
def spawning_bound(cpus: Optional[FrozenSet[int]]) -> Iterator[None]:
    """Binds the calling thread to ``cpus`` while a child is spawned in the block, which
    inherits the binding before it runs any code of its own; the thread's CPUs are restored
    after. The spawn needs no code run in the child (a ``preexec_fn`` makes Python fork rather
    than vfork, which cost a launcher of 1024 workers 8 s). A CPU gone offline since the shares
    were cut leaves the worker unbound rather than unstarted: binding is a matter of speed."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def describe(cpus: FrozenSet[int]) -> str:
    """``cpus`` as Linux lists them (``0-3,8-11``)."""
    runs: List[List[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
