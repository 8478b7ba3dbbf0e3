"""Training across two simulated hosts: ferrovod's ``DistributedOptimizer`` beside DDP on gloo.

Run as root from the repository root (it builds network namespaces)::

    .venv/bin/python benchmarks/multihost_train.py --rate 10gbit --rounds 4
    .venv/bin/python benchmarks/multihost_train.py --rate 1gbit --model resnet18
    .venv/bin/python benchmarks/multihost_train.py --rate none --ranks-per-host 2

What it does:

1. Builds two hosts, ``h1`` and ``h2``, with ``tests/python/netns.py`` (network namespaces with
   sshd, joined by veth links into a bridge) and, unless ``--rate none``, limits what each host
   sends on ``eth0`` to ``--rate`` with ``tc ... tbf``, as ``benchmarks/multihost_link.py`` does
   (the same burst and queue).
2. Starts ``benchmarks/torch_ddp_compare.py`` once with ``ferrovodrun -H h1:k,h2:k`` from
   ``h1``: in one job, in alternating rounds, ferrovod's ``DistributedOptimizer``, DDP over gloo
   and DDP over ferrovod's torch.distributed backend train copies of the same model on the same
   batches. Gloo is told the hosts' interface (``GLOO_SOCKET_IFNAME=eth0``), as its users tell
   it on such hosts, and ferrovod is told it with ``--network-interfaces eth0``.
3. Prints that benchmark's header and table as rank 0 prints them: samples per second of each
   path (medians over rounds) and each one's ratio to DDP on gloo (> 1: faster than DDP).

The default model is Horovod's synthetic benchmark's: ResNet-18 on 224x224 inputs, 8 samples per
rank and step (needs torchvision in the venv). The namespaces and everything in them are removed
at the end, also on error or Ctrl-C. Exit status: 0 done, 1 the job failed, 2 cannot run here
(not root, a tool or torchvision missing), 130 Ctrl-C. This is a benchmark, not a test: it prints
numbers.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Optional

import multihost_link as link
from multihost_link import HOSTS, PY, REPO, Cluster, clean_env, missing_tools

COMPARE = str(REPO / "benchmarks" / "torch_ddp_compare.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="10gbit",
                        help="link rate in tc's syntax, or 'none' for the bare veth (10gbit)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks on each host (1)")
    parser.add_argument("--model", default="resnet18", choices=("mlp", "cnn", "resnet18"))
    parser.add_argument("--batch-size", type=int, default=8, help="samples per rank and step (8)")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed round (3)")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds of each path (4)")
    parser.add_argument("--job-timeout", type=float, default=3600,
                        help="seconds the job may take (default: 3600)")
    args = parser.parse_args()
    rate_bits: Optional[int] = None
    if args.rate != "none":
        try:
            rate_bits = link.parse_rate(args.rate)
        except ValueError as exc:
            parser.error(str(exc))
    if args.ranks_per_host < 1:
        parser.error("--ranks-per-host: at least 1")

    why = missing_tools() or (None if shutil.which("tc") else "needs tc (iproute2)")
    if why is None and args.model == "resnet18" and importlib.util.find_spec("torchvision") is None:
        why = "--model resnet18 needs torchvision in this venv (pip install torchvision)"
    if why:
        print(f"multihost_train: cannot run here: {why}", file=sys.stderr)
        return 2

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, link._terminate)
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="fv-train-"))
    cluster: Optional[Cluster] = None
    try:
        cluster = link.start_hosts(workdir, "multihost_train")
        if cluster is None:
            return 1
        if rate_bits is None:
            print(f"# hosts {', '.join(f'{h.name} {h.ip}' for h in cluster.hosts.values())}; "
                  "links not shaped (veth)")
        else:
            burst, latency = link.tbf_params(rate_bits)
            print(f"# hosts {', '.join(f'{h.name} {h.ip}' for h in cluster.hosts.values())}; "
                  f"tbf rate {rate_bits}bit burst {burst} latency {latency} on each host's eth0")
            try:
                cluster.shape(f"{rate_bits}bit", burst, latency)
            except RuntimeError as exc:
                print(f"multihost_train: cannot shape the link: {exc}", file=sys.stderr)
                return 2
        k = args.ranks_per_host
        hosts = ",".join(f"{h}:{k}" for h in HOSTS)
        bench = [PY, COMPARE, "--model", args.model, "--batch-size", str(args.batch_size),
                 "--steps", str(args.steps), "--rounds", str(args.rounds),
                 "--breakdown-steps", "1"]  # fmt: skip
        argv = [PY, "-m", "ferrovod.runner.launch", "-np", str(k * len(HOSTS)), "-H", hosts,
                "-p", "2222", "-i", str(cluster.key), "--network-interfaces", "eth0",
                "-x", "GLOO_SOCKET_IFNAME=eth0", *bench]  # fmt: skip
        print(f"# job: ferrovodrun -np {k * len(HOSTS)} -H {hosts} --network-interfaces eth0 "
              f"-x GLOO_SOCKET_IFNAME=eth0 {' '.join(bench[1:])}", flush=True)
        return run(cluster, argv, args.job_timeout, started)
    except KeyboardInterrupt:
        print("\nmultihost_train: interrupted; removing the hosts", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if cluster is not None:
            cluster.close()
        shutil.rmtree(workdir, ignore_errors=True)


def run(cluster: Cluster, argv: List[str], timeout: float, started: float) -> int:
    """Runs the job from h1, printing rank 0's lines as they come; its exit status as ours."""
    proc = cluster.popen(HOSTS[0], argv, env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=str(REPO))
    # A hung job must not hold the namespaces forever.
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    output: List[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            output.append(line)
            if link.RANK0.match(line):
                print(line.split(":", 1)[1], flush=True)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if code in (130, -signal.SIGINT):
        raise KeyboardInterrupt
    print(f"# job took {time.monotonic() - started:.1f} s with the set-up, exit {code}")
    if code != 0:
        print("multihost_train: the job failed; its last output:", file=sys.stderr)
        for line in output[-40:]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
