"""FSDP2 (``fully_shard``) step time on torch.distributed's backend ``"ferrovod"`` beside gloo,
on the CPU, in one run: two copies of the same model, one sharded over a device mesh of each
backend's group over the same ranks, trained on the same batches in alternating rounds (the
order flipping each round, after an untimed warm-up of each), so that the VM's slow windows
hit both alike.

Run under torchrun, as FSDP2 users start a job::

    torchrun --standalone --nproc-per-node 2 benchmarks/torch_fsdp2_compare.py [--rounds 6]

The default model is the torch.distributed issue's: an MLP of 4 linear layers 3584 wide (51.4 M
parameters, 196 MiB of float32), each layer and the whole model ``fully_shard``-ed (parameters
all-gathered before each layer's forward and again for its backward, gradients
reduce-scattered after it), AdamW. Each rank uses one intra-op thread.

After the warm-up both copies' full parameters are compared: the two backends reduce in their
own orders, so they may differ in the last bits, not more (the benchmark stops otherwise: a
wrong result cannot look fast). Besides the step times it times the two collectives FSDP2 runs
per layer, alone, on each backend: ``all_gather_into_tensor`` of a layer's shard and
``reduce_scatter_tensor`` of a layer's gradient, so the table says how much of a step is
communication.

This is a benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard


def build(width: int, depth: int) -> nn.Sequential:
    """``depth`` linear layers ``width`` wide with ReLUs between them."""
    layers: List[nn.Module] = []
    for i in range(depth):
        layers.append(nn.Linear(width, width))
        if i + 1 < depth:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def sharded_copy(base: nn.Sequential, mesh: DeviceMesh) -> nn.Sequential:
    """``base``'s weights in a new model, each linear layer and the whole ``fully_shard``-ed
    over ``mesh``, as FSDP2's documentation shards a transformer's blocks."""
    model = build(base[0].in_features, sum(isinstance(m, nn.Linear) for m in base))
    model.load_state_dict(base.state_dict())
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class Trainer:
    """One copy of the model, its optimizer and the rank's batches."""

    def __init__(self, name: str, model: nn.Module, batches: List[Any]) -> None:
        self.name = name
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.batches = batches
        self.i = 0

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        nn.functional.mse_loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()

    def full(self) -> Dict[str, torch.Tensor]:
        return {k: v.full_tensor() for k, v in self.model.state_dict().items()}


def timed(run: Callable[[], None], reps: int, barrier: Callable[[], None]) -> float:
    """Seconds per call of ``run``, the ranks starting together."""
    barrier()
    start = time.perf_counter()
    for _ in range(reps):
        run()
    barrier()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--width", type=int, default=3584, help="every layer's width")
    ap.add_argument("--depth", type=int, default=4, help="linear layers")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--steps", type=int, default=3, help="steps per timed round")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds of each backend")
    ap.add_argument("--comm-reps", type=int, default=5,
                    help="repetitions of each collective timed alone, per round")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ferrovod")

    rank, size = dist.get_rank(), dist.get_world_size()
    fv_group = dist.group.WORLD
    gloo_group = dist.new_group(backend="gloo")
    meshes = {"ferrovod": DeviceMesh.from_group(fv_group, "cpu"),
              "gloo": DeviceMesh.from_group(gloo_group, "cpu")}

    torch.manual_seed(0)
    base = build(args.width, args.depth)
    nparams = sum(p.numel() for p in base.parameters())
    g = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(args.batch_size, args.width, generator=g),
                torch.randn(args.batch_size, args.width, generator=g)) for _ in range(4)]
    trainers = {name: Trainer(name, sharded_copy(base, mesh), batches)
                for name, mesh in meshes.items()}
    del base

    def barrier() -> None:
        dist.barrier(group=gloo_group)

    # One layer's collectives, as FSDP2 runs them (weight and bias in one flat buffer).
    layer = args.width * args.width + args.width
    shard = -(-layer // size)
    comm: Dict[str, Callable[[], None]] = {}
    for name, group in (("ferrovod", fv_group), ("gloo", gloo_group)):
        mine, whole = torch.ones(shard), torch.empty(shard * size)
        grad, out = torch.ones(shard * size), torch.empty(shard)
        comm[f"{name} all_gather"] = (
            lambda group=group, mine=mine, whole=whole:
            dist.all_gather_into_tensor(whole, mine, group=group))
        comm[f"{name} reduce_scatter"] = (
            lambda group=group, grad=grad, out=out:
            dist.reduce_scatter_tensor(out, grad, group=group))

    if rank == 0:
        print(f"FSDP2 on the CPU, ferrovod vs gloo: {size} ranks, MLP {args.depth} x "
              f"{args.width} ({nparams / 1e6:.1f} M params, {nparams * 4 / 2**20:.0f} MiB), "
              f"batch {args.batch_size}/rank, AdamW, {args.steps} steps x {args.rounds} rounds, "
              f"1 thread/rank, torch {torch.__version__}", flush=True)

    for t in trainers.values():
        timed(t.step, 2, barrier)
    fv_full, gloo_full = trainers["ferrovod"].full(), trainers["gloo"].full()
    drift = max(float((fv_full[k] - gloo_full[k]).abs().max()) for k in fv_full)
    scale = max(float(v.abs().max()) for v in gloo_full.values())
    del fv_full, gloo_full
    if not drift <= 1e-5 * scale:
        raise SystemExit(f"rank {rank}: the backends' models differ after the warm-up by "
                         f"{drift:.3g} (largest weight {scale:.3g})")
    if rank == 0:
        print(f"after the warm-up (2 steps each) max |ferrovod - gloo| = {drift:.3g}", flush=True)

    steps: Dict[str, List[float]] = {name: [] for name in trainers}
    comms: Dict[str, List[float]] = {name: [] for name in comm}
    for rnd in range(args.rounds):
        order = list(trainers) if rnd % 2 == 0 else list(reversed(list(trainers)))
        for name in order:
            steps[name].append(timed(trainers[name].step, args.steps, barrier))
        names = list(comm) if rnd % 2 == 0 else list(reversed(list(comm)))
        for name in names:
            comms[name].append(timed(comm[name], args.comm_reps, barrier))
        if rank == 0:
            fv, gl = steps["ferrovod"][-1], steps["gloo"][-1]
            print(f"round {rnd + 1}: step ferrovod {fv * 1e3:8.1f} ms  gloo {gl * 1e3:8.1f} ms  "
                  f"gloo / ferrovod {gl / fv:5.2f}", flush=True)

    if rank == 0:
        med = {k: statistics.median(v) for k, v in steps.items()}
        ratios = [g / f for g, f in zip(steps["gloo"], steps["ferrovod"])]
        print("\n| what | ferrovod (ms) | gloo (ms) | gloo / ferrovod, median of rounds |")
        print("|---|---|---|---|")
        print(f"| step (median) | {med['ferrovod'] * 1e3:.1f} | {med['gloo'] * 1e3:.1f} | "
              f"{statistics.median(ratios):.2f} (per round "
              f"{', '.join(f'{r:.2f}' for r in ratios)}) |")
        for what, mib in (("all_gather", shard * 4 / 2**20), ("reduce_scatter", layer * 4 / 2**20)):
            f, g_ = comms[f"ferrovod {what}"], comms[f"gloo {what}"]
            r = statistics.median(b / a for a, b in zip(f, g_))
            print(f"| one layer's {what} ({mib:.1f} MiB in) | {statistics.median(f) * 1e3:.1f} | "
                  f"{statistics.median(g_) * 1e3:.1f} | {r:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
