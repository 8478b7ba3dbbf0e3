"""``dist.all_reduce`` through torch.distributed's backend ``"ferrovod"`` beside gloo (a gloo
group over the same ranks, in the same processes) and ferrovod's own ``allreduce_``, at 4 B,
1 MiB and 64 MiB of float32, and a "nothing" column: ``dist.all_reduce`` on a backend written
in Python that does nothing, what torch's own layers cost any Python backend's op, in alternating rounds (these VMs have short slow windows: compare
within a round). Prints microseconds per op, the best and the median of the rounds, and the
ratios the torch.distributed issue sets targets for.

Run under torchrun, as torch users start a job::

    torchrun --standalone --nproc-per-node 2 benchmarks/torch_backend_allreduce.py [--rounds 4]

This is a benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend


class _NothingWork(dist.Work):
    def wait(self, timeout=None) -> bool:  # noqa: ANN001 - torch's signature
        return True


class _Nothing(_C10dBackend):
    """A backend written in Python, as ferrovod's is, whose allreduce does nothing: what
    torch's own layers cost a call (its floor for any Python backend)."""

    def __init__(self, store, rank: int, size: int, timeout) -> None:  # noqa: ANN001
        super().__init__(rank, size)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "nothing"

    def allreduce(self, tensors, opts=None) -> dist.Work:  # noqa: ANN001
        return _NothingWork()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of every path")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ferrovod")
    gloo = dist.new_group(backend="gloo")
    dist.Backend.register_backend("nothing", _Nothing, devices=["cpu"])
    nothing = dist.new_group(backend="nothing")
    import ferrovod.torch as fv

    times: Dict[Tuple[int, str], List[float]] = {}
    for elems, reps in ((1, 2000), (1 << 18, 100), (1 << 24, 5)):
        t = torch.ones(elems)
        paths: List[Tuple[str, Callable[[], object]]] = [
            ("backend", lambda: dist.all_reduce(t)),
            ("gloo", lambda: dist.all_reduce(t, group=gloo)),
            ("allreduce_", lambda: fv.allreduce_(t, op=fv.Sum, name=f"bench.{t.numel()}")),
            ("nothing", lambda: dist.all_reduce(t, group=nothing)),
        ]
        for rnd in range(args.rounds):
            for name, fn in (paths if rnd % 2 == 0 else paths[::-1]):
                fn()
                dist.barrier(group=gloo)
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                times.setdefault((elems * 4, name), []).append(
                    (time.perf_counter() - t0) / reps * 1e6)
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, {args.rounds} rounds, torch {torch.__version__}")
        print(f"{'bytes':>10} {'backend us':>11} {'gloo us':>9} {'allreduce_ us':>14} "
              f"{'nothing us':>11} {'gloo/backend':>13} {'backend/allreduce_':>19}")
        paths = ("backend", "gloo", "allreduce_", "nothing")
        for size in sorted({s for s, _ in times}):
            best = {n: min(times[(size, n)]) for n in paths}
            med = {n: statistics.median(times[(size, n)]) for n in paths}
            print(f"{size:>10} {best['backend']:>11.1f} {best['gloo']:>9.1f} "
                  f"{best['allreduce_']:>14.1f} {best['nothing']:>11.1f} "
                  f"{med['gloo'] / med['backend']:>13.2f} "
                  f"{med['backend'] / med['allreduce_']:>19.2f}")
        print("(us: best of the rounds; ratios: of the medians)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
