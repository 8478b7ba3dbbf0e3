"""Latency and bus bandwidth of ferrovod's collectives, optionally beside torch.distributed.

Run under the launcher, e.g.::

    ferrovodrun -np 2 python benchmarks/collectives.py
    ferrovodrun -np 2 python benchmarks/collectives.py --compare torch --ops allreduce

For each op (allreduce, allgather, broadcast) and each float32 message size, every rank times
each call on its own (warm-up calls first, untimed); a row shows the median over the calls of
the slowest rank. Bus bandwidth follows nccl-tests: algbw = bytes / time, with bytes the
per-rank buffer (allgather: the whole gathered output), and busbw = algbw x 2(n-1)/n for
allreduce, x (n-1)/n for allgather and x 1 for broadcast, so that it can be compared with a
link's bandwidth whatever the number of ranks.

With ``--compare torch`` the same run also sets up ``torch.distributed`` with the gloo backend
on loopback and times the same ops on tensors of the same sizes; with ``--compare mpi4py`` it
times mpi4py's buffer calls (``Allreduce`` in place, ``Allgather``, ``Bcast``) — which needs
the job started by ``mpirun`` (ferrovod then finds its peers over MPI too)::

    mpirun -np 2 --bind-to none python benchmarks/collectives.py --compare torch,mpi4py

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import ferrovod as fv

OPS = ("allreduce", "allgather", "broadcast")
DEFAULT_MAX_SIZE = 256 << 20
# Bytes each rank should move per size and op, to size the repeat count: small messages get
# many repetitions, large ones few (but never fewer than MIN_ITERS).
BYTES_PER_SIZE = 1 << 30
MIN_ITERS = 5


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
    if op == "allgather":
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


def time_calls(call: Callable[[], Any], reset: Callable[[], None], iters: int) -> float:
    """This rank's median seconds of `call` over `iters` runs, after warm-up runs."""
    for _ in range(max(2, iters // 10)):
        reset()
        call()
    samples = []
    for _ in range(iters):
        reset()
        start = time.perf_counter()
        call()
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

    def call(self, op: str) -> Callable[[], Any]:
        """The call to time, with a fixed name per op and size, as a training loop would."""
        name = f"bench.{op}.{self.tag}"
        if op == "allreduce":
            return lambda: fv.allreduce_(self.buf, op=fv.Sum, name=name)
        if op == "allgather":

            def gather() -> None:
                self.out = fv.allgather(self.buf, name=name)

            return gather
        return lambda: fv.broadcast_(self.buf, root_rank=0, name=name)

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`, as NumPy."""
        return self.out if op == "allgather" else self.buf


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

    def reset(self) -> None:
        """Restores the input that an in-place op overwrote (untimed)."""
        np.copyto(self.buf, self.source)

    def call(self, op: str) -> Callable[[], Any]:
        """The matching mpi4py call."""
        mpi, comm = self.mpi, self.comm
        if op == "allreduce":
            return lambda: comm.Allreduce(mpi.IN_PLACE, self.buf, op=mpi.SUM)
        if op == "allgather":
            return lambda: comm.Allgather(self.buf, self.out)
        return lambda: comm.Bcast(self.buf, root=0)

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`."""
        return self.out if op == "allgather" else self.buf


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

    def reset(self) -> None:
        """Restores the input that an in-place op overwrote (untimed)."""
        self.buf.copy_(self.source)

    def call(self, op: str) -> Callable[[], Any]:
        """The matching torch.distributed call."""
        dist = self.dist
        if op == "allreduce":
            return lambda: dist.all_reduce(self.buf, op=dist.ReduceOp.SUM)
        if op == "allgather":
            if hasattr(dist, "all_gather_into_tensor") and _gloo_has_allgather_into_tensor:
                return lambda: dist.all_gather_into_tensor(self.out, self.buf)
            return lambda: dist.all_gather(self.out_list, self.buf)
        return lambda: dist.broadcast(self.buf, src=0)

    def result(self, op: str) -> np.ndarray:
        """The result of the last call of `op`, as NumPy."""
        return (self.out if op == "allgather" else self.buf).numpy()


_gloo_has_allgather_into_tensor = False


def init_torch(rank: int, n: int, master_addr: str) -> None:
    """Starts torch.distributed (gloo) on a port that rank 0 picks and broadcasts."""
    global _gloo_has_allgather_into_tensor
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
        "gloo", init_method=f"tcp://{master_addr}:{port}", rank=rank, world_size=n
    )
    # Older gloo builds lack the flat-output allgather; probe once, the same way on all ranks.
    try:
        probe_out = torch.empty(n, dtype=torch.float32)
        dist.all_gather_into_tensor(probe_out, torch.ones(1))
        _gloo_has_allgather_into_tensor = True
    except (AttributeError, RuntimeError, NotImplementedError):
        _gloo_has_allgather_into_tensor = False
    flags = fv.allgather_object(_gloo_has_allgather_into_tensor, name="bench.torch_probe")
    _gloo_has_allgather_into_tensor = all(flags)


def verify(stack: Any, op: str, want: np.ndarray, tag: str) -> bool:
    """Runs `op` once and compares with the independently computed result `want`.

    Returns whether every rank got the right result (agreed over all ranks, so that they all
    skip or all run the timing that follows). A wrong result is described on stderr.
    """
    stack.reset()
    stack.call(op)()
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
    return all(fv.allgather_object(ok, name=f"bench.verify.{tag}"))


def iterations(nbytes: int, max_iters: int) -> int:
    """How many timed calls for a message of nbytes."""
    return max(MIN_ITERS, min(max_iters, BYTES_PER_SIZE // max(nbytes, 1)))


def row_text(cells: list[str], widths: list[int]) -> str:
    """Right-aligned table row."""
    return "  ".join(cell.rjust(width) for cell, width in zip(cells, widths))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated: " + ",".join(OPS))
    parser.add_argument("--sizes", default=None, help="comma-separated sizes in bytes (64K, 16M)")
    parser.add_argument("--max-size", default=format_size(DEFAULT_MAX_SIZE).replace(" ", ""),
                        help="largest default size (default: 256MiB)")
    parser.add_argument("--iters", type=int, default=200, help="timed calls for small sizes")
    parser.add_argument("--compare", default="",
                        help="comma-separated peers to time in the same run: torch "
                             "(torch.distributed gloo), mpi4py (under mpirun)")
    parser.add_argument("--master-addr", default="127.0.0.1",
                        help="address of rank 0 for torch.distributed (default: loopback)")
    args = parser.parse_args()

    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        parser.error(f"unknown ops {unknown}; choose from {OPS}")
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    else:
        sizes = default_sizes(parse_size(args.max_size))
    if any(size < 4 or size % 4 for size in sizes):
        parser.error("sizes must be positive multiples of 4 bytes (float32)")

    peers = [p.strip() for p in args.compare.split(",") if p.strip()]
    unknown_peers = [p for p in peers if p not in ("torch", "mpi4py")]
    if unknown_peers:
        parser.error(f"unknown peers {unknown_peers}; choose from torch, mpi4py")

    fv.init()
    rank, n = fv.rank(), fv.size()
    if "mpi4py" in peers:
        check_mpi(n)
    if "torch" in peers:
        init_torch(rank, n, args.master_addr)

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
        print(f"# ferrovod {getattr(fv, '__version__', '?')}, {n} ranks, float32, "
              f"python {platform.python_version()}, {os.cpu_count()} CPUs"
              + "".join(f", {v}" for v in versions))
        print(row_text(headers, widths))
        print(row_text(["-" * w for w in widths], widths))

    failures = 0
    for op in ops:
        for nbytes in sizes:
            count = nbytes // 4
            iters = iterations(nbytes, args.iters)
            stacks: list[Any] = [FerrovodStack(count, rank)]
            for peer in peers:
                stacks.append(TorchStack(count, rank, n) if peer == "torch"
                              else MpiStack(count, rank, n))
            want = expected(op, count, n, root=0)
            timings: list[Timing | None] = []
            for stack in stacks:
                tag = f"{stack.name}.{op}.{nbytes}"
                if verify(stack, op, want, tag):
                    seconds = time_calls(stack.call(op), stack.reset, iters)
                    timings.append(Timing(slowest(seconds, tag), nbytes, op, n))
                else:
                    timings.append(None)
                    failures += 1
                if isinstance(stack, FerrovodStack):
                    stack.out = None  # frees the gathered output before torch's run
            if rank == 0:
                cells = [op, format_size(nbytes), str(iters)]
                for timing in timings:
                    if timing is None:
                        cells += ["WRONG", "-"]
                    else:
                        cells += [f"{timing.seconds * 1e6:.1f}", f"{timing.busbw:.3f}"]
                fv_t = timings[0]
                for peer_t in timings[1:]:
                    cells.append("-" if fv_t is None or peer_t is None else
                                 f"{peer_t.seconds / fv_t.seconds:.2f}x")
                print(row_text(cells, widths), flush=True)
            del stacks, want

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
