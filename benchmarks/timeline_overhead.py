"""Cost of writing the timeline: a training-like step (many gradient tensors of mixed sizes,
submitted async, then synchronized) timed with the timeline off and on, alternating in the
same run. Run under ``ferrovodrun -np 2``; rank 0 prints the table."""

from __future__ import annotations

import argparse
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=40, help="steps per measurement")
    ap.add_argument("--rounds", type=int, default=5, help="off/on alternations")
    args = ap.parse_args()
    fv.init()
    rng = np.random.default_rng(fv.rank())
    # 60 tensors, 1 KiB .. 1 MiB: about 12 MB of float32 gradients, like a small CNN/MLP.
    sizes = [int(256 * 1.15 ** i) for i in range(60)]
    grads = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    for _ in range(5):
        step(grads)
    off, on = [], []
    for _ in range(args.rounds):
        for enabled, sink in ((False, off), (True, on)):
            if enabled:
                fv.start_timeline(path)
            fv.barrier()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(grads)
            fv.barrier()
            sink.append((time.perf_counter() - t) / args.steps * 1e3)
            if enabled:
                fv.stop_timeline()
    if fv.rank() == 0:
        a, b = statistics.median(off), statistics.median(on)
        mb = sum(sizes) * 4 / 1e6
        print(f"{len(sizes)} tensors, {mb:.1f} MB per step, {fv.size()} ranks, median of {args.rounds}")
        print(f"{'timeline':>10} {'ms/step':>10}")
        print(f"{'off':>10} {a:10.2f}")
        print(f"{'on':>10} {b:10.2f}")
        print(f"overhead: {100 * (b - a) / a:+.1f} %  (file {os.path.getsize(path) / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
