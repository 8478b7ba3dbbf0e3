"""Training throughput of ferrovod's ``DistributedOptimizer`` beside torch's
``DistributedDataParallel``, on gloo and on ferrovod's torch.distributed backend, in one run, on
the same model and data.

Run under the launcher, e.g.::

    ferrovodrun -np 2 python benchmarks/torch_ddp_compare.py
    ferrovodrun -np 2 python benchmarks/torch_ddp_compare.py --model cnn --rounds 6
    # Horovod's synthetic ResNet benchmark's model and inputs (needs torchvision)
    ferrovodrun -np 2 python benchmarks/torch_ddp_compare.py --model resnet18 --batch-size 8 --steps 3
    # many small tensors (202): buckets against one allreduce per gradient
    ferrovodrun -np 2 python benchmarks/torch_ddp_compare.py --depth 100 --width 128
    ferrovodrun -np 2 python benchmarks/torch_ddp_compare.py --depth 100 --width 128 --fv-bucket-mb 0
    # one rank on each of two hosts; gloo told the interface, as its users tell it
    ferrovodrun -np 2 -H h1:1,h2:1 --network-interfaces eth0 -x GLOO_SOCKET_IFNAME=eth0 \
        python benchmarks/torch_ddp_compare.py --rounds 4

Both paths train their own copy of the same model (same initial weights, same per-rank
synthetic batches, SGD with momentum): ferrovod averages gradients with
``ferrovod.torch.DistributedOptimizer`` (each gradient's allreduce is submitted from a
post-accumulate-grad hook during backward), torch with ``DistributedDataParallel`` over a gloo
process group that meets at a ``TCPStore`` rank 0 opens (its address shared with
``broadcast_object``; across hosts give gloo its interface, ``-x GLOO_SOCKET_IFNAME=eth0``).
A "ddp-fv" row trains DDP as torch users write it over a group of the backend ``"ferrovod"``
(``dist.new_group(backend="ferrovod")`` beside the gloo default group, running on the job
ferrovod already formed): the same DDP, buckets and all, with only the backend changed. The
paths are timed in alternating rounds, the order flipping each round, after an untimed warm-up
round of each, so that drift of the machine (2-4x between runs on
these VMs) hits both alike; each round is bracketed by the same gloo barrier. The table shows
the median over rounds of the global samples/s and the ratio ferrovod / DDP (> 1: ferrovod is
faster), plus the throughput of one process training alone (the other ranks idle in a
barrier) for the scaling efficiency: samples/s on n ranks / (n x single-process samples/s).
The single process trains in every round too, so each round's efficiency compares runs made
under the same machine load; the efficiency column is the median of those.

After the warm-up the parameters of each path are gathered and compared across ranks: they
must be bitwise identical, or the benchmark stops (a wrong result cannot look fast).

The default model is an MLP of three 1024-wide hidden layers: 3.16 M parameters, 12.6 MB of
gradients, the model of the speed issue's efficiency target.

A "sharded" row trains a third copy with ``DistributedOptimizer(sharded=True)``: each rank
reduces its shard of the gradients and updates its shard of the parameters (its parameters
must equal the ferrovod row's after the warm-up: on two ranks bit for bit). With the ranks on
one host they share memory (one copy of the parameters, each shard summed straight from the
other ranks' gradient buffers); ``FERROVOD_SHM_DISABLE=1`` shows the reduce-scatter and
allgather rings instead. Its "wait" phase is the reduction of its shard.

To say where the time goes it also prints: a "no-comm" row (both ranks train at once with no
communication: what sharing the machine costs before any gradient is averaged); a
"sync-only" row (no gradients exchanged, but the ranks meet once per step before the update
in a 4-byte allreduce: a synchronous job whose communication is free, so the ceiling of the
scaling efficiency for any synchronous trainer that updates every parameter on every rank,
since the faster rank waits for the slower one and both then update at once on one memory
bus; the sharded update, half of it per rank, can pass it); the time to average the
gradients alone (ferrovod per tensor as DistributedOptimizer submits them,
ferrovod and gloo on one flat tensor); each step split into forward, backward, waiting in
``step()`` for allreduces still in flight, and the update, per rank; and, on Linux, the CPU
time per step of each rank's training thread and of all its other threads (communication:
ferrovod's engine thread, gloo's threads), from ``/proc/self/task/*/schedstat``. Add
``FERROVOD_TIMELINE=path`` for rank 0's Chrome-trace timeline of every allreduce, and try
``FERROVOD_FUSION_THRESHOLD`` / ``FERROVOD_CYCLE_TIME`` / ``FERROVOD_OVERLAP`` (they are echoed
in the header, with whether ferrovod submits gradients during backward or at ``step()``).

Each rank uses one intra-op thread (``torch.set_num_threads(1)``) unless ``--threads`` says
otherwise. This is a benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ferrovod.torch as hvd


def build_model(kind: str, width: int, depth: int) -> Tuple[nn.Module, Tuple[int, ...]]:
    """The model and the shape of one input sample."""
    if kind == "mlp":
        layers: List[nn.Module] = []
        d_in = width
        for _ in range(depth):
            layers += [nn.Linear(d_in, width), nn.ReLU()]
            d_in = width
        layers.append(nn.Linear(d_in, 10))
        return nn.Sequential(*layers), (width,)
    if kind == "cnn":
        c = max(8, width // 64)
        model = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * c * 8 * 8, 512), nn.ReLU(),
            nn.Linear(512, 10),
        )
        return model, (3, 32, 32)
    if kind == "resnet18":
        # The model of Horovod's examples/pytorch/pytorch_synthetic_benchmark.py (ResNet-50 there;
        # 18 fits a 2-core machine), at its 224 x 224 inputs.
        try:
            from torchvision import models
        except ImportError:
            raise SystemExit("--model resnet18 needs torchvision: pip install torchvision") from None
        return models.resnet18(num_classes=1000), (3, 224, 224)
    raise SystemExit(f"unknown --model {kind!r} (mlp, cnn or resnet18)")


def init_gloo(rank: int, size: int) -> None:
    """torch.distributed over gloo, meeting at a TCPStore that rank 0 opens on a port of its
    own choosing (it holds the port from the start) at its host's name, which rank 0 sends the
    others: loopback when every rank is on one host, else the name the other hosts reach it by
    (gloo then connects on the interface GLOO_SOCKET_IFNAME names, as its users set it)."""
    store = None
    if rank == 0:
        host = "127.0.0.1" if hvd.local_size() == hvd.size() else socket.gethostname()
        store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False)
    host, port = hvd.broadcast_object((host, store.port) if store else None, root_rank=0,
                                      name="ddp_compare.store")
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)


def make_batches(shape: Tuple[int, ...], batch: int, count: int,
                 rank: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Fixed synthetic batches, different on each rank (as a DistributedSampler gives)."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn((batch,) + shape, generator=g),
             torch.randint(0, 10, (batch,), generator=g)) for _ in range(count)]


class Trainer:
    """One training path: ``step(i)`` runs forward, backward and the optimizer on batch i."""

    def __init__(self, name: str, model: nn.Module, opt: torch.optim.Optimizer,
                 batches: List[Tuple[torch.Tensor, torch.Tensor]],
                 meet: Callable[[], None] | None = None) -> None:
        self.name = name
        self.model = model
        self.opt = opt
        self.batches = batches
        #: Called between backward and the update: where the ranks of a synchronous job wait
        #: for each other (the sync-only path; the others synchronize in their optimizer).
        self.meet = meet

    def step(self, i: int) -> None:
        x, y = self.batches[i % len(self.batches)]
        self.opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        if self.meet is not None:
            self.meet()
        self.opt.step()

    def timed_step(self, i: int) -> Tuple[float, float, float, float]:
        """One step split into forward, backward, waiting for the gradients still in flight
        (ferrovod only: DDP waits inside backward) and the optimizer update, in seconds."""
        x, y = self.batches[i % len(self.batches)]
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if getattr(self.opt, "sharded", False):
            # Its own wait: the reduce-scatter that step() would run (synchronize() would
            # reduce the whole gradients, for clipping).
            self.opt._reduce_shards()
            t3 = time.perf_counter()
            with self.opt.skip_synchronize():
                self.opt.step()
        elif hasattr(self.opt, "skip_synchronize"):
            self.opt.synchronize()
            t3 = time.perf_counter()
            with self.opt.skip_synchronize():
                self.opt.step()
        elif self.meet is not None:
            self.meet()
            t3 = time.perf_counter()
            self.opt.step()
        else:
            t3 = t2
            self.opt.step()
        return t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3

    def params(self) -> torch.Tensor:
        """All parameters, flattened (the DDP wrapper's are those of its module)."""
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])


