"""Allreduce latency by number of ranks, on one host or across hosts, beside Open MPI.

For each number of ranks N, the driver starts the same worker script as a ferrovod job
(``ferrovodrun -np N``) and as an Open MPI job (``mpirun --oversubscribe -np N``, mpi4py's
``Allreduce`` in place), alternating the two over several rounds in one sitting (these VMs have
short windows in which everything is several times slower, so a stack measured only once may
have met one). Each worker times loops of float32 sum allreduces of each size (``--sizes``:
4 B and 64 KiB unless given, e.g. ``--sizes 1MiB,64MiB``; a large op's loops last about a
second): the slowest rank's mean per op, best of 3 loops. It reports the CPU time (every thread
of the process) and the context switches a rank spent per op of the first size in that loop
(the mean of the ranks), how many file descriptors and threads its process holds and how long
``init`` took. The table shows, per N, each stack's best round, and ferrovod's time over Open
MPI's (below 1: ferrovod is faster)::

    python benchmarks/scale.py                      # N = 2 4 8 16 32, 3 rounds
    python benchmarks/scale.py --ranks 4,8 --rounds 5
    python benchmarks/scale.py --stacks ferrovod    # without Open MPI
    python benchmarks/scale.py --stacks ferrovod,mpi,horovod

``horovod`` is Horovod 0.28.1's ``horovod.torch`` (``hvd.allreduce_``) under ``mpirun``, its MPI
controller, from the venv ``scripts/install_horovod.sh`` builds (``--horovod-python``).

Across hosts (run as root: it builds network namespaces with ``tests/python/netns.py``)::

    python benchmarks/scale.py --hosts 2 --ranks 2,8      # 2 x 1 and 2 x 4
    python benchmarks/scale.py --hosts 4 --ranks 4,32     # 4 x 1 and 4 x 8

``--hosts K`` puts each N's ranks on K simulated hosts, N/K on each, joined over TCP on their
``eth0`` veths; both stacks are started on the first host, as their users start them:
``ferrovodrun -H h1:N/K,... --network-interfaces eth0`` and ``mpirun -H h1:N/K,...`` with
netns.py's ``Cluster.mpirun_args()``: ``--mca mpi_yield_when_idle 1`` (without it Open MPI
busy-polls whenever a host has more ranks than cores) and its TCP and out-of-band traffic on
``eth0``, ssh on the hosts' port 2222.

With more ranks than cores every job is oversubscribed, as in a pod whose CPU limit is below
its ranks' threads; ``nproc`` is printed with the table. Needs ``ferrovodrun`` (this
environment's), and for the Open MPI column ``mpirun`` and mpi4py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "python"))
from netns import Cluster, missing_tools  # noqa: E402

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
TAG = "SCALE_RESULT "
WARM_S = 0.2  # seconds of the op before timing it
LOOP_S = 0.02  # seconds a timed loop lasts at least


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _switches() -> int:
    """Context switches of this process's threads so far (voluntary and not: a yield that
    hands the core over counts as involuntary)."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/status") as f:
                total += sum(int(line.split()[1]) for line in f
                             if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
        except OSError:
            pass
    return total


def parse_sizes(text: str) -> Dict[str, int]:
    """``"4B,64KiB,1MiB"`` as ``{"4 B": 1, "64 KiB": 16384, "1 MiB": 262144}`` (float32
    elements per label)."""
    sizes = {}
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(B|KiB|MiB)\s*", item)
        if not m or int(m.group(1)) * _UNITS[m.group(2)] % 4:
            raise SystemExit(f"scale: bad size {item!r} (e.g. 4B, 64KiB, 1MiB: whole float32s)")
        sizes[f"{m.group(1)} {m.group(2)}"] = int(m.group(1)) * _UNITS[m.group(2)] // 4
    return sizes


def worker(stack: str, iters: int, sizes: Dict[str, int]) -> None:
    """One rank: time the allreduces, print rank 0's summary line."""
    import numpy as np

    t0 = time.perf_counter()
    if stack == "ferrovod":
        import ferrovod as fv

        fv.init()
        rank, size = fv.rank(), fv.size()

        def allreduce(buf: "np.ndarray") -> None:
            fv.allreduce_(buf, op=fv.Sum, name="x")

        def slowest(x: float) -> float:
            return float(fv.allreduce(np.array([x]), op=fv.Max, name="slowest")[0])

        def gather(x: float) -> List[float]:
            return [float(v) for v in fv.allgather(np.array([x]), name="gather")]

    elif stack == "horovod":
        import horovod.torch as hvd
        import torch

        hvd.init()
        rank, size = hvd.rank(), hvd.size()

        def allreduce(buf: "np.ndarray") -> None:
            hvd.allreduce_(torch.from_numpy(buf), op=hvd.Sum, name="x")

        def slowest(x: float) -> float:
            return float(hvd.allreduce(torch.tensor([x]), op=hvd.Max, name="slowest")[0])

        def gather(x: float) -> List[float]:
            return [float(v) for v in hvd.allgather(torch.tensor([x]), name="gather")]

    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()

        def allreduce(buf: "np.ndarray") -> None:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

        def slowest(x: float) -> float:
            return float(comm.allreduce(x, op=MPI.MAX))

        def gather(x: float) -> List[float]:
            return [float(v) for v in comm.allgather(x)]

    init_s = slowest(time.perf_counter() - t0)
    result: Dict[str, object] = {"ranks": size, "init_s": init_s}
    for label, n in sizes.items():
        buf = np.ones(n, dtype=np.float32)
        # Warm up for WARM_S: right after init the ranks' shares of the cores are uneven (the
        # ones that slept in init are owed CPU), which for the first tens of milliseconds
        # makes a waiting rank's yields keep its core. A training step's compute evens them
        # out; here the warm-up does. Counted from the slowest rank's pace, so that every
        # rank runs as many ops. Each timed loop lasts at least LOOP_S as well.
        pace = time.perf_counter()
        for _ in range(10):
            allreduce(buf)
        per_op = slowest((time.perf_counter() - pace) / 10)
        for _ in range(int(WARM_S / per_op)):
            allreduce(buf)
        # Large ops: a loop of about a second, not iters of them.
        loop = max(min(iters, int(1.0 / per_op) + 1), int(LOOP_S / per_op))
        best = float("inf")
        for _ in range(3):
            buf[:] = 1.0
            cpu, switches = time.process_time(), _switches()
            start = time.perf_counter()
            for _ in range(loop):
                allreduce(buf)
            per_op = slowest((time.perf_counter() - start) / loop)
            # What each rank spent per op: CPU (every thread of the process) and switches,
            # the mean over the ranks, of the best loop.
            cpu = sum(gather((time.process_time() - cpu) / loop)) / size
            switches = sum(gather((_switches() - switches) / loop)) / size
            if per_op < best:
                result[f"cpu {label}"] = cpu * 1e6
                result[f"switches {label}"] = switches
            best = min(best, per_op)
        # The timed sums overflow to inf; one more op from ones checks the result.
        buf[:] = 1.0
        allreduce(buf)
        if not np.all(buf == size):
            raise SystemExit(f"rank {rank}: allreduce of ones gave {buf[:4]}, expected {size}")
        result[label] = best * 1e6
    fds = gather(float(_fds()))
    threads = gather(float(_threads()))
    result["fds_max"] = max(fds)
    result["threads_max"] = max(threads)
    if rank == 0:
        print(TAG + json.dumps(result), flush=True)
    if stack == "ferrovod":
        fv.shutdown()


def _command(stack: str, n: int, iters: int, horovod_python: str = "",
             cluster: "Optional[Cluster]" = None, sizes: str = "4B,64KiB") -> List[str]:
    python = horovod_python if stack == "horovod" else sys.executable
    me = [python, os.path.abspath(__file__), "--worker", stack, "--iters", str(iters),
          "--sizes", sizes]
    hosts: List[str] = []
    if cluster is not None:
        names = list(cluster.hosts)
        hosts = ["-H", ",".join(f"{h}:{n // len(names)}" for h in names)]
    if stack == "ferrovod":
        run = shutil.which("ferrovodrun", path=os.path.dirname(sys.executable)) or "ferrovodrun"
        if cluster is None:
            return [run, "-np", str(n)] + me
        return cluster.command(names[0], [
            run, "-np", str(n), *hosts, "-p", "2222", "-i", str(cluster.key),
            "--network-interfaces", "eth0", *me])
    extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    if cluster is None:
        return ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n)] + extra + me
    return cluster.command(names[0], [
        "mpirun", "-np", str(n), *hosts, *extra, "--bind-to", "none", *cluster.mpirun_args(),
        "-x", "PATH", "-x", "PYTHONPATH", *me])


