"""Point-to-point messages through torch.distributed's backend ``"ferrovod"`` beside gloo (a
gloo group over the same ranks, in the same processes): a ping-pong between ranks 0 and 1
(``dist.send`` then ``dist.recv`` on rank 0, the reverse on rank 1) at 4 B, 64 KiB, 1 MiB and
64 MiB of float32, in alternating rounds (these VMs have short slow windows: compare within a
round). Prints microseconds per one-way message (half a round trip), the best and the median of
the rounds, the bandwidth the median gives, and gloo's time over ferrovod's.

Run under torchrun, as torch users start a job::

    torchrun --standalone --nproc-per-node 2 benchmarks/torch_backend_p2p.py [--rounds 4]

Ranks beyond 1 only take part in the set-up. This is a benchmark, not a test: it prints numbers.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

import ferrovod.torch  # noqa: F401 - registers the backend

SIZES = ((1, 2000), (1 << 14, 500), (1 << 18, 100), (1 << 24, 4))


def ping_pong(t: torch.Tensor, reps: int, group: object) -> float:
    """Seconds per one-way message over ``reps`` round trips (rank 0's clock)."""
    r = dist.get_rank()
    dist.barrier()
    begun = time.perf_counter()
    for _ in range(reps):
        if r == 0:
            dist.send(t, 1, group=group)
            dist.recv(t, 1, group=group)
        elif r == 1:
            dist.recv(t, 0, group=group)
            dist.send(t, 0, group=group)
    return (time.perf_counter() - begun) / (2 * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds of both backends")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("ferrovod")
    gloo = dist.new_group(backend="gloo")
    ours = dist.group.WORLD
    times: Dict[Tuple[int, str], List[float]] = {}
    for elems, reps in SIZES:
        t = torch.ones(elems)
        # One untimed trip each first: connections are made on first use.
        ping_pong(t, 1, ours)
        ping_pong(t, 1, gloo)
        for rnd in range(args.rounds):
            order = [("ferrovod", ours), ("gloo", gloo)]
            if rnd % 2:
                order.reverse()
            for label, group in order:
                times.setdefault((elems, label), []).append(ping_pong(t, reps, group))
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        print(f"\n{n} ranks (0 and 1 exchange), {args.rounds} alternating rounds; "
              "microseconds per one-way message: best / median; bandwidth at the median\n")
        print("| bytes | ferrovod | gloo | gloo / ferrovod (medians) | ferrovod MB/s | gloo MB/s |")
        print("|---|---|---|---|---|---|")
        for elems, _ in SIZES:
            f, g = times[(elems, "ferrovod")], times[(elems, "gloo")]
            fm, gm = statistics.median(f), statistics.median(g)
            nbytes = 4 * elems
            print(f"| {nbytes} | {min(f) * 1e6:.1f} / {fm * 1e6:.1f} | "
                  f"{min(g) * 1e6:.1f} / {gm * 1e6:.1f} | {gm / fm:.2f} | "
                  f"{nbytes / fm / 1e6:.0f} | {nbytes / gm / 1e6:.0f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