def thread_cpu() -> Dict[int, int]:
    """Nanoseconds each thread of this process has run on a CPU (Linux; empty elsewhere)."""
    out = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
    except OSError:
        return {}
    return out


class CpuMeter:
    """CPU time of the training (main) thread and of all other threads (communication)."""

    def __init__(self) -> None:
        self.main_ns = 0
        self.other_ns = 0
        self._main = threading.get_native_id()

    def add(self, before: Dict[int, int], after: Dict[int, int]) -> None:
        for tid, ns in after.items():
            delta = ns - before.get(tid, 0)
            if tid == self._main:
                self.main_ns += delta
            else:
                self.other_ns += delta


def time_steps(trainer: Trainer, steps: int, meter: CpuMeter | None = None) -> float:
    """Seconds for ``steps`` steps, between two barriers shared by every path."""
    dist.barrier()
    before = thread_cpu() if meter else {}
    t0 = time.perf_counter()
    for i in range(steps):
        trainer.step(i)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    if meter:
        meter.add(before, thread_cpu())
    return elapsed


def time_alone(trainer: Trainer, steps: int, rank: int) -> float:
    """Seconds for ``steps`` steps of ``trainer`` on rank 0 alone (0.0 elsewhere), while the
    other ranks wait in the closing barrier."""
    dist.barrier()
    elapsed = 0.0
    if rank == 0:
        t0 = time.perf_counter()
        for i in range(steps):
            trainer.step(i)
        elapsed = time.perf_counter() - t0
    dist.barrier()
    return elapsed


