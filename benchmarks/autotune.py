"""Does autotuning end no worse than the defaults? One process per rank runs the same
training-like workload twice: with the default knobs, then (after shutdown and init again)
with FERROVOD_AUTOTUNE=1 until the tuner settles, and compares the steady-state step time.
Run under ``ferrovodrun -np 2``; rank 0 prints the table and the settled values."""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time

import numpy as np

import ferrovod as fv


def step(grads: list[np.ndarray]) -> None:
    """One step: every gradient's allreduce in flight at once, then wait for all."""
    handles = [fv.allreduce_async(g, name=f"grad.{i}", op=fv.Average) for i, g in enumerate(grads)]
    for h in handles:
        fv.synchronize(h)


def timed(grads: list[np.ndarray], steps: int, rounds: int) -> float:
    """Median ms per step over ``rounds`` runs of ``steps`` steps."""
    out = []
    for _ in range(rounds):
        fv.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            step(grads)
        fv.barrier()
        out.append((time.perf_counter() - t) / steps * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tensors", type=int, default=120)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tune-steps", type=int, default=160, help="steps given to the tuner")
    args = ap.parse_args()
    log = os.path.join(tempfile.mkdtemp(), "autotune.csv")

    fv.init()
    me = fv.rank()
    rng = np.random.default_rng(me)
    sizes = [int(64 * 1.08 ** i) for i in range(args.tensors)]
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    for _ in range(3):
        step(grads)
    default_ms = timed(grads, args.steps, args.rounds)
    fv.shutdown()

    os.environ.update(FERROVOD_AUTOTUNE="1", FERROVOD_AUTOTUNE_LOG=log,
                      FERROVOD_AUTOTUNE_WARMUP_SAMPLES="1", FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE="3")
    fv.init()
    for _ in range(args.tune_steps):
        step(grads)
    tuned_ms = timed(grads, args.steps, args.rounds)
    fv.shutdown()

    if me == 0:
        with open(log) as f:
            rows = list(csv.reader(f))
        best = [r for r in rows if r and r[0] == "best"]
        mb = sum(sizes) * 4 / 1e6
        print(f"{args.tensors} tensors, {mb:.2f} MB per step, median of {args.rounds} x {args.steps} steps")
        print(f"{'knobs':>28} {'ms/step':>10}")
        print(f"{'defaults (128 MiB, 0 ms)':>28} {default_ms:10.2f}")
        settled = (f"tuned ({int(best[0][2]) >> 20} MiB, {float(best[0][1]):.1f} ms)"
                   if best else "tuned (not settled)")
        print(f"{settled:>28} {tuned_ms:10.2f}")
        print(f"tuned / defaults: {default_ms / tuned_ms:.2f}x speed  ({len(rows) - 1} log rows)")


if __name__ == "__main__":
    main()
