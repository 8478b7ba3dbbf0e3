"""Starting and stopping ferrovod and where this process sits in the job: :func:`init`,
:func:`shutdown`, the timeline, and the rank and size queries."""

from __future__ import annotations

import atexit
import itertools
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from . import _core, _logging, _rendezvous
from .elastic import membership as _elastic
from . import process_sets as _ps
from .exceptions import FerrovodError, InvalidArgumentError
from .process_sets import ProcessSet

# Per kind, the counter that names unnamed ops (``_arguments._auto_name``): every rank
# counts from 0 again in each job that init() starts, so the names still match.
_name_counters: Dict[str, itertools.count] = {}
# Per kind of object and process set (``_arguments._instance_number``), how many this rank
# made: the number names the object's collectives. Not reset by init(): such objects (an
# optimizer wrapper) may outlive it, and two alive under one name would share their ops' names.
_instance_counters: Dict[Tuple[str, Tuple[int, ...]], itertools.count] = {}
# How many engines this process has started: what was registered with an earlier one (a
# process set's id) means nothing to the next.
_starts = 0


def starts() -> int:
    """How many engines this process has started so far (init and init_over_store)."""
    return _starts


def init(comm: Optional[Any] = None, process_sets: Optional[Union[str, Sequence[ProcessSet]]] = None) -> None:
    """Starts ferrovod: rendezvous with the other ranks and start the background engine.

    ``process_sets`` is a list of :class:`ProcessSet` registered at start-up (ids 1, 2, ...
    in order; sets given as mpi4py communicators after the rank lists, see
    :class:`ProcessSet`), or ``"dynamic"`` to allow :func:`add_process_set` later. ``comm`` may
    be an mpi4py communicator with as many ranks as ``MPI.COMM_WORLD`` (Horovod's signature):
    under ``mpirun`` without ``FERROVOD_RENDEZVOUS_ADDR`` the ranks then find each other over
    it; or, as in Horovod, the list of ranks the job runs on, which must be every rank in order
    (a job spans every launched process: collectives among some ranks take a process set).
    Calling ``init()`` again while running is a no-op; after :func:`shutdown` it starts a new
    engine.
    """
    exit_if_parameter_server()
    if isinstance(comm, (list, tuple)):
        _check_rank_list(comm)
        comm = None
    if comm is not None and not _rendezvous.is_world_comm(comm):
        raise ValueError("init(comm=...) accepts only an mpi4py communicator spanning every rank "
                         "(as many as MPI.COMM_WORLD): ferrovod does not run on MPI sub-communicators")
    dynamic = process_sets == "dynamic"
    static: List[ProcessSet] = [] if (process_sets is None or dynamic) else list(process_sets)
    for ps in static:
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"process_sets must hold ProcessSet objects, got {ps!r}")
    if len(set(tuple(p.ranks) for p in static if p.mpi_comm is None)) != \
            len([p for p in static if p.mpi_comm is None]):
        raise ValueError("process_sets contains duplicates")
    if _core.is_initialized():
        return
    given, static = static, _ps._with_communicator_sets(static)
    # The environment, read and parsed once: what is looked at here is what the engine uses.
    settings = _core.read_settings()
    generation = None
    if _elastic.enabled(settings):
        # An elastic worker first takes its place in the launcher's newest membership, which
        # rewrites this process's topology variables: the engine starts from those.
        generation = _elastic.join_next(settings)
        settings = _core.read_settings()
    level, hide_time, my_rank = settings.log()
    _logging.configure(level, hide_time, f"rank {my_rank}")
    info = settings.launch()
    found = _rendezvous.find(comm, info)
    # The engine owns (and closes) the listener from here, whatever happens.
    listener = found.listener.detach() if found.listener is not None else None
    try:
        _core.init(settings, [p.ranks for p in static], dynamic, found.addr, found.secret,
                   generation, listener)
    except FerrovodError as e:
        if generation is None or isinstance(e, InvalidArgumentError):
            raise
        raise _elastic.FormingError(f"forming the elastic job's membership {generation} "
                                    f"failed: {e}") from e
    if generation is not None:
        _elastic.watch_hosts()
    global _starts
    _starts += 1
    _name_counters.clear()
    _ps._on_init(static, given)
    _share_cores(info["launcher"])