def time_comm(grads: List[torch.Tensor], reps: int, fv_group: Any) -> Dict[str, float]:
    """Median seconds to average the gradients alone, with no computation beside it: ferrovod
    one allreduce per parameter (what DistributedOptimizer submits), ferrovod one flat
    allreduce, gloo and the ferrovod backend one flat allreduce each (about what DDP's buckets
    give)."""
    flat = torch.cat([g.reshape(-1) for g in grads])

    def fv_each() -> None:
        hs = [hvd.allreduce_async_(g, name=f"ddp_compare.comm.{i}") for i, g in enumerate(grads)]
        for h in hs:
            hvd.synchronize(h)

    def fv_flat() -> None:
        hvd.allreduce_(flat, name="ddp_compare.comm.flat")

    def gloo_flat() -> None:
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())

    def backend_flat() -> None:
        dist.all_reduce(flat, group=fv_group)
        flat.div_(dist.get_world_size())

    out = {}
    for name, fn in (("ferrovod per-tensor", fv_each), ("ferrovod flat", fv_flat),
                     ("gloo flat", gloo_flat), ("backend ferrovod flat", backend_flat)):
        fn()
        ts = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts)
    return out


def check_identical(trainer: Trainer, rank: int, size: int) -> None:
    """Stops the run unless the trainer's parameters are bitwise equal on every rank."""
    mine = trainer.params()
    every = hvd.allgather(mine.unsqueeze(0), name=f"ddp_compare.check.{trainer.name}")
    bad = [r for r in range(size) if not torch.equal(every[r], every[0])]
    if bad:
        diff = max(float((every[r] - every[0]).abs().max()) for r in bad)
        if rank == 0:
            print(f"ERROR: {trainer.name}: parameters on ranks {bad} differ from rank 0's "
                  f"(max abs difference {diff:.3g})", file=sys.stderr, flush=True)
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", choices=("mlp", "cnn", "resnet18"))
    ap.add_argument("--width", type=int, default=1024,
                    help="MLP hidden width (cnn: 64 x its first layer's channels)")
    ap.add_argument("--depth", type=int, default=3,
                    help="MLP hidden layers (3: 3.16 M parameters, 12.6 MB of gradients)")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds of each path")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    ap.add_argument("--fv-bucket-mb", type=float, default=4.0,
                    help="ferrovod DistributedOptimizer bucket_cap_mb (0: one allreduce per "
                         "gradient, Horovod's way)")
    ap.add_argument("--breakdown-steps", type=int, default=10,
                    help="steps of each path timed phase by phase")
    ap.add_argument("--skip-single", action="store_true",
                    help="do not time the single-process baseline")
    args = ap.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.set_num_threads(args.threads)
    init_gloo(rank, size)
    # torch.distributed's backend "ferrovod" (registered by importing ferrovod.torch) over
    # every rank: the job ferrovod formed above.
    fv_group = dist.new_group(backend="ferrovod")

    torch.manual_seed(0)
    base, shape = build_model(args.model, args.width, args.depth)
    nparams = sum(p.numel() for p in base.parameters())
    batches = make_batches(shape, args.batch_size, 4, rank)
    lr, momentum = 0.01, 0.9

    fv_model = copy.deepcopy(base)
    fv_opt = hvd.DistributedOptimizer(torch.optim.SGD(fv_model.parameters(), lr=lr,
                                                      momentum=momentum),
                                      named_parameters=fv_model.named_parameters(),
                                      bucket_cap_mb=args.fv_bucket_mb)
    hvd.broadcast_parameters(fv_model.state_dict(), root_rank=0)
    fv = Trainer("ferrovod", fv_model, fv_opt, batches)

    # The same, with each rank updating only its shard (DistributedOptimizer(sharded=True)).
    sh_model = copy.deepcopy(base)
    sh_opt = hvd.DistributedOptimizer(torch.optim.SGD(sh_model.parameters(), lr=lr,
                                                      momentum=momentum),
                                      named_parameters=sh_model.named_parameters(),
                                      sharded=True)
    sharded = Trainer("sharded", sh_model, sh_opt, batches)

    ddp_model = nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                    bucket_cap_mb=args.bucket_mb)
    ddp = Trainer("ddp", ddp_model,
                  torch.optim.SGD(ddp_model.parameters(), lr=lr, momentum=momentum), batches)

    ddp_fv_model = nn.parallel.DistributedDataParallel(copy.deepcopy(base), process_group=fv_group,
                                                       bucket_cap_mb=args.bucket_mb)
    ddp_fv = Trainer("ddp-fv", ddp_fv_model,
                     torch.optim.SGD(ddp_fv_model.parameters(), lr=lr, momentum=momentum),
                     batches)

    # Both ranks training with no communication at all: the compute cost of sharing the
    # machine, so that what remains of a distributed step is communication.
    local_model = copy.deepcopy(base)
    local = Trainer("no-comm", local_model,
                    torch.optim.SGD(local_model.parameters(), lr=lr, momentum=momentum), batches)

    # Both ranks train with no gradient exchange but meet once per step, between backward and
    # the update, in a 4-byte allreduce (ferrovod's shared-memory fast path, 1-3 us): a
    # synchronous data-parallel job whose communication costs nothing. What it loses against
    # no-comm is the price of running in lockstep (the faster rank waits; both update at once,
    # on one memory bus): the ceiling for any synchronous trainer on this machine.
    token = torch.zeros(1)
    sync_model = copy.deepcopy(base)
    sync_only = Trainer("sync-only", sync_model,
                        torch.optim.SGD(sync_model.parameters(), lr=lr, momentum=momentum),
                        batches, meet=lambda: hvd.allreduce_(token, name="ddp_compare.meet"))

    single_model = copy.deepcopy(base)
    single = Trainer("single", single_model,
                     torch.optim.SGD(single_model.parameters(), lr=lr, momentum=momentum),
                     batches)

    if rank == 0:
        print(f"ferrovod vs DDP(gloo): {size} ranks, model {args.model} ({nparams / 1e6:.2f} M "
              f"params, {nparams * 4 / 2**20:.1f} MiB of gradients), batch {args.batch_size}/rank, "
              f"{args.steps} steps x {args.rounds} rounds, {args.threads} thread(s)/rank, "
              f"buckets: ferrovod {args.fv_bucket_mb:g} MiB, DDP {args.bucket_mb:g} MiB, "
              f"ferrovod submits {'during backward' if fv_opt.overlap else 'at step()'}, "
              f"torch {torch.__version__}", flush=True)
        for var in ("FERROVOD_FUSION_THRESHOLD", "FERROVOD_CYCLE_TIME", "FERROVOD_SPIN_US",
                    "FERROVOD_OVERLAP", "FERROVOD_TIMELINE"):
            if var in os.environ:
                print(f"  {var}={os.environ[var]}", flush=True)

    # Warm-up: allocator, autograd graph, DDP buckets, ferrovod's response cache.
    time_steps(fv, max(3, args.steps // 4))
    time_steps(sharded, max(3, args.steps // 4))
    time_steps(ddp, max(3, args.steps // 4))
    time_steps(ddp_fv, max(3, args.steps // 4))
    check_identical(fv, rank, size)
    check_identical(ddp_fv, rank, size)
    check_identical(sharded, rank, size)
    check_identical(ddp, rank, size)
    drift = float((fv.params() - ddp.params()).abs().max())
    drift_sharded = float((fv.params() - sharded.params()).abs().max())
    drift_backend = float((ddp_fv.params() - ddp.params()).abs().max())
    if rank == 0:
        print(f"parameters identical across ranks for every path after warm-up; "
              f"max |ferrovod - DDP| = {drift:.3g}, max |ferrovod - sharded| = "
              f"{drift_sharded:.3g}, max |ddp-fv - DDP| = {drift_backend:.3g}", flush=True)

    time_steps(local, max(3, args.steps // 4))
    time_steps(sync_only, max(3, args.steps // 4))
    paths = (fv, sharded, ddp, ddp_fv, sync_only, local)
    times: Dict[str, List[float]] = {t.name: [] for t in paths}
    meters = {k: CpuMeter() for k in times}
    # Rank 0 trains alone (the others wait in the closing barrier, so it has a core to itself
    # as a 1-rank job would), in every round: each round's efficiency is then a paired figure.
    single_times: List[float] = []
    if not args.skip_single:
        time_alone(single, max(3, args.steps // 4), rank)
    for r in range(args.rounds):
        order = paths if r % 2 == 0 else paths[::-1]
        if not args.skip_single and r % 2 == 0:
            single_times.append(time_alone(single, args.steps, rank))
        for t in order:
            times[t.name].append(time_steps(t, args.steps, meters[t.name]))
        if not args.skip_single and r % 2 == 1:
            single_times.append(time_alone(single, args.steps, rank))
        if rank == 0:
            print(f"  round {r}: " + ", ".join(
                f"{k} {1e3 * v[-1] / args.steps:.1f} ms/step" for k, v in times.items())
                + (f", 1 process {1e3 * single_times[-1] / args.steps:.1f} ms/step"
                   if single_times else ""), flush=True)

    # Where a step's time goes, per rank (medians over the steps).
    phases: Dict[str, List[float]] = {}
    for t in paths:
        dist.barrier()
        rows = [t.timed_step(i) for i in range(args.breakdown_steps)]
        phases[t.name] = [statistics.median(c) for c in zip(*rows)]
    every_phases = hvd.allgather_object(phases, name="ddp_compare.phases")
    nsteps = args.rounds * args.steps
    every_cpu = hvd.allgather_object(
        {k: (m.main_ns / nsteps / 1e6, m.other_ns / nsteps / 1e6,
             1e3 * sum(times[k]) / nsteps) for k, m in meters.items()},
        name="ddp_compare.cpu")

    comm = time_comm([p.grad.detach().clone() for p in fv_model.parameters()], 10, fv_group)

    if rank == 0:
        print("\ngradient averaging alone (" + f"{nparams * 4 / 2**20:.1f} MiB): " + ", ".join(
            f"{k} {1e3 * v:.1f} ms" for k, v in comm.items()))
        global_batch = args.batch_size * size
        rate = {k: args.steps * global_batch / statistics.median(v) for k, v in times.items()}
        best = {k: args.steps * global_batch / min(v) for k, v in times.items()}
        print()
        print(f"{'path':<10} {'ms/step':>9} {'samples/s':>11} {'best':>11} {'efficiency':>11}")
        for k in times:
            # Per round: (n x b / t_path) / (n x b / t_alone) = t_alone / t_path.
            eff = (f"{100 * statistics.median(a / t for a, t in zip(single_times, times[k])):.0f} %"
                   if single_times else "-")
            print(f"{k:<10} {1e3 * statistics.median(times[k]) / args.steps:>9.1f} "
                  f"{rate[k]:>11.0f} {best[k]:>11.0f} {eff:>11}")
        if single_times:
            alone = statistics.median(single_times)
            print(f"{'1 process':<10} {1e3 * alone / args.steps:>9.1f} "
                  f"{args.steps * args.batch_size / alone:>11.0f} "
                  f"{args.steps * args.batch_size / min(single_times):>11.0f} {'100 %':>11}")
        print(f"\nper-step phases, median ms over {args.breakdown_steps} steps "
              "(wait: ferrovod's synchronize() in step(), sync-only's meeting; DDP waits "
              "inside backward)")
        print(f"{'path':<10} {'rank':>4} {'forward':>8} {'backward':>9} {'wait':>7} {'update':>7}")
        for k in times:
            for r, ph in enumerate(every_phases):
                print(f"{k:<10} {r:>4} " + " ".join(
                    f"{1e3 * v:>{w}.1f}" for v, w in zip(ph[k], (8, 9, 7, 7))))
        if every_cpu[0]["ferrovod"][0] > 0:
            print("\nCPU per step over the timed rounds, ms (main: the training thread; "
                  "other: every other thread of the rank, i.e. communication)")
            print(f"{'path':<10} {'rank':>4} {'wall':>7} {'main':>7} {'other':>7}")
            for k in times:
                for r, c in enumerate(every_cpu):
                    main_ms, other_ms, wall_ms = c[k]
                    print(f"{k:<10} {r:>4} {wall_ms:>7.1f} {main_ms:>7.1f} {other_ms:>7.1f}")
        # Each round times both paths back to back, so its ratio is a paired comparison
        # under the same machine load; their median is the headline figure.
        print()
        for k in ("ferrovod", "sharded", "ddp-fv"):
            ratios = [d / f for f, d in zip(times[k], times["ddp"])]
            print(f"ratio {k} / DDP (samples/s): median over rounds "
                  f"{statistics.median(ratios):.3f}, of median rates "
                  f"{rate[k] / rate['ddp']:.3f}; {k} faster in "
                  f"{sum(x > 1 for x in ratios)} of {len(ratios)} rounds "
                  f"(per round: {', '.join(f'{x:.2f}' for x in ratios)})", flush=True)

    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
