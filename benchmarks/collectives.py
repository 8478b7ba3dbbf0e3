"""Latency and bus bandwidth of ferrovod's collectives, optionally beside torch, mpi4py, Horovod.

Run under the launcher, e.g.::

    ferrovodrun -np 2 python benchmarks/collectives.py
    ferrovodrun -np 2 python benchmarks/collectives.py --compare torch --ops allreduce

For each op (allreduce, allgather, broadcast, reducescatter, alltoall) and each float32 message
size, every rank times each call on its own (warm-up calls first, untimed); a row shows the
median over the calls of the slowest rank. The size is each rank's input; reducescatter and
alltoall split it into one equal block per rank (sizes that do not divide are skipped).
Bus bandwidth follows nccl-tests: algbw = bytes / time, with bytes the per-rank input
(allgather: the whole gathered output), and busbw = algbw x 2(n-1)/n for allreduce,
x (n-1)/n for allgather, reducescatter and alltoall, and x 1 for broadcast, so that it can be
compared with a link's bandwidth whatever the number of ranks.

With ``--compare torch`` the same run also sets up ``torch.distributed`` with the gloo backend
on loopback and times the same ops on tensors of the same sizes; with ``--compare mpi4py`` it
times mpi4py's buffer calls (``Allreduce`` in place, ``Allgather``, ``Bcast``,
``Reduce_scatter_block``, ``Alltoall``) — which needs
the job started by ``mpirun`` (ferrovod then finds its peers over MPI too)::

    mpirun -np 2 --bind-to none python benchmarks/collectives.py --compare torch,mpi4py

With ``--compare horovod`` it times Horovod 0.28.1's PyTorch API (``hvd.allreduce_`` with
``op=hvd.Sum``, ``hvd.allgather``, ``hvd.broadcast_``, named, with Horovod's default fusion
and cycle-time settings) on CPU tensors of the same sizes, in the same processes. Horovod
0.28.1 builds only against an older torch (2.0.x, NumPy 1), so it lives in its own venv that
``scripts/install_horovod.sh`` builds (Horovod from its sdist, torch 2.0.1, mpi4py and
ferrovod)::

    scripts/install_horovod.sh
    mpirun -np 2 --bind-to none .venv-horovod/bin/python benchmarks/collectives.py \
        --compare torch,mpi4py,horovod

How Horovod joins the job (``--horovod-controller``, default ``auto``): started by ``mpirun``
(Open MPI or MPICH's Hydra), Horovod uses MPI as its controller and for its CPU collectives,
as ``horovodrun --mpi`` / plain ``mpirun`` jobs do; started by ``ferrovodrun``, rank 0 runs
Horovod's own HTTP rendezvous server and every rank gets the variables ``horovodrun --gloo``
would set (rendezvous address and port, controller and CPU operations ``gloo``, the network
interface: ``HOROVOD_GLOO_IFACE``, else ferrovodrun's ``FERROVOD_IFACE``, else ``lo``), so
Horovod runs on gloo. ``--horovod-controller gloo`` forces gloo under mpirun too. Horovod's
background thread synchronizes the ranks every cycle even when idle (busy-polling MPI under
mpirun), which would slow whatever else runs beside it: so, after one join and leave at the
start (a job Horovod cannot join fails then, with a message), Horovod runs only once every
other column has been timed, in a phase of its own, and the table is printed at the end.

With ``--device cuda`` the inputs are float32 CUDA tensors on this rank's GPU
(``cuda:<local rank mod GPUs visible>``) and the run times ferrovod's torch adapter
(``ferrovod.torch``: ``allreduce_``, ``allgather``, ``broadcast_``, ``reducescatter``,
``alltoall``) beside ``torch.distributed`` on the same GPU (``all_reduce``,
``all_gather_into_tensor``, ``broadcast``, ``reduce_scatter_tensor``,
``all_to_all_single``)::

    ferrovodrun -np 1 python benchmarks/collectives.py --device cuda
    FERROVOD_NCCL_DISPATCH=1 ferrovodrun -np 1 python benchmarks/collectives.py --device cuda

Whether ferrovod runs an op with NCCL on the device or stages it through host memory is the
library's decision (``FERROVOD_NCCL_DISPATCH``, see the README); the header line says which,
as ``ferrovod.torch`` answers after the first CUDA op, with the variable and the GPU's name.
torch's backend is ``--torch-backend``: ``auto`` (the default) takes NCCL when the job has one
rank and gloo otherwise, since ranks that share a GPU cannot use NCCL (gloo copies CUDA
tensors through host memory); an op that the backend refuses on CUDA tensors shows ``n/a``.
Every timed call is followed by ``torch.cuda.synchronize()``; refilling the input is untimed.
Sizes go up to 1 GiB by default, and the number of calls is sized so that each column moves
about ``--bytes-per-round`` per op, size and round (at least 3 calls, at most ``--iters``).
Each size is timed in ``--rounds`` rounds (default 3) that alternate the columns, ferrovod
then torch, and a column shows the median of its rounds' medians, so that a short slow spell
of a shared machine lands in one round rather than in one column. ``--compare`` can only be
torch (or nothing) here.

The last columns are each peer's time divided by ferrovod's (> 1: ferrovod is faster).

Each op's result is checked once per size, untimed, so a wrong result cannot look fast.
This is a benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

import ferrovod as fv

if TYPE_CHECKING:
    import torch

OPS = ("allreduce", "allgather", "broadcast", "reducescatter", "alltoall")
#: Ops that split the input into one block per rank: sizes that do not divide are skipped.
SPLIT_OPS = ("reducescatter", "alltoall")
DEFAULT_MAX_SIZE = 256 << 20
# Bytes each rank should move per size and op, to size the repeat count: small messages get
# many repetitions, large ones few (but never fewer than MIN_ITERS).
BYTES_PER_SIZE = 1 << 30
MIN_ITERS = 5
#: --device cuda: default largest size, and default bytes each column moves per op, size and
#: round. A 1 GiB op staged through host memory takes 0.5-1 s, so the top sizes get the
#: fewest calls that still give a median (DEVICE_MIN_ITERS), with 3 rounds of each column.
DEVICE_MAX_SIZE = 1 << 30
DEVICE_BYTES_PER_ROUND = 512 << 20
DEVICE_MIN_ITERS = 3
DEVICE_ROUNDS = 3


def parse_size(text: str) -> int:
    """'4', '64K', '16M', '1G' (powers of 1024) → bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_size(nbytes: int) -> str:
    """Bytes as 4 B, 64 KiB, 16 MiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def default_sizes(max_size: int) -> list[int]:
    """4 B, 16 B, 64 B, ... powers of 4 up to max_size."""
    sizes, size = [], 4
    while size <= max_size:
        sizes.append(size)
        size *= 4
    return sizes


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for an op on n ranks (nccl-tests' convention)."""
    if op == "allreduce":
        return 2.0 * (n - 1) / n
    if op in ("allgather", "reducescatter", "alltoall"):
        return (n - 1) / n
    return 1.0