def init_over_store(store: Any, rank: int, size: int, timeout_s: float,
                    store_addr: Optional[str], generation: int,
                    op_timeout_s: Optional[float] = None) -> bool:
    """Starts the engine for torch.distributed's front end (``init_process_group(backend=
    "ferrovod")``): rank ``rank`` of ``size``, formed over ``store``, the store torch hands the
    backend, within ``timeout_s`` seconds; ``store_addr`` ("host:port") is where that store
    lives when known; ``generation`` numbers this forming among those over the same store
    (the same on every rank), which keeps its keys apart from theirs; with ``op_timeout_s``,
    an op of the job's own set that some ranks have not submitted within it fails on those
    that have (and small ops keep off the fast path, which cannot give up on one rank alone).
    Process sets are dynamic
    (torch's groups become process sets). Returns whether this call started the engine: False
    when one runs already with the same rank and size (``ferrovod.init()`` came first), which
    the caller must then leave running."""
    # Torch hands in the rank and size: whatever launcher variables this process has (torch's
    # test harness sets WORLD_SIZE alone) are not read.
    settings = _core.read_settings(with_launch=False)
    level, hide_time, _ = settings.log()
    _logging.configure(level, hide_time, f"rank {rank}")
    started = bool(_core.init_over_store(settings, store, int(rank), int(size), float(timeout_s),
                                         store_addr, int(generation), op_timeout_s))
    if started:
        global _starts
        _starts += 1
        _name_counters.clear()
        _ps._on_init([], [])
    return started


def exit_if_parameter_server() -> None:
    """Ends a process started as an MXNet parameter server or scheduler (``DMLC_ROLE``), saying
    why: the mxnet-operator and MXNet's ``tools/launch.py`` start them beside the workers, and
    ferrovod's workers, averaging with allreduce, need none. Exits with status 0, so that the
    job's server and scheduler replicas succeed."""
    role = os.environ.get("DMLC_ROLE", "").strip().lower()
    if role in ("server", "scheduler"):
        print(f"ferrovod: this process is an MXNet {role} (DMLC_ROLE={role}); ferrovod's workers "
              f"average with allreduce and need no {role}, so it exits now", file=sys.stderr,
              flush=True)
        sys.exit(0)


def _check_rank_list(ranks: Sequence[Any]) -> None:
    """``init(comm=[ranks])``: every launched rank, in order, or a ValueError saying why not."""
    size = int(_core.read_settings().launch()["size"])
    try:
        given = [int(r) for r in ranks]
    except (TypeError, ValueError):
        raise ValueError(f"init(comm=...) takes a list of ranks, got {list(ranks)!r}") from None
    if given == list(range(size)):
        return
    if sorted(given) == list(range(size)):
        raise ValueError(f"init(comm={given}): ferrovod keeps the launcher's rank order; pass "
                         f"the ranks in order (list(range({size})))")
    raise ValueError(f"init(comm={given}): a ferrovod job spans every launched process "
                     f"({size} here); for collectives among ranks {sorted(set(given))} use a "
                     f"process set: init(process_sets=[ProcessSet({sorted(set(given))})])")


# Launchers that already give each rank its share of the cores (ferrovodrun's worker_env;
# torchrun sets OMP_NUM_THREADS=1), or start one process only.
_SHARING_LAUNCHERS = ("ferrovodrun", "torchrun", "none")


def _share_cores(launcher: str) -> None:
    """Under mpirun, srun or a TFJob with several ranks per host, sets the thread-pool variables
    the user left unset (OMP_NUM_THREADS and the BLAS ones) to this rank's share of the cores —
    by default every rank's pools would use every core and the ranks would fight over them.
    Libraries loaded from now on, and child processes, see them; a PyTorch already imported
    gets ``torch.set_num_threads`` too."""
    n = local_size()
    if launcher in _SHARING_LAUNCHERS or n <= 1:
        return
    from .runner.worker_env import thread_share

    share = thread_share(os.environ, n)
    if not share:
        return
    os.environ.update(share)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in share:
        torch.set_num_threads(int(share["OMP_NUM_THREADS"]))
    _logging.LOGGER.info("%d ranks on this host: set %s", n, ", ".join(f"{k}={v}" for k, v in share.items()))


def shutdown() -> None:
    """Stops the engine. Pending ops fail; ``init()`` may be called again afterwards."""
    _core.shutdown()
    _ps._on_shutdown()


def is_initialized() -> bool:
    """Whether :func:`init` has run in this process and :func:`shutdown` has not."""
    return bool(_core.is_initialized())


atexit.register(shutdown)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Starts writing a Chrome-trace timeline to ``file_path`` (rank 0 writes it). Unlike
    Horovod, ``FERROVOD_TIMELINE=DYNAMIC`` is not required first."""
    _core.start_timeline(str(file_path), bool(mark_cycles))


def stop_timeline() -> None:
    """Stops the timeline and closes its file."""
    _core.stop_timeline()


def _topo(i: int) -> Any:
    return _core.topology()[i]


def rank() -> int:
    """Global rank of this process."""
    return int(_topo(0))


def size() -> int:
    """Number of processes in the job."""
    return int(_topo(1))


def local_rank() -> int:
    """Rank of this process among those on its host."""
    return int(_topo(2))


def local_size() -> int:
    """Number of processes on this host."""
    return int(_topo(3))


def cross_rank() -> int:
    """Index of this host among the hosts that have a process with this local rank."""
    return int(_topo(4))


def cross_size() -> int:
    """Number of hosts that have a process with this local rank."""
    return int(_topo(5))


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return bool(_topo(6))
