"""Hundreds of ranks on one machine: start-up, allreduce time, negotiation messages,
descriptors, threads and memory against N, ferrovod beside Open MPI.

Python would cost each rank tens of MB and a second of start-up, so here each rank is a
program without it: ``examples/scale_worker.rs`` (the engine, driven as the adapters drive it,
started by ``ferrovodrun``) and ``benchmarks/scale_worker.c`` (``MPI_Allreduce`` under
``mpirun --oversubscribe``). Both time 4-byte and 64 KiB float32 sum allreduces (the slowest
rank's best of 3 loops) and report the worst rank's descriptors, threads and resident memory.
ferrovod's worker also counts the control frames (negotiation messages) each rank sent and
received per op: rank 0's and the most of any other rank's. Columns:

- ``ferrovod``: as a job runs by default (small blocking ops of ranks on one host take the
  fast path, which sends no control frames);
- ``fv engine``: ``FERROVOD_FAST_PATH_BYTES=0``, every op negotiated through rank 0's
  coordinator, as ops of ranks on several hosts, async ops and ops above 64 KiB are; the
  control messages travel the control tree (``FERROVOD_CONTROL_FANOUT``, default 16);
- ``fv star``: ``fv engine`` with ``FERROVOD_CONTROL_FANOUT=0``, every rank's control
  connection to rank 0 (as before the tree);
- ``Open MPI``.

Stacks alternate within each round (these VMs have windows in which everything is slower).
A job that does not finish in ``--timeout`` seconds is shown as such: at some N a design
stops being able to form a job on this machine, and that is a result too::

    python benchmarks/scale_many.py                          # N = 64, 128, 256; 2 rounds
    python benchmarks/scale_many.py --ranks 512,1024 --rounds 1 --timeout 900
    sudo .venv/bin/python benchmarks/scale_many.py --hosts 4 --ranks 32 --stacks "fv engine,fv star"

``--kill`` ends each ferrovod job by SIGKILLing its last rank while the others wait for it in
an allreduce, and adds the time until the last of them got an error (``kill s``, with the
errors' classes); Open MPI has no such column (a dead rank aborts its whole job).

``--before PATH`` adds each ferrovod stack run with another build of the worker (``X before``),
alternating with this one, for a before/after table in one sitting::

    git worktree add /tmp/base <commit> && (cd /tmp/base && cargo build --release --example scale_worker)
    python benchmarks/scale_many.py --ranks 64 --stacks "ferrovod,fv engine" \
        --before /tmp/base/target/release/examples/scale_worker

With ``--hosts K`` the ranks are spread over K network-namespace hosts (``tests/python/netns.py``;
needs root, iproute2 and openssh), ``ferrovodrun`` (or ``mpirun``) on a host of its own reaching
them over ssh; every ferrovod op then goes through the coordinator, as across real hosts.

Needs cargo (it builds the worker), ``ferrovodrun`` from this environment, and for the Open MPI
column ``mpirun`` and ``mpicc.openmpi`` (Debian: openmpi-bin, libopenmpi-dev).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "SCALE_RESULT "
STACKS = ("ferrovod", "fv engine", "fv star", "Open MPI")


def build(tmp: str) -> Dict[str, List[str]]:
    """The worker command of each stack that can be built here."""
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "scale_worker"],
                   cwd=ROOT, check=True)
    workers = {s: [os.path.join(ROOT, "target", "release", "examples", "scale_worker")]
               for s in STACKS[:3]}
    mpicc = shutil.which("mpicc.openmpi")
    if mpicc and shutil.which("mpirun"):
        exe = os.path.join(tmp, "scale_worker_mpi")
        made = subprocess.run([mpicc, "-O2", "-o", exe,
                               os.path.join(ROOT, "benchmarks", "scale_worker.c")],
                              capture_output=True, text=True)
        if made.returncode == 0:
            workers["Open MPI"] = [exe]
        else:
            print("scale_many: mpicc.openmpi failed (Debian: libopenmpi-dev); timing ferrovod "
                  f"alone\n{made.stderr[-500:]}", file=sys.stderr)
    else:
        print("scale_many: no mpicc.openmpi/mpirun here; timing ferrovod alone", file=sys.stderr)
    return workers


def command(stack: str, worker: List[str], n: int, iters: int, cluster=None,
            kill: bool = False) -> List[str]:
    names = [h for h in cluster.hosts if h != "h0"] if cluster is not None else []
    hosts = ",".join(f"{h}:{n // len(names)}" for h in names)
    if stack == "Open MPI":
        extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        mpirun = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n)] + extra
        if cluster is None:
            return mpirun + worker + [str(iters)]
        # TCP between hosts, shared memory within, as Open MPI's users run it on such hosts.
        return cluster.command("h0", mpirun + [
            "-H", hosts, *cluster.mpirun_args(), "-mca", "pml", "ob1", "-mca", "btl", "^openib",
        ] + worker + [str(iters)])
    run = shutil.which("ferrovodrun", path=os.path.dirname(sys.executable)) or "ferrovodrun"
    args = worker + [str(iters)] + (["kill"] if kill else [])
    if cluster is None:
        return [run, "-np", str(n)] + args
    return cluster.command("h0", [run, "-np", str(n), "-H", hosts, "-p", "2222", "-i",
                                  str(cluster.key)] + args)


def kill_result(stdout: str) -> dict:
    """The ``SCALE_KILL`` lines: seconds from the kill until the last survivor's error, and
    the survivors' error classes with their counts."""
    killed, failed, errors = None, [], {}
    for line in stdout.splitlines():
        at = line.find("SCALE_KILL ")
        if at < 0:
            continue
        r = json.loads(line[at + len("SCALE_KILL "):])
        if "killed_at" in r:
            killed = r["killed_at"]
        else:
            failed.append(r["failed_at"])
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    if killed is None or not failed:
        return {}
    return {"kill_s": max(failed) - killed, "kill_seen": len(failed), "kill_errors": errors}