def pattern(count: int, rank: int) -> np.ndarray:
    """Rank-dependent float32 data whose sums over ranks are exact in float32."""
    data = (np.arange(count, dtype=np.int32) % 97).astype(np.float32)
    data += np.float32(100 * rank)
    return data


def expected(op: str, count: int, n: int, root: int) -> np.ndarray:
    """What `op` must return on every rank, computed from the inputs independently."""
    if op == "allreduce":
        # sum over r of (k % 97 + 100 r) = n (k % 97) + 100 n (n - 1) / 2, exact in float32.
        base = (np.arange(count, dtype=np.int32) % 97).astype(np.float32)
        return base * np.float32(n) + np.float32(100 * n * (n - 1) // 2)
    if op == "allgather":
        return np.concatenate([pattern(count, r) for r in range(n)])
    if op in SPLIT_OPS:
        # Every rank's part: reducescatter's block of the sum, alltoall's block from each rank.
        block = count // n
        if op == "reducescatter":
            total = expected("allreduce", count, n, root)
            return np.stack([total[r * block:(r + 1) * block] for r in range(n)])
        return np.stack([np.concatenate([pattern(count, q)[r * block:(r + 1) * block]
                                         for q in range(n)]) for r in range(n)])
    return pattern(count, root)


@dataclass
class Timing:
    """Median seconds per call (slowest rank) of one op at one size on one stack."""

    seconds: float
    nbytes: int
    op: str
    n: int

    @property
    def busbw(self) -> float:
        """Bus bandwidth in GB/s (10^9 bytes per second)."""
        moved = self.nbytes * (self.n if self.op == "allgather" else 1)
        return moved / self.seconds * bus_factor(self.op, self.n) / 1e9


#: Pause before timing each column, in seconds.
SETTLE_S = 0.2


#: Bytes every stack moves in warm-up calls before it is timed (up to WARMUP_MAX_CALLS):
#: transports that map their buffers lazily (ferrovod's shared-memory rings, 1 MiB each way;
#: Open MPI's) take a page fault the first time each page is used, which a training loop pays
#: once and which would otherwise land in the timed calls of whichever size comes first.
WARMUP_BYTES = 16 << 20
WARMUP_MAX_CALLS = 5000

#: Inputs from this size up are restored by a copy that takes longer than the call itself
#: (a 256 MiB copy takes 15-25 ms here, at a speed that differs between the ranks), so
#: without a barrier after it one rank starts the call milliseconds before the other and its
#: timing holds that skew. Each stack meets in its own barrier, so that no other stack's
#: threads are woken. Smaller inputs are timed back to back, as a training loop calls them.
SYNC_MIN_BYTES = 1 << 20


def time_calls(call: Callable[[], Any], reset: Callable[[], None], sync: Callable[[], None],
               iters: int, nbytes: int) -> float:
    """This rank's median seconds of `call` over `iters` runs, after warm-up runs. Before
    each call the input is restored and, for inputs of SYNC_MIN_BYTES and up, the ranks meet
    in the stack's own barrier, both untimed (see SYNC_MIN_BYTES)."""
    warmup = min(WARMUP_MAX_CALLS, max(2, iters // 10, WARMUP_BYTES // max(nbytes, 1)))
    meet = nbytes >= SYNC_MIN_BYTES
    for _ in range(warmup):
        reset()
        if meet:
            sync()
        call()
    samples = []
    for _ in range(iters):
        reset()
        if meet:
            sync()
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


#: --device cuda: at most this many warm-up calls per size, column and round. Device calls
#: take tens of microseconds or more, so the CPU's WARMUP_MAX_CALLS would add seconds per small
#: size and round; the first call of each size has already run untimed (verification).
DEVICE_WARMUP_MAX_CALLS = 100
#: --device cuda with several ranks: pause before each column's round. Shorter than SETTLE_S
#: because a cuda run has rounds x columns x sizes x ops pauses (about 400 by default).
DEVICE_SETTLE_S = 0.05


def device_iterations(nbytes: int, max_iters: int, bytes_per_round: int) -> int:
    """How many timed calls per round for a message of nbytes on the device."""
    return max(DEVICE_MIN_ITERS, min(max_iters, bytes_per_round // max(nbytes, 1)))


def device_warmup(nbytes: int, iters: int) -> int:
    """Untimed calls before each round on the device: none for the largest sizes, whose
    verification call or previous round has just run the same op at the same size (and whose
    calls take up to a second each)."""
    return min(DEVICE_WARMUP_MAX_CALLS, max(iters // 10, WARMUP_BYTES // max(nbytes, 1)))


def time_device_calls(stack: Any, op: str, iters: int, warmup: int, nbytes: int) -> float:
    """time_calls for a device stack: stack.wait() ends each timed call, since a call may
    return before the device has finished its work. stack.reset() has waited for its own
    copy, so that the refill lands in no timed call."""
    call = stack.call(op)
    meet = nbytes >= SYNC_MIN_BYTES
    for _ in range(warmup):
        stack.reset()
        if meet:
            stack.sync()
        call()
        stack.wait()
    samples = []
    for _ in range(iters):
        stack.reset()
        if meet:
            stack.sync()
        start = time.perf_counter()
        call()
        stack.wait()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def slowest(seconds: float, tag: str) -> float:
    """The largest of every rank's value (untimed: an object allgather)."""
    return max(fv.allgather_object(seconds, name=f"bench.times.{tag}"))


class FerrovodStack:
    """ferrovod's calls on NumPy arrays; in-place where the API has an in-place variant."""

    name = "ferrovod"

    def __init__(self, count: int, rank: int) -> None:
        self.source = pattern(count, rank)
        self.buf = self.source.copy()
        self.out: np.ndarray | None = None
        self.tag = f"{count}"

    def reset(self) -> None:
        """Restores the input that an in-place op overwrote (untimed)."""
        np.copyto(self.buf, self.source)

    def sync(self) -> None:
        """The ranks meet in this stack's own barrier (untimed)."""
        fv.barrier()

    def call(self, op: str) -> Callable[[], Any]:
        """The call to time, with a fixed name per op and size, as a training loop would."""
        name = f"bench.{op}.{self.tag}"
        if op == "allreduce":
            return lambda: fv.allreduce_(self.buf, op=fv.Sum, name=name)
        if op == "allgather":

            def gather() -> None:
                self.out = fv.allgather(self.buf, name=name)

            return gather
        if op == "reducescatter":

            def scatter() -> None:
                self.out = fv.reducescatter(self.buf, op=fv.Sum, name=name)

            return scatter
        if op == "alltoall":

            def exchange() -> None:
                self.out = fv.alltoall(self.buf, name=name)

            return exchange
        return lambda: fv.broadcast_(self.buf, root_rank=0, name=name)

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`, as NumPy."""
        return self.out if op in ("allgather", *SPLIT_OPS) else self.buf


def horovod_torch_call(hvd: Any, stack: Any, op: str, name: str) -> Callable[[], Any]:
    """`op` through Horovod's torch API (``horovod.torch``, or ``ferrovod.torch``, which has
    the same calls) on ``stack.buf``: in place where the API has an in-place call (allreduce_,
    broadcast_), else into ``stack.out``."""
    if op == "allreduce":
        return lambda: hvd.allreduce_(stack.buf, op=hvd.Sum, name=name)
    if op == "broadcast":
        return lambda: hvd.broadcast_(stack.buf, root_rank=0, name=name)
    calls = {"allgather": lambda: hvd.allgather(stack.buf, name=name),
             "reducescatter": lambda: hvd.reducescatter(stack.buf, op=hvd.Sum, name=name),
             "alltoall": lambda: hvd.alltoall(stack.buf, name=name)}
    call = calls[op]

    def into_out() -> None:
        stack.out = call()

    return into_out


class FerrovodCudaStack:
    """ferrovod's torch adapter (ferrovod.torch) on float32 CUDA tensors of this rank's GPU,
    with the same calls as FerrovodStack. Whether an op runs with NCCL on the device or
    through host memory is the library's choice (the header line says which)."""

    name = "ferrovod"

    def __init__(self, count: int, rank: int, device: torch.device) -> None:
        import torch

        import ferrovod.torch as fvt

        self.torch = torch
        self.fvt = fvt
        self.device = device
        self.source = torch.from_numpy(pattern(count, rank)).to(device)
        self.buf = torch.empty_like(self.source)
        self.out: torch.Tensor | None = None
        self.tag = f"cuda.{count}"

    def reset(self) -> None:
        """Refills the input on the device and waits for the copy, so that no timed call
        waits for it (untimed)."""
        self.buf.copy_(self.source)
        self.torch.cuda.synchronize(self.device)

    def sync(self) -> None:
        """The ranks meet in this stack's own barrier (untimed)."""
        fv.barrier()

    def wait(self) -> None:
        """Waits for the device work of the last call: a call counts as done when its result
        can be used, which may be after it returned."""
        self.torch.cuda.synchronize(self.device)

    def call(self, op: str) -> Callable[[], Any]:
        """The call to time, with a fixed name per op and size, as a training loop would."""
        return horovod_torch_call(self.fvt, self, op, f"bench.{op}.{self.tag}")

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`, copied to NumPy."""
        out = self.out if op in ("allgather", *SPLIT_OPS) else self.buf
        assert out is not None, f"{op} has not run"
        return out.cpu().numpy()


class MpiStack:
    """mpi4py's buffer interface on NumPy arrays of the same sizes (Open MPI's shared memory
    between ranks of one host)."""

    name = "mpi4py"

    def __init__(self, count: int, rank: int, n: int) -> None:
        from mpi4py import MPI

        self.mpi = MPI
        self.comm = MPI.COMM_WORLD
        self.source = pattern(count, rank)
        self.buf = self.source.copy()
        self.out = np.empty(count * n, dtype=np.float32)
        self.part = np.empty(count // n, dtype=np.float32)
        self.exchanged = np.empty(count // n * n, dtype=np.float32)

    def reset(self) -> None:
        """Restores the input that an in-place op overwrote (untimed)."""
        np.copyto(self.buf, self.source)

    def sync(self) -> None:
        """The ranks meet in this stack's own barrier (untimed)."""
        self.comm.Barrier()

    def call(self, op: str) -> Callable[[], Any]:
        """The matching mpi4py call."""
        mpi, comm = self.mpi, self.comm
        if op == "allreduce":
            return lambda: comm.Allreduce(mpi.IN_PLACE, self.buf, op=mpi.SUM)
        if op == "allgather":
            return lambda: comm.Allgather(self.buf, self.out)
        if op == "reducescatter":
            return lambda: comm.Reduce_scatter_block(self.buf, self.part, op=mpi.SUM)
        if op == "alltoall":
            return lambda: comm.Alltoall(self.buf, self.exchanged)
        return lambda: comm.Bcast(self.buf, root=0)

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`."""
        return {"allgather": self.out, "reducescatter": self.part,
                "alltoall": self.exchanged}.get(op, self.buf)


class HorovodStack:
    """Horovod's PyTorch API on CPU tensors of the same sizes; in place where Horovod has an
    in-place call (allreduce_, broadcast_), a fresh output for allgather, named per op and size
    as a training loop's tensors are."""

    name = "horovod"

    def __init__(self, count: int, rank: int, n: int) -> None:
        import horovod.torch as hvd
        import torch

        self.hvd = hvd
        self.source = torch.from_numpy(pattern(count, rank))
        self.buf = self.source.clone()
        self.out: Any = None
        self.tag = f"{count}"

    def reset(self) -> None:
        """Restores the input that an in-place op overwrote (untimed)."""
        self.buf.copy_(self.source)

    def sync(self) -> None:
        """The ranks meet in this stack's own barrier (untimed)."""
        self.hvd.barrier()

    def call(self, op: str) -> Callable[[], Any]:
        """The matching horovod.torch call (each one returns when its result is ready)."""
        return horovod_torch_call(self.hvd, self, op, f"bench.hvd.{op}.{self.tag}")

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`, as NumPy."""
        return (self.out if op in ("allgather", *SPLIT_OPS) else self.buf).numpy()


# Variables by which each MPI launcher tells a process its rank and the world's size.
_MPI_LAUNCHER_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))


def _mpi_launched() -> bool:
    """Whether an MPI launcher (Open MPI's mpirun, MPICH's Hydra) started this process."""
    return any(size in os.environ for _, size in _MPI_LAUNCHER_VARS)


def _launcher_rank() -> int | None:
    """This process's rank as its launcher says, before any init (None: not launched)."""
    for var in ("FERROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK"):
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                return None
    return None


def import_horovod() -> Any:
    """Imports horovod.torch, or exits with status 2 saying how to get it (before ferrovod
    starts, so that no rank waits for one that left)."""
    try:
        import horovod.torch as hvd
    except (ImportError, OSError) as err:
        if _launcher_rank() in (None, 0):
            print(
                f"--compare horovod: horovod.torch cannot be imported by {sys.executable} "
                f"({type(err).__name__}: {err}).\n"
                "Horovod 0.28.1 needs its own venv (it builds only against torch 2.0.x); build "
                "it with\n    scripts/install_horovod.sh\nthen run the benchmark with that "
                "venv's python, e.g.\n    mpirun -np 2 --bind-to none .venv-horovod/bin/python "
                "benchmarks/collectives.py --compare torch,mpi4py,horovod",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(2) from None
    return hvd


class HorovodJob:
    """Horovod joined to this job over MPI or gloo, started and stopped around its own timings.

    Horovod's background thread synchronizes all ranks every cycle (HOROVOD_CYCLE_TIME) even
    when no tensor is pending — over MPI a busy-polling MPI_Allreduce per cycle — so while it
    runs it takes CPU from, and shares MPI with, whatever else is being timed. The benchmark
    therefore runs Horovod only in a phase of its own, after the other stacks'."""

    def __init__(self, rank: int, n: int, master_addr: str, choice: str) -> None:
        import horovod.torch as hvd
        import torch

        torch.set_num_threads(1)  # as for torch.distributed: the ranks share this VM's cores
        self.hvd = hvd
        self.rank, self.n = rank, n
        self.master_addr = master_addr
        self.controller = resolve_horovod_controller(hvd, choice)
        self.server: Any = None  # rank 0's rendezvous HTTP server under gloo
        self.server_thread: threading.Thread | None = None
        self.slots: list[tuple[str, int, int, int, int, int]] = []
        if self.controller == "mpi":
            os.environ["HOROVOD_CONTROLLER"] = "mpi"
            os.environ["HOROVOD_CPU_OPERATIONS"] = "mpi"
        else:
            self._setup_gloo()

    def _setup_gloo(self) -> None:
        """What horovodrun --gloo does: rank 0 serves Horovod's HTTP rendezvous, every rank
        gets its address and its own slot in HOROVOD_* variables."""
        port = 0
        if self.rank == 0:
            from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

            # horovodrun's RendezvousServer listens on every interface; this one only on the
            # address the ranks are told to use.
            self.server = RendezvousHTTPServer((self.master_addr, 0), RendezvousHandler, 0)
            port = self.server.server_address[1]
            self.server_thread = threading.Thread(target=self.server.serve_forever,
                                                  name="horovod-rendezvous", daemon=True)
            self.server_thread.start()
        port = fv.broadcast_object(port, root_rank=0, name="bench.hvd_port")
        # Every rank's slot as ferrovod sees the topology: the server sizes its scopes by them.
        slot = (socket.gethostname(), self.rank, fv.local_rank(), fv.local_size(),
                fv.cross_rank(), fv.cross_size())
        self.slots = fv.allgather_object(slot, name="bench.hvd_slots")
        hostname, _, local_rank, local_size, cross_rank, cross_size = slot
        iface = os.environ.get("HOROVOD_GLOO_IFACE") or os.environ.get("FERROVOD_IFACE") or "lo"
        os.environ.update({
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": self.master_addr,
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_GLOO_IFACE": iface,
            "HOROVOD_HOSTNAME": hostname,
            "HOROVOD_RANK": str(self.rank),
            "HOROVOD_SIZE": str(self.n),
            "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(local_size),
            "HOROVOD_CROSS_RANK": str(cross_rank),
            "HOROVOD_CROSS_SIZE": str(cross_size),
        })

    def start(self) -> None:
        """hvd.init() on every rank; exits with a message, on every rank alike, unless each
        one joined with ferrovod's rank and size."""
        hvd = self.hvd
        if self.server is not None:
            from horovod.runner.common.util.hosts import SlotInfo

            # (Re)arms the rendezvous scopes before any rank connects.
            self.server.init([
                SlotInfo(hostname=h, rank=r, local_rank=lr, cross_rank=cr, size=self.n,
                         local_size=ls, cross_size=cs)
                for h, r, lr, ls, cr, cs in self.slots])
        fv.allgather_object(True, name="bench.hvd_armed")
        try:
            hvd.init()
            joined = (hvd.rank(), hvd.size())
        except Exception as err:  # noqa: BLE001 - Horovod raises bare ValueError / RuntimeError
            joined = (-1, -1)
            print(f"rank {self.rank}: horovod.init() over {self.controller} failed: {err}",
                  file=sys.stderr, flush=True)
        everyone = fv.allgather_object(joined, name="bench.hvd_joined")
        if everyone != [(r, self.n) for r in range(self.n)]:
            raise SystemExit(
                f"--compare horovod: Horovod over {self.controller} saw (rank, size) {everyone}, "
                f"ferrovod ranks 0..{self.n - 1} of {self.n}: "
                + ("start the job with mpirun -np N, or with ferrovodrun (Horovod then uses gloo)"
                   if self.controller == "mpi" else
                   f"check that the ranks reach {self.master_addr} (--master-addr) and that "
                   "HOROVOD_GLOO_IFACE names their network interface"))

    def stop(self) -> None:
        """hvd.shutdown() on every rank, then a barrier, so that Horovod's thread is gone
        before anything else is timed."""
        self.hvd.shutdown()
        fv.allgather_object(True, name="bench.hvd_down")

    def close(self) -> None:
        """Stops rank 0's rendezvous server (after stop())."""
        if self.server is not None:
            self.server.shutdown()
            self.server_thread.join()
            self.server.server_close()
            self.server = None


def resolve_horovod_controller(hvd: Any, choice: str) -> str:
    """'mpi' or 'gloo' for --horovod-controller `choice`; exits with a message, the same on
    every rank, when Horovod cannot join this job that way."""
    if choice == "auto":
        choice = "mpi" if _mpi_launched() and hvd.mpi_built() else "gloo"
    if choice == "mpi":
        if not hvd.mpi_built():
            raise SystemExit("--compare horovod: this Horovod was built without MPI; rebuild "
                             "it with Open MPI's headers (scripts/install_horovod.sh installs "
                             "libopenmpi-dev) or use --horovod-controller gloo")
        if not _mpi_launched():
            raise SystemExit("--compare horovod --horovod-controller mpi: Horovod joins over "
                             "MPI only when mpirun started the job: mpirun -np N ... (or use "
                             "ferrovodrun, where Horovod runs on gloo)")
    elif not hvd.gloo_built():
        raise SystemExit("--compare horovod: this Horovod was built without gloo: start the "
                         "job with mpirun -np N so that Horovod can use MPI")
    return choice


def check_mpi(n: int) -> None:
    """--compare mpi4py needs this job to be MPI's COMM_WORLD (started by mpirun)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise SystemExit("--compare mpi4py: mpi4py is not installed") from None
    if MPI.COMM_WORLD.Get_size() != n:
        raise SystemExit(
            f"--compare mpi4py: MPI sees {MPI.COMM_WORLD.Get_size()} rank(s), ferrovod {n}: "
            "start the benchmark with mpirun -np N (not ferrovodrun)")


class TorchStack:
    """torch.distributed (gloo) on CPU tensors of the same sizes."""

    name = "torch"

    def __init__(self, count: int, rank: int, n: int) -> None:
        import torch

        self.torch = torch
        self.dist = torch.distributed
        self.source = torch.from_numpy(pattern(count, rank))
        self.buf = self.source.clone()
        self.out = torch.empty(count * n, dtype=torch.float32)
        self.out_list = list(self.out.chunk(n)) if count else [self.out] * n
        self.part = torch.empty(count // n, dtype=torch.float32)
        self.exchanged = torch.empty(count // n * n, dtype=torch.float32)

    def reset(self) -> None:
        """Restores the input that an in-place op overwrote (untimed)."""
        self.buf.copy_(self.source)

    def sync(self) -> None:
        """The ranks meet in this stack's own barrier (untimed)."""
        self.dist.barrier()

    def call(self, op: str) -> Callable[[], Any]:
        """The matching torch.distributed call."""
        dist = self.dist
        if op == "allreduce":
            return lambda: dist.all_reduce(self.buf, op=dist.ReduceOp.SUM)
        if op == "allgather":
            if hasattr(dist, "all_gather_into_tensor") and _torch_has_allgather_into_tensor:
                return lambda: dist.all_gather_into_tensor(self.out, self.buf)
            return lambda: dist.all_gather(self.out_list, self.buf)
        if op == "reducescatter":
            return lambda: dist.reduce_scatter_tensor(self.part, self.buf)
        if op == "alltoall":
            return lambda: dist.all_to_all_single(self.exchanged, self.buf)
        return lambda: dist.broadcast(self.buf, src=0)

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`, as NumPy."""
        return {"allgather": self.out, "reducescatter": self.part,
                "alltoall": self.exchanged}.get(op, self.buf).numpy()


class TorchCudaStack(TorchStack):
    """torch.distributed (--torch-backend) on CUDA tensors of the same sizes on the same GPU
    as FerrovodCudaStack's, with TorchStack's calls. Only the output that `op` writes is
    allocated: at 1 GiB, two ranks' buffers of both columns share one GPU."""

    def __init__(self, count: int, rank: int, n: int, device: torch.device, op: str,
                 nccl: bool) -> None:
        import torch

        self.torch = torch
        self.dist = torch.distributed
        self.device = device
        self.nccl = nccl
        self.source = torch.from_numpy(pattern(count, rank)).to(device)
        self.buf = torch.empty_like(self.source)
        if op == "allgather":
            self.out = torch.empty(count * n, dtype=torch.float32, device=device)
            self.out_list = list(self.out.chunk(n))
        elif op == "reducescatter":
            self.part = torch.empty(count // n, dtype=torch.float32, device=device)
        elif op == "alltoall":
            self.exchanged = torch.empty(count // n * n, dtype=torch.float32, device=device)

    def reset(self) -> None:
        """Refills the input on the device and waits for the copy (untimed)."""
        self.buf.copy_(self.source)
        self.torch.cuda.synchronize(self.device)

    def sync(self) -> None:
        """The ranks meet in this stack's own barrier (untimed). NCCL's barrier is a device
        allreduce: it names the device, and is waited for so that it overlaps no timed call."""
        if self.nccl:
            self.dist.barrier(device_ids=[self.device.index])
        else:
            self.dist.barrier()
        self.torch.cuda.synchronize(self.device)

    def wait(self) -> None:
        """Waits for the device work of the last call (NCCL's calls return once queued)."""
        self.torch.cuda.synchronize(self.device)

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`, copied to NumPy."""
        out = {"allgather": "out", "reducescatter": "part", "alltoall": "exchanged"}.get(op, "buf")
        return getattr(self, out).cpu().numpy()


_torch_has_allgather_into_tensor = False


def init_torch(rank: int, n: int, master_addr: str, backend: str = "gloo",
               device: torch.device | None = None) -> None:
    """Starts torch.distributed (`backend`) on a port that rank 0 picks and broadcasts; the
    allgather probe runs on `device` (None: CPU), where the timed calls will."""
    global _torch_has_allgather_into_tensor
    import torch
    import torch.distributed as dist

    # One thread per process, as ferrovod's ranks have: the ranks share this VM's cores.
    torch.set_num_threads(1)
    port = 0
    if rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((master_addr, 0))
            port = sock.getsockname()[1]
    port = fv.broadcast_object(port, root_rank=0, name="bench.torch_port")
    dist.init_process_group(
        backend, init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=n
    )
    # Older gloo builds lack the flat-output allgather (on CUDA tensors too, perhaps); probe
    # once, the same way on all ranks.
    try:
        probe_out = torch.empty(n, dtype=torch.float32, device=device)
        dist.all_gather_into_tensor(probe_out, torch.ones(1, device=device))
        _torch_has_allgather_into_tensor = True
    except (AttributeError, RuntimeError, NotImplementedError):
        _torch_has_allgather_into_tensor = False
    flags = fv.allgather_object(_torch_has_allgather_into_tensor, name="bench.torch_probe")
    _torch_has_allgather_into_tensor = all(flags)


# The peers --compare accepts: name → stack constructor (count, rank, n).
PEERS: dict[str, Callable[[int, int, int], Any]] = {
    "torch": TorchStack,
    "mpi4py": MpiStack,
    "horovod": HorovodStack,
}


def verify(stack: Any, op: str, want: np.ndarray, tag: str) -> bool:
    """Runs `op` once and compares with the independently computed result `want`.

    Returns whether every rank got the right result (agreed over all ranks, so that they all
    skip or all run the timing that follows). A wrong result is described on stderr.
    """
    return all(fv.allgather_object(check_once(stack, op, want), name=f"bench.verify.{tag}"))


#: Verdicts of verify_on_device, agreed over all ranks.
OK, WRONG, NOT_AVAILABLE = "ok", "WRONG", "n/a"


def verify_on_device(stack: Any, op: str, want: np.ndarray, tag: str,
                     may_refuse: bool) -> tuple[str, str]:
    """verify() for a device stack: (verdict, why) with verdict OK, WRONG or NOT_AVAILABLE.

    With `may_refuse`, an exception from the call (a backend without this op on CUDA tensors,
    such as gloo's reduce_scatter) makes the op NOT_AVAILABLE for this stack instead of ending
    the run; `why` is the first line of the first rank's error. Backends check such arguments
    before communicating, so every rank raises alike and none is left waiting.
    """
    try:
        mine = OK if check_once(stack, op, want, stack.wait) else WRONG
    except Exception as err:  # torch raises RuntimeError, ValueError and its own classes
        if not may_refuse:
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        mine = f"{NOT_AVAILABLE}: {type(err).__name__}: {first_line}"
    verdicts = fv.allgather_object(mine, name=f"bench.verify.{tag}")
    refused = [v for v in verdicts if v.startswith(NOT_AVAILABLE)]
    if refused:
        return NOT_AVAILABLE, refused[0].split(": ", 1)[1]
    return (OK, "") if all(v == OK for v in verdicts) else (WRONG, "")


def check_once(stack: Any, op: str, want: np.ndarray,
               wait: Callable[[], None] | None = None) -> bool:
    """This rank's part of verify(): runs `op` once (then `wait`, for a device stack) and says
    whether its result is `want`, describing a wrong one on stderr."""
    stack.reset()
    stack.call(op)()
    if wait is not None:
        wait()
    got = np.asarray(stack.result(op))
    ok = got.shape == want.shape and np.array_equal(got, want)
    if not ok:
        if got.shape == want.shape:
            bad = np.flatnonzero(got.ravel() != want.ravel())[:3]
        else:
            bad = np.zeros(0, dtype=np.int64)
        print(
            f"rank {fv.rank()}: WRONG RESULT from {stack.name} {op} of "
            f"{stack.source.shape[0]} float32: shape {got.shape} (want {want.shape}), "
            f"{int(np.count_nonzero(got != want)) if got.shape == want.shape else 'all'} "
            f"wrong values, first at {bad.tolist()}: "
            f"got {got.ravel()[bad].tolist()} want {want.ravel()[bad].tolist()}",
            file=sys.stderr,
            flush=True,
        )
    return ok


def iterations(nbytes: int, max_iters: int) -> int:
    """How many timed calls for a message of nbytes."""
    return max(MIN_ITERS, min(max_iters, BYTES_PER_SIZE // max(nbytes, 1)))


def row_text(cells: list[str], widths: list[int]) -> str:
    """Right-aligned table row."""
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths))


def cuda_problem() -> str | None:
    """Why this process cannot run --device cuda (no torch, no CUDA device), or None."""
    try:
        import torch
    except ImportError as err:
        return f"torch cannot be imported by {sys.executable} ({err})"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA device: torch {torch.__version__} ({build}) sees none"
    return None


def rank_device(local_rank: int) -> torch.device:
    """This rank's GPU: ranks of a host take the visible GPUs in turn (several ranks share one
    when there are more ranks than GPUs)."""
    import torch

    return torch.device("cuda", local_rank % torch.cuda.device_count())


def run_on_device(ops: list[str], sizes: list[int], max_iters: int, rounds: int,
                  bytes_per_round: int, torch_backend: str, master_addr: str) -> int:
    """--device cuda, after fv.init(): ferrovod.torch beside torch.distributed on CUDA tensors,
    in alternating rounds. Returns the exit status."""
    rank, n = fv.rank(), fv.size()
    # Agreed before anything touches a GPU, so that every rank stops alike, with one line.
    problems = fv.allgather_object(cuda_problem(), name="bench.cuda_check")
    if any(problems):
        if rank == 0:
            where = [r for r, p in enumerate(problems) if p]
            first = next(p for p in problems if p)
            print(f"--device cuda: {first} (rank{'s' if len(where) > 1 else ''} "
                  f"{', '.join(map(str, where))} of {n})", file=sys.stderr, flush=True)
        fv.shutdown()
        return 2

    import torch
    import torch.distributed as dist

    import ferrovod.torch as fvt
    import ferrovod.torch._cuda as fvt_cuda

    device = rank_device(fv.local_rank())
    torch.cuda.set_device(device)
    backend = torch_backend if torch_backend != "auto" else ("nccl" if n == 1 else "gloo")
    if backend == "nccl" and not dist.is_nccl_available():
        raise SystemExit("--torch-backend nccl: this torch has no NCCL (use gloo)")
    # The first CUDA op makes ferrovod decide between NCCL and host staging: the header says
    # what it decided.
    fvt.allreduce_(torch.ones(1, device=device), op=fvt.Sum, name="bench.cuda_first")
    torch.cuda.synchronize(device)
    usable, why = fvt_cuda._device_path()
    init_torch(rank, n, master_addr, backend, device)
    placements = fv.allgather_object((socket.gethostname(), device.index), name="bench.gpus")
    # Ranks that share a GPU only pause before each column, where the other ranks' threads
    # would otherwise still be busy (see SETTLE_S); a lone rank has none.
    settle_s = DEVICE_SETTLE_S if n > 1 else 0.0

    headers = ["op", "size", "iters", "fv µs", "fv busbw GB/s", "torch µs", "torch busbw GB/s",
               "vs torch"]
    widths = [max(len(h), 10) for h in headers]
    widths[0] = 9
    if rank == 0:
        import platform

        dispatch = os.environ.get("FERROVOD_NCCL_DISPATCH")
        # The engine's route (device_path) unless ranks share a GPU, which the engine stages.
        if not usable:
            path = "staged through host memory by the adapter"
        elif len(set(placements)) < len(placements):
            path = "staged through pinned host memory by the engine (ranks share a GPU)"
        else:
            path = "taken by the engine"
        print(f"# ferrovod {getattr(fv, '__version__', '?')}, {n} ranks on "
              f"{len(set(placements))} GPU(s), float32 on {device} "
              f"({torch.cuda.get_device_name(device)}), python {platform.python_version()}, "
              f"torch {torch.__version__} {backend}, {rounds} rounds (median of round medians)")
        print(f"# ferrovod CUDA tensors: {path} ({why}); FERROVOD_NCCL_DISPATCH="
              f"{dispatch if dispatch is not None else 'unset'}")
        print(row_text(headers, widths))
        print(row_text(["-" * w for w in widths], widths), flush=True)

    explained: set[str] = set()  # ops whose torch n/a has been explained on stderr
    failures = 0
    for op in ops:
        for nbytes in sizes:
            count = nbytes // 4
            if op in SPLIT_OPS and count % n:
                continue  # no equal block per rank (torch's calls need one)
            iters = device_iterations(nbytes, max_iters, bytes_per_round)
            warmup = device_warmup(nbytes, iters)
            want = expected(op, count, n, root=0)
            if op in SPLIT_OPS:
                want = want[rank]
            stacks: dict[str, Any] = {
                "ferrovod": FerrovodCudaStack(count, rank, device),
                "torch": TorchCudaStack(count, rank, n, device, op, backend == "nccl"),
            }
            verdicts: dict[str, str] = {}
            for column, stack in stacks.items():
                verdicts[column], why_not = verify_on_device(
                    stack, op, want, f"{column}.{op}.{nbytes}", may_refuse=column == "torch")
                if verdicts[column] == WRONG:
                    failures += 1
                if verdicts[column] == NOT_AVAILABLE and rank == 0 and op not in explained:
                    explained.add(op)
                    print(f"torch {backend} {op} on CUDA tensors: n/a ({why_not})",
                          file=sys.stderr, flush=True)
            del want
            medians: dict[str, list[float]] = {column: [] for column in stacks}
            for round_no in range(rounds):
                for column, stack in stacks.items():
                    if verdicts[column] != OK:
                        continue
                    tag = f"{column}.{op}.{nbytes}.{round_no}"
                    if settle_s:
                        time.sleep(settle_s)
                    fv.allgather_object(None, name=f"bench.settle.{tag}")
                    seconds = time_device_calls(stack, op, iters, warmup, nbytes)
                    medians[column].append(slowest(seconds, tag))
            del stack, stacks  # frees both columns' device buffers before the next size
            if rank == 0:
                cells = [op, format_size(nbytes), str(iters)]
                timed: dict[str, Timing] = {}
                for column in ("ferrovod", "torch"):
                    if verdicts[column] == OK:
                        timed[column] = Timing(statistics.median(medians[column]), nbytes, op, n)
                        cells += [f"{timed[column].seconds * 1e6:.1f}",
                                  f"{timed[column].busbw:.3f}"]
                    else:
                        cells += [verdicts[column], "-" if verdicts[column] == WRONG else "n/a"]
                cells.append(f"{timed['torch'].seconds / timed['ferrovod'].seconds:.2f}x"
                             if len(timed) == 2 else "-")
                print(row_text(cells, widths), flush=True)

    dist.destroy_process_group()
    fv.shutdown()
    if failures:
        if rank == 0:
            print(f"{failures} result(s) were WRONG; their timings are not shown",
                  file=sys.stderr)
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ",".join(OPS))
    parser.add_argument("--sizes", default=None, help="comma-separated sizes in bytes (64K, 16M)")
    parser.add_argument("--max-size", default=None,
                        help="largest default size (default: 256MiB; 1GiB with --device cuda)")
    parser.add_argument("--iters", type=int, default=200, help="timed calls for small sizes")
    parser.add_argument("--compare", default="",
                        help="comma-separated peers to time in the same run: torch "
                             "(torch.distributed gloo), mpi4py (under mpirun), horovod "
                             "(horovod.torch; needs the venv of scripts/install_horovod.sh); "
                             "with --device cuda always torch, and only torch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the tensors live: cpu (NumPy arrays, default) or cuda "
                             "(torch CUDA tensors, ferrovod.torch beside torch.distributed)")
    parser.add_argument("--torch-backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="--device cuda: torch.distributed's backend; auto: nccl for a "
                             "one-rank job, gloo otherwise (ranks sharing a GPU cannot use "
                             "NCCL)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"--device cuda: rounds per size, alternating the columns; each "
                             f"column shows the median of its rounds' medians (default: "
                             f"{DEVICE_ROUNDS})")
    parser.add_argument("--bytes-per-round", default=None,
                        help="--device cuda: bytes of input each column times per op, size and "
                             "round, which sets the calls per round (at least "
                             f"{DEVICE_MIN_ITERS}, at most --iters; default: "
                             f"{format_size(DEVICE_BYTES_PER_ROUND).replace(' ', '')})")
    parser.add_argument("--horovod-controller", choices=("auto", "mpi", "gloo"), default="auto",
                        help="how Horovod joins: auto (MPI under mpirun, else gloo), mpi, gloo")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address of rank 0 for torch.distributed and Horovod's gloo "
                             "rendezvous (default: loopback)")
    args = parser.parse_args()

    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {OPS}")
    on_device = args.device == "cuda"
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        default_max = DEVICE_MAX_SIZE if on_device else DEFAULT_MAX_SIZE
        sizes = default_sizes(parse_size(args.max_size or format_size(default_max)))
    if any(size < 4 or size % 4 for size in sizes):
        parser.error("sizes must be positive multiples of 4 bytes (float32)")

    peers = [p.strip() for p in args.compare.split(",") if p.strip()]
    unknown_peers = [p for p in peers if p not in PEERS]
    if unknown_peers:
        parser.error(f"unknown peers {unknown_peers}; choose from {', '.join(PEERS)}")
    if on_device:
        if any(p != "torch" for p in peers):
            parser.error("--device cuda compares with torch.distributed only (--compare torch)")
        rounds = DEVICE_ROUNDS if args.rounds is None else args.rounds
        per_round = parse_size(args.bytes_per_round or format_size(DEVICE_BYTES_PER_ROUND))
        if rounds < 1 or per_round < 1:
            parser.error("--rounds and --bytes-per-round must be positive")
        fv.init()
        return run_on_device(ops, sizes, args.iters, rounds, per_round, args.torch_backend,
                             args.master_addr)
    for flag, value in (("--torch-backend", args.torch_backend != "auto"),
                        ("--rounds", args.rounds is not None),
                        ("--bytes-per-round", args.bytes_per_round is not None)):
        if value:
            parser.error(f"{flag} applies to --device cuda only")
    if "horovod" in peers:
        import_horovod()  # before fv.init(): a missing Horovod ends every rank at once

    fv.init()
    rank, n = fv.rank(), fv.size()
    if "mpi4py" in peers:
        check_mpi(n)
    if "torch" in peers:
        init_torch(rank, n, args.master_addr)
    horovod_job = None
    if "horovod" in peers:
        horovod_job = HorovodJob(rank, n, args.master_addr, args.horovod_controller)
        horovod_job.start()  # joins once up front, so that a job Horovod cannot join fails now
        horovod_job.stop()

    headers = ["op", "size", "iters", "fv µs", "fv busbw GB/s"]
    for peer in peers:
        headers += [f"{peer} µs", f"{peer} busbw GB/s"]
    headers += [f"vs {peer}" for peer in peers]
    widths = [max(len(h), 10) for h in headers]
    widths[0] = 9
    if rank == 0:
        import platform

        versions = []
        if "torch" in peers:
            versions.append(f"torch {sys.modules['torch'].__version__} gloo")
        if "mpi4py" in peers:
            from mpi4py import MPI

            versions.append(f"mpi4py over {MPI.Get_library_version().splitlines()[0][:40]}")
        if horovod_job is not None:
            import horovod

            versions.append(f"horovod {horovod.__version__} over {horovod_job.controller}")
        print(f"# ferrovod {getattr(fv, '__version__', '?')}, {n} ranks, float32, "
              f"python {platform.python_version()}, {os.cpu_count()} CPUs"
              + "".join(f", {v}" for v in versions))
        print(row_text(headers, widths))
        print(row_text(["-" * w for w in widths], widths))

    # Phases: ferrovod and the peers that need no background thread, then Horovod alone (see
    # HorovodJob). A row is printed once every column of it has been timed.
    columns = ["ferrovod", *peers]
    phases = [[c for c in columns if c != "horovod"]]
    if "horovod" in peers:
        phases.append(["horovod"])
    timings: dict[tuple[str, int], dict[str, Timing | None]] = {}
    failures = 0
    for phase_no, phase in enumerate(phases):
        last_phase = phase_no == len(phases) - 1
        if "horovod" in phase:
            assert horovod_job is not None
            horovod_job.start()
        for op in ops:
            for nbytes in sizes:
                count = nbytes // 4
                if op in SPLIT_OPS and count % n:
                    continue  # no equal block per rank (MPI's calls need one)
                iters = iterations(nbytes, args.iters)
                want = expected(op, count, n, root=0)
                if op in SPLIT_OPS:
                    want = want[rank]
                row = timings.setdefault((op, nbytes), {})
                for column in phase:
                    stack = (FerrovodStack(count, rank) if column == "ferrovod"
                             else PEERS[column](count, rank, n))
                    tag = f"{stack.name}.{op}.{nbytes}"
                    if verify(stack, op, want, tag):
                        # Let the previous column's threads go idle first (gloo's and Open
                        # MPI's poll for a while after their last call): whoever is timed
                        # right after another stack otherwise shares the cores with it.
                        time.sleep(SETTLE_S)
                        fv.allgather_object(None, name=f"bench.settle.{tag}")
                        seconds = time_calls(stack.call(op), stack.reset, stack.sync, iters,
                                             nbytes)
                        row[column] = Timing(slowest(seconds, tag), nbytes, op, n)
                    else:
                        row[column] = None
                        failures += 1
                    del stack  # frees its buffers (a gathered output too) before the next one
                if rank == 0 and last_phase:
                    cells = [op, format_size(nbytes), str(iters)]
                    for column in columns:
                        timing = row[column]
                        if timing is None:
                            cells += ["WRONG", "-"]
                        else:
                            cells += [f"{timing.seconds * 1e6:.1f}", f"{timing.busbw:.3f}"]
                    fv_t = row["ferrovod"]
                    for peer in peers:
                        peer_t = row[peer]
                        cells.append("-" if fv_t is None or peer_t is None else
                                     f"{peer_t.seconds / fv_t.seconds:.2f}x")
                    print(row_text(cells, widths), flush=True)
                del want
        if "horovod" in phase:
            assert horovod_job is not None
            horovod_job.stop()
            horovod_job.close()

    if "torch" in peers:
        import torch.distributed as dist

        dist.destroy_process_group()
    fv.shutdown()
    if failures:
        if rank == 0:
            print(f"{failures} row(s) gave WRONG results; their timings are not shown",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
