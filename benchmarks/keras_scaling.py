"""Keras 3 training step time with ``ferrovod.tensorflow.keras`` on 1 and 2 ranks, and where the
time of the gradient exchange goes.

    python benchmarks/keras_scaling.py                 # runs -np 1 and -np 2, prints the table
    ferrovodrun -np 2 python benchmarks/keras_scaling.py --worker   # one size, rank 0 prints

Two models, the same per-rank batch on every size (weak scaling): an MLP of ~2.8 M parameters
(784-1536-1024-10, batch 64) and a small CNN (32x32x3, two conv blocks, global pooling, batch
32). Each rank trains with ``model.fit`` on synthetic data (TF backend, ``jit_compile`` off).
Three variants of the same model are timed in alternating rounds (the order rotates, every
round starts at a barrier); each number is the fastest round (the one least disturbed by
other load on a shared machine), median in parentheses where it matters:

* ``keras``: plain Keras SGD, no ferrovod — on 2 ranks both processes train at once without
  communicating: what sharing the 2 cores costs before any gradient is exchanged;
* ``host op``: the DistributedOptimizer with its reduction replaced by a stateful
  ``tf.numpy_function`` that returns its inputs — the cost of leaving the graph for the host
  (TF -> NumPy views, the results copied back into TF tensors, the executor's host-op path);
* ``ferrovod``: the real DistributedOptimizer (one grouped allreduce per step).

Also measured: the allreduce time inside the step (from submit to completion, summed per
step, measured around ``ferrovod._api``'s grouped allreduce inside the host op; it includes
waiting for the other rank to reach the step), and the same grouped allreduce alone on NumPy
arrays of the gradients' shapes (no TF running), out of place as inside the step (fresh
output arrays every call) and in place (``grouped_allreduce_``): the difference is what
allocating and first-touching new output pages costs per step. Scaling efficiency = step time on 1 rank /
step time on 2 ranks at the same per-rank batch and the same threads per rank (``--threads``,
default 1: on a machine with as many cores as ranks, a 1-rank run given every core is not the
baseline a rank of a 2-rank run can match) (1.0 = perfect). On 1 rank the
DistributedOptimizer does not exchange anything (it is the plain Keras step).

A benchmark, not a test: it prints numbers. They drift 2-4x between runs on shared VMs;
compare rows of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any, Dict, List

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = {"mlp": 64, "cnn": 32}  # model -> per-rank batch


def build(kind: str) -> Any:
    """The model (uncompiled) and the shape of one sample."""
    import keras

    if kind == "mlp":
        return keras.Sequential([keras.Input((784,)), keras.layers.Dense(1536, activation="relu"),
                                 keras.layers.Dense(1024, activation="relu"),
                                 keras.layers.Dense(10)]), (784,)
    return keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ]), (32, 32, 3)


def identity_reduce(self: Any, grads: List[Any], variables: List[Any]) -> List[Any]:
    """Stands in for the DistributedOptimizer's reduction: the same kind of host op (one
    stateful ``tf.numpy_function`` over all gradients), returning its inputs unchanged."""
    import numpy as np
    import tensorflow as tf

    idx = [i for i, g in enumerate(grads) if g is not None]
    ts = [tf.convert_to_tensor(grads[i]) for i in idx]
    outs = tf.numpy_function(lambda *a: [np.asarray(x) for x in a], ts, [t.dtype for t in ts],
                             stateful=True)
    out = list(grads)
    for i, o, t in zip(idx, outs, ts):
        o.set_shape(t.shape)
        out[i] = o
    return out


class EngineClock:
    """Sums, per step, the time from submitting each grouped allreduce to its completion."""

    def __init__(self) -> None:
        import ferrovod._api as api

        self.api, self.total, self.start = api, 0.0, {}
        self._submit, self._sync = api.grouped_allreduce_async, api.synchronize
        api.grouped_allreduce_async = self._timed_submit
        api.synchronize = self._timed_sync

    def _timed_submit(self, *a: Any, **k: Any) -> Any:
        h = self._submit(*a, **k)
        self.start[h] = time.perf_counter()
        return h

    def _timed_sync(self, h: Any) -> Any:
        out = self._sync(h)
        t0 = self.start.pop(h, None)
        if t0 is not None:
            self.total += time.perf_counter() - t0
        return out


def worker(args: argparse.Namespace) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import ferrovod
    import ferrovod.tensorflow.keras as hvd

    if args.threads > 0:
        # The same compute per rank on every size: otherwise 1 rank runs a pool as wide as
        # the machine and the 2-rank run, one thread each, looks like poor scaling.
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    clock = EngineClock()
    results: Dict[str, Any] = {"ranks": n, "models": {}}
    for kind in args.models.split(","):
        batch = MODELS[kind]
        rng = np.random.default_rng(r)
        _, shape = build(kind)
        x = rng.standard_normal((batch * 8,) + shape).astype("float32")
        y = rng.integers(0, 10, batch * 8)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).prefetch(4)
        variants = {}
        for name in ("keras", "host op", "ferrovod"):
            model, _ = build(kind)
            opt = keras.optimizers.SGD(0.01)
            if name != "keras":
                opt = hvd.DistributedOptimizer(opt)
                if name == "host op":
                    opt._fv_reduce = types.MethodType(identity_reduce, opt)
            model.compile(optimizer=opt, jit_compile=False,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.fit(ds, steps_per_epoch=5, epochs=1, verbose=0)  # trace, build, warm up
            variants[name] = model
        times: Dict[str, List[float]] = {k: [] for k in variants}
        engine: List[float] = []
        names = list(variants)
        for rnd in range(args.rounds):
            for name in names[rnd % 3:] + names[:rnd % 3]:
                ferrovod.barrier()
                clock.total = 0.0
                t0 = time.perf_counter()
                variants[name].fit(ds, steps_per_epoch=args.steps, epochs=1, verbose=0)
                times[name].append((time.perf_counter() - t0) / args.steps)
                if name == "ferrovod":
                    engine.append(clock.total / args.steps)
        # the same grouped allreduce with no TF around it
        model = variants["ferrovod"]
        grads = [np.zeros(tuple(v.shape), dtype="float32") for v in model.trainable_variables]
        alone: List[float] = []
        inplace: List[float] = []
        if n > 1:
            for rnd in range(args.rounds):
                for out, fn in ((alone, ferrovod.grouped_allreduce),
                                (inplace, ferrovod.grouped_allreduce_)):
                    ferrovod.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        fn(grads, name=f"bench.{kind}.{fn.__name__}")
                    out.append((time.perf_counter() - t0) / args.steps)
        results["models"][kind] = {
            "params": int(sum(np.prod(v.shape) for v in model.trainable_variables)),
            "grad_bytes": int(sum(g.nbytes for g in grads)),
            "tensors": len(grads), "batch": batch,
            "step": {k: min(v) for k, v in times.items()},
            "step_median": {k: statistics.median(v) for k, v in times.items()},
            "engine_in_step": min(engine) if n > 1 else 0.0,
            "engine_alone": min(alone) if alone else 0.0,
            "engine_alone_inplace": min(inplace) if inplace else 0.0,
        }
    if r == 0:
        text = json.dumps(results)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text)
        else:
            print_table([results])
    hvd.shutdown()


def print_table(runs: List[Dict[str, Any]]) -> None:
    """One row per (model, ranks); efficiency against the 1-rank run when there is one."""
    one = {k: m["step"]["ferrovod"] for run in runs if run["ranks"] == 1
           for k, m in run["models"].items()}
    head = (f"{'model':5} {'params':>7} {'grad MB':>7} {'ranks':>5} {'keras':>9} {'host op':>9} "
            f"{'ferrovod':>9} {'allreduce':>10} {'allreduce':>10} {'in place':>9} {'scaling':>8}")
    sub = (f"{'':5} {'':>7} {'':>7} {'':>5} {'ms/step':>9} {'ms/step':>9} {'ms/step':>9} "
           f"{'in step':>10} {'alone':>10} {'alone':>9} {'eff.':>8}")
    print(head)
    print(sub)
    for run in sorted(runs, key=lambda r: r["ranks"]):
        for kind, m in run["models"].items():
            s = m["step"]
            eff = one.get(kind, 0.0) / s["ferrovod"] if kind in one else float("nan")
            med = m["step_median"]["ferrovod"]
            print(f"{kind:5} {m['params'] / 1e6:6.2f}M {m['grad_bytes'] / 2**20:7.1f} "
                  f"{run['ranks']:5d} {1e3 * s['keras']:9.2f} {1e3 * s['host op']:9.2f} "
                  f"{1e3 * s['ferrovod']:9.2f} {1e3 * m['engine_in_step']:10.2f} "
                  f"{1e3 * m['engine_alone']:10.2f} {1e3 * m['engine_alone_inplace']:9.2f} "
                  f"{eff:8.2f}   (ferrovod median {1e3 * med:.2f})")
    print("fastest of the rounds; keras: plain Keras, no ferrovod; host op: "
          "DistributedOptimizer with an identity numpy_function instead of the allreduce; "
          "allreduce in step: submit -> done inside the host op (includes waiting for the "
          "other rank); alone: same grouped allreduce on NumPy arrays, no TF (new output "
          "arrays, as inside the step; in place: into the inputs); scaling eff.: ferrovod "
          "step on 1 rank / on this many ranks (same per-rank batch).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run under ferrovodrun")
    parser.add_argument("--sizes", default="1,2", help="rank counts to launch (driver mode)")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None, help="(worker) write rank 0's results here")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow intra-op threads per rank on every size (0: TF's own "
                             "choice, i.e. all cores for 1 rank and a share for more)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            out = os.path.join(tmp, f"{n}.json")
            cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(n), sys.executable,
                   os.path.abspath(__file__), "--worker", "--json", out, "--models", args.models,
                   "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--threads", str(args.threads)]
            print(f"running: ferrovodrun -np {n} ...", flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0 or not os.path.exists(out):
                sys.exit(f"-np {n} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                         f"{proc.stderr[-4000:]}")
            with open(out) as f:
                runs.append(json.load(f))
    print_table(runs)


if __name__ == "__main__":
    main()