def _run(stack: str, n: int, iters: int, timeout: float, horovod_python: str = "",
         cluster: "Optional[Cluster]" = None,
         sizes: str = "4B,64KiB") -> Optional[Dict[str, float]]:
    env = dict(os.environ)
    # mpirun's workers must not take ferrovod's job for theirs, nor the other way round.
    for k in [k for k in env if k.startswith(("FERROVOD_RANK", "OMPI_", "PMI"))]:
        env.pop(k)
    start = time.perf_counter()
    try:
        p = subprocess.run(_command(stack, n, iters, horovod_python, cluster, sizes), env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"  {stack} -np {n}: timed out after {timeout:.0f} s", file=sys.stderr)
        return None
    wall = time.perf_counter() - start
    for line in p.stdout.splitlines():
        at = line.find(TAG)  # ferrovodrun prefixes each line with the rank
        if at >= 0:
            out = json.loads(line[at + len(TAG):])
            out["wall_s"] = wall
            return out
    print(f"  {stack} -np {n}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}",
          file=sys.stderr)
    return None


def driver(args: argparse.Namespace) -> None:
    if not args.hosts:
        _measure(args, None)
        return
    if os.geteuid() != 0 or missing_tools() is not None:
        raise SystemExit(f"scale: --hosts needs root and {missing_tools() or 'namespaces'}")
    ranks = [int(r) for r in args.ranks.split(",")]
    if any(n % args.hosts for n in ranks):
        raise SystemExit(f"scale: every number of ranks must be a multiple of --hosts {args.hosts}")
    workdir = Path(tempfile.mkdtemp(prefix="fv-scale-"))
    try:
        with Cluster([f"h{i + 1}" for i in range(args.hosts)], workdir) as cluster:
            _measure(args, cluster)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _measure(args: argparse.Namespace, cluster: "Optional[Cluster]") -> None:
    labels = list(parse_sizes(args.sizes))
    first = labels[0]  # the size whose CPU and switches per op the table shows
    stacks = args.stacks.split(",")
    if "mpi" in stacks and shutil.which("mpirun") is None:
        print("scale: no mpirun here; timing ferrovod alone", file=sys.stderr)
        stacks = [s for s in stacks if s not in ("mpi", "horovod")]
    if "horovod" in stacks and not os.access(args.horovod_python, os.X_OK):
        print(f"scale: no {args.horovod_python} (scripts/install_horovod.sh builds it); "
              "timing without Horovod", file=sys.stderr)
        stacks = [s for s in stacks if s != "horovod"]
    ranks = [int(r) for r in args.ranks.split(",")]
    got: Dict[tuple, List[Dict[str, float]]] = {}
    for rnd in range(args.rounds):
        for n in ranks:
            iters = max(20, args.ops // n)
            order = stacks if rnd % 2 == 0 else stacks[::-1]
            for stack in order:
                r = _run(stack, n, iters, args.timeout, args.horovod_python, cluster, args.sizes)
                if r is not None:
                    got.setdefault((stack, n), []).append(r)
                    times = ", ".join(f"{label} {r[label]:9.1f} us" for label in labels)
                    print(f"  round {rnd + 1}: {stack:8s} -np {n:3d}: {times}", file=sys.stderr,
                          flush=True)
    where = (f"{len(cluster.hosts)} hosts over TCP (network namespaces)" if cluster
             else "one host")
    print(f"\nallreduce, us per op (best of {args.rounds} rounds; {where}; nproc "
          f"{os.cpu_count()}); ratio = ferrovod / Open MPI\n")
    head = ["ranks" if cluster is None else "ranks (hosts x ranks)"]
    for label in labels:
        head += [f"ferrovod {label}", f"Open MPI {label}", "ratio"]
    hvd = "horovod" in stacks
    if hvd:
        head += [f"Horovod {label}" for label in labels]
    head += [f"CPU us per rank, {first} (fv/MPI)", f"switches per rank, {first} (fv/MPI)",
             "fds (fv/MPI)", "threads (fv/MPI)", "init s (fv/MPI)", "job s (fv/MPI)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))

    def best(stack: str, n: int, key: str, pick=min) -> Optional[float]:
        runs = got.get((stack, n))
        return pick(r[key] for r in runs) if runs else None

    def fmt(x: Optional[float], spec: str = ".1f") -> str:
        return "-" if x is None else format(x, spec)

    for n in ranks:
        row = [str(n) if cluster is None else f"{n} ({len(cluster.hosts)} x {n // len(cluster.hosts)})"]
        for label in labels:
            f, m = best("ferrovod", n, label), best("mpi", n, label)
            row += [fmt(f), fmt(m), fmt(f / m if f and m else None, ".2f")]
        if hvd:
            row += [fmt(best("horovod", n, label)) for label in labels]
        for key, spec, pick in ((f"cpu {first}", ".1f", min), (f"switches {first}", ".2f", min),
                                ("fds_max", ".0f", statistics.median),
                                ("threads_max", ".0f", statistics.median),
                                ("init_s", ".2f", statistics.median),
                                ("wall_s", ".1f", statistics.median)):
            row.append(f"{fmt(best('ferrovod', n, key, pick), spec)} / "
                       f"{fmt(best('mpi', n, key, pick), spec)}")
        print("| " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="2,4,8,16,32", help="comma-separated numbers of ranks")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stacks", default="ferrovod,mpi",
                   help="comma-separated: ferrovod, mpi, horovod")
    p.add_argument("--horovod-python",
                   default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
                       __file__))), ".venv-horovod", "bin", "python"),
                   help="the interpreter of the venv scripts/install_horovod.sh builds")
    p.add_argument("--ops", type=int, default=4000,
                   help="ops per timed loop at 1 rank; a loop at N ranks runs ops/N (at least 20)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per job")
    p.add_argument("--sizes", default="4B,64KiB",
                   help="comma-separated allreduce sizes (B, KiB or MiB of float32), e.g. 1MiB,64MiB")
    p.add_argument("--hosts", type=int, default=0,
                   help="simulated hosts (network namespaces, as root) to spread the ranks over")
    p.add_argument("--worker", choices=("ferrovod", "mpi", "horovod"), help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, default=100, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.iters, parse_sizes(args.sizes))
    else:
        driver(args)


if __name__ == "__main__":
    main()