def run(stack: str, worker: List[str], n: int, iters: int, timeout: float,
        cluster=None, kill: bool = False) -> Optional[dict]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FERROVOD_RANK", "OMPI_", "PMI"))}
    base = stack.removesuffix(" before")
    if base in ("fv engine", "fv star"):
        env["FERROVOD_FAST_PATH_BYTES"] = "0"
    if base == "fv star":
        env["FERROVOD_CONTROL_FANOUT"] = "0"
    start = time.perf_counter()
    try:
        kill = kill and stack != "Open MPI"
        p = subprocess.run(command(stack, worker, n, iters, cluster, kill), env=env,
                           capture_output=True,
                           text=True, timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        print(f"  {stack} -np {n}: no result in {timeout:.0f} s", file=sys.stderr)
        return {"timed_out": True}
    wall = time.perf_counter() - start
    for line in p.stdout.splitlines():
        at = line.find(TAG)
        if at >= 0:
            out = json.loads(line[at + len(TAG):])
            out["wall_s"] = wall
            if kill:
                out.update(kill_result(p.stdout))
            return out
    print(f"  {stack} -np {n}: exit {p.returncode}\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}",
          file=sys.stderr)
    return {"failed": p.returncode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", default="64,128,256", help="comma-separated numbers of ranks")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--stacks", default=",".join(STACKS),
                   help="comma-separated: " + ", ".join(STACKS))
    p.add_argument("--ops", type=int, default=6400,
                   help="ops per timed loop at 1 rank; at N ranks ops/N (at least 10)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    p.add_argument("--hosts", type=int, default=0,
                   help="spread the ranks over this many network-namespace hosts")
    p.add_argument("--kill", action="store_true",
                   help="end each ferrovod job by killing its last rank; time the others' errors")
    p.add_argument("--before", help="another build of examples/scale_worker: each ferrovod "
                   "stack also runs with it, as 'X before'")
    args = p.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    with contextlib.ExitStack() as stack_:
        tmp = stack_.enter_context(tempfile.TemporaryDirectory())
        workers = build(tmp)
        cluster = None
        if args.hosts:
            sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
            from netns import Cluster, missing_tools

            why = missing_tools()
            if why:
                sys.exit(f"scale_many: --hosts {why}")
            names = ["h0"] + [f"h{i}" for i in range(1, args.hosts + 1)]
            (Path(tmp) / "cluster").mkdir()
            cluster = stack_.enter_context(Cluster(names, Path(tmp) / "cluster"))
        stacks = [s for s in args.stacks.split(",") if s in workers]
        if args.before:
            stacks = [x for s in stacks
                      for x in ([s, f"{s} before"] if s in STACKS[:3] else [s])]
            for s in STACKS[:3]:
                workers[f"{s} before"] = [os.path.abspath(args.before)]
        got: Dict[tuple, List[dict]] = {}
        for rnd in range(args.rounds):
            for n in ranks:
                order = stacks if rnd % 2 == 0 else stacks[::-1]
                for stack in order:
                    r = run(stack, workers[stack], n, max(10, args.ops // n), args.timeout,
                            cluster, args.kill)
                    got.setdefault((stack, n), []).append(r)
                    if "us_4B" in r:
                        print(f"  round {rnd + 1}: {stack:9s} -np {n:4d}: 4 B {r['us_4B']:9.1f} "
                              f"us, 64 KiB {r['us_64KiB']:9.1f} us, init {r['init_s']:.2f} s, "
                              f"job {r['wall_s']:.1f} s"
                              + (f", kill seen by {r['kill_seen']} in {r['kill_s']:.3f} s "
                                 f"{r['kill_errors']}" if "kill_s" in r else ""),
                              file=sys.stderr, flush=True)
    print(f"\nnproc {os.cpu_count()}; us per allreduce (best round); init: the slowest "
          "rank's start-up, job: the launcher's whole run (medians); frames, bytes: control "
          "frames a rank sent and received per op, and their bytes (rank 0 / the most of any "
          "other)\n")
    head = ["ranks", "stack", "4 B us", "64 KiB us", "init s", "job s", "frames 4 B",
            "bytes 4 B", "fds (rank 0)", "threads", "RSS MiB"] + (["kill s"] if args.kill else [])
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n in ranks:
        for stack in stacks:
            runs = [r for r in got.get((stack, n), []) if "us_4B" in r]
            if not runs:
                bad = got.get((stack, n), [{}])
                why = "timed out" if any(r.get("timed_out") for r in bad) else "failed"
                print(f"| {n} | {stack} | {why} (limit {args.timeout:.0f} s) |"
                      + " |" * (len(head) - 3))
                continue
            best = lambda k: min(r[k] for r in runs)  # noqa: E731
            med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
            frames = (f"{med('frames_4B_rank0'):.1f} / {med('frames_4B_others'):.1f}"
                      if "frames_4B_rank0" in runs[0] else "-")
            nbytes = (f"{med('bytes_4B_rank0'):.0f} / {med('bytes_4B_others'):.0f}"
                      if "bytes_4B_rank0" in runs[0] else "-")
            print(f"| {n} | {stack} | {best('us_4B'):.1f} | {best('us_64KiB'):.1f} | "
                  f"{med('init_s'):.2f} | {med('wall_s'):.1f} | {frames} | {nbytes} | "
                  f"{med('fds'):.0f} ({med('fds_rank0'):.0f}) | {med('threads'):.0f} | "
                  f"{med('rss_kib') / 1024:.1f} |"
                  + (f" {med('kill_s'):.3f} |" if args.kill and all("kill_s" in r for r in runs)
                     else (" - |" if args.kill else "")))


if __name__ == "__main__":
    main()
