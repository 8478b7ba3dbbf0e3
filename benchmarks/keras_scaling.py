"""Keras 3 training speed on 2 ranks with ``ferrovod.tensorflow.keras``, beside the
no-communication ceiling and TensorFlow's own ``MultiWorkerMirroredStrategy``, and where the
time of a step goes.

    python benchmarks/keras_scaling.py                  # ferrovod only
    python benchmarks/keras_scaling.py --compare mwms   # also MultiWorkerMirroredStrategy
    python benchmarks/keras_scaling.py --no-bind-cores  # ranks left unbound

The driver launches ONE job of ``--np`` ranks (default 2) with ``ferrovodrun``; every variant
below runs in the same processes, in alternating rounds (the order rotates and every round
starts at a barrier), so a slow window of the machine hits all of them alike. Each rank has 1
TensorFlow intra-op and 1 inter-op thread (``--threads``), the same per-rank batch on every
variant (weak scaling), synthetic data, ``jit_compile`` off. ``ferrovodrun`` binds each rank to
its share of the cores where each gets a whole one, so every variant, MWMS's included, runs in
bound processes; ``--no-bind-cores`` (passed to ``ferrovodrun``) leaves them unbound, and
``--bind-cores`` binds them even on fewer cores than ranks. Variants:

* ``1 process``: plain Keras ``fit`` on rank 0 alone while the other ranks wait idle (blocked,
  not polling): the baseline of scaling efficiency;
* ``no-comm``: plain Keras ``fit`` on every rank at once, no communication: the ceiling the
  machine allows (ranks share cores and memory bandwidth);
* ``host op``: ``fit`` with the DistributedOptimizer whose reduction is replaced by a stateful
  ``tf.numpy_function`` returning its inputs: the cost of leaving the graph for the host;
* ``sync-only``: that host op meeting the other ranks once per step (a one-element allreduce)
  before it returns its inputs: a synchronous trainer whose communication is free, the most
  any synchronous trainer can reach here (each step waits for the slower rank);
* ``ferrovod``: ``fit`` with ``hvd.DistributedOptimizer``;
* ``tape``: a custom ``tf.function`` loop with ``hvd.DistributedGradientTape``;
* ``mwms`` (``--compare mwms``): the same custom loop under
  ``tf.distribute.MultiWorkerMirroredStrategy`` (``TF_CONFIG`` on local ports, ring
  collectives; Keras' optimizer all-reduces the gradients).
  Keras 3's ``fit`` does not run under a multi-worker MWMS (keras-team/keras#20585), so its
  peer is the ``tape`` loop.

Also measured for ``ferrovod``: the allreduce inside the step (submit to completion, summed
per step; includes waiting for the other rank) and the host op's Python body; and the same
grouped allreduce alone on NumPy arrays (no TF). Scaling efficiency = ``1 process`` step time
/ the variant's step time (1.0 = perfect). After the timing, every variant that trains the
global batch (ferrovod, tape, mwms) trains the same steps from the same weights on the same
per-rank batches: the table reports how far their weights are from each other and across
ranks.

Each figure is the median of the rounds (the fastest in parentheses). A benchmark, not a test:
it prints numbers; compare rows of the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# model -> (hidden widths of an MLP or None for the CNN, per-rank batch)
MODELS: Dict[str, Tuple[Any, int]] = {
    "mlp-2048": ((2048, 2048), 64),
    "mlp-1536": ((1536, 1024), 64),
    "cnn": (None, 32),
}


def build(kind: str) -> Tuple[Any, Tuple[int, ...]]:
    """The model (uncompiled) and the shape of one sample."""
    import keras

    widths = MODELS[kind][0]
    if widths is not None:
        return keras.Sequential([keras.Input((784,))]
                                + [keras.layers.Dense(w, activation="relu") for w in widths]
                                + [keras.layers.Dense(10)]), (784,)
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


def identity_reduce(self: Any, grads: List[Any], variables: List[Any],
                    meet: bool = False) -> List[Any]:
    """Stands in for the DistributedOptimizer's reduction: the same kind of host op (one
    stateful ``tf.numpy_function`` over all gradients), returning its inputs unchanged; with
    ``meet``, after a one-element allreduce with the other ranks."""
    import numpy as np
    import tensorflow as tf

    import ferrovod

    token = np.zeros(1, np.float32)

    def body(*arrays: Any) -> List[Any]:
        if meet:
            ferrovod.allreduce(token, name="bench.meet")
        return [np.asarray(x) for x in arrays]

    idx = [i for i, g in enumerate(grads) if g is not None]
    ts = [tf.convert_to_tensor(grads[i]) for i in idx]
    outs = tf.numpy_function(body, ts, [t.dtype for t in ts], stateful=True)
    out = list(grads)
    for i, o, t in zip(idx, outs, ts):
        o.set_shape(t.shape)
        out[i] = o
    return out


class EngineClock:
    """Sums, per step, the time from submitting each grouped allreduce to its completion,
    and the time spent in the host op's Python body."""

    def __init__(self) -> None:
        import ferrovod._api as api
        from ferrovod.tensorflow import mpi_ops

        self.total, self.body, self.start = 0.0, 0.0, {}
        self._submit, self._sync = api.grouped_allreduce_async, api.synchronize
        self._execute = mpi_ops._execute
        api.grouped_allreduce_async = self._timed_submit
        api.synchronize = self._timed_sync
        mpi_ops._execute = self._timed_execute

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

    def _timed_execute(self, body: Callable[..., Any], *a: Any, **k: Any) -> Any:
        def timed(*arrays: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return body(*arrays)
            finally:
                self.body += time.perf_counter() - t0
        return self._execute(timed, *a, **k)


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def worker(args: argparse.Namespace) -> None:
    rank, size = int(os.environ["FERROVOD_RANK"]), int(os.environ["FERROVOD_SIZE"])
    mwms = None
    if args.tf_ports:
        # MultiWorkerMirroredStrategy must exist before TensorFlow runs anything.
        ports = args.tf_ports.split(",")
        os.environ["TF_CONFIG"] = json.dumps({
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": rank}})
    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.tf_ports:
        impl = tf.distribute.experimental.CommunicationImplementation.RING
        mwms = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=impl))

    import ferrovod
    import ferrovod.tensorflow as hvd_tf
    import ferrovod.tensorflow.keras as hvd

    hvd.init()
    assert (hvd.rank(), hvd.size()) == (rank, size)
    clock = EngineClock()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    results: Dict[str, Any] = {"ranks": size, "models": {}, "mwms": mwms is not None}

    def compiled(kind: str, reduce: str) -> Any:
        model, _ = build(kind)
        opt = keras.optimizers.SGD(0.01)
        if reduce != "none":
            opt = hvd.DistributedOptimizer(opt)
            if reduce in ("identity", "meet"):
                opt._fv_reduce = types.MethodType(
                    functools.partial(identity_reduce, meet=reduce == "meet"), opt)
        model.compile(optimizer=opt, jit_compile=False, loss=loss_fn)
        return model

    def tape_loop(kind: str) -> Tuple[Any, Callable[[Any, Any], None]]:
        model, _ = build(kind)
        opt = keras.optimizers.SGD(0.01)
        opt.build(model.trainable_variables)

        @tf.function
        def step(x: Any, y: Any) -> None:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = hvd_tf.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
        return model, step

    def mwms_loop(kind: str) -> Tuple[Any, Callable[[Any, Any], None]]:
        with mwms.scope():
            model, _ = build(kind)
            opt = keras.optimizers.SGD(0.01)
            opt.build(model.trainable_variables)

        @tf.function
        def step(x: Any, y: Any) -> None:
            def replica(x: Any, y: Any) -> None:
                with tf.GradientTape() as tape:
                    # Keras 3 scales the summed gradients by the replica count itself (the
                    # weights check below finds them bitwise equal to ferrovod's average).
                    loss = loss_fn(y, model(x, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply(grads, model.trainable_variables)
            mwms.run(replica, args=(x, y))
        return model, step

    def fit_runner(model: Any, ds: Any) -> Callable[[int], None]:
        return lambda steps: model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0)

    def loop_runner(step: Callable[[Any, Any], None], ds: Any) -> Callable[[int], None]:
        it = iter(ds)

        def run(steps: int) -> None:
            for _ in range(steps):
                x, y = next(it)
                step(x, y)
        return run

    for kind in args.models.split(","):
        batch = MODELS[kind][1]
        rng = np.random.default_rng(rank)
        _, shape = build(kind)
        x = rng.standard_normal((batch * 8,) + shape).astype("float32")
        y = rng.integers(0, 10, batch * 8)
        # tf.data's autotuning thread, on cores the ranks already fill, put `fit` into a mode
        # ~12 ms per step slower for whole rounds, on 1 process as on 2.
        opts = tf.data.Options()
        opts.autotune.enabled = False
        ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(batch).prefetch(4)
        ds = ds.with_options(opts)
        runners: Dict[str, Callable[[int], None]] = {}
        alone = compiled(kind, "none")
        runners["1 process"] = fit_runner(alone, ds)
        runners["no-comm"] = fit_runner(compiled(kind, "none"), ds)
        runners["host op"] = fit_runner(compiled(kind, "identity"), ds)
        runners["sync-only"] = fit_runner(compiled(kind, "meet"), ds)
        runners["ferrovod"] = fit_runner(compiled(kind, "ferrovod"), ds)
        runners["tape"] = loop_runner(tape_loop(kind)[1], ds)
        if mwms is not None:
            runners["mwms"] = loop_runner(mwms_loop(kind)[1], ds)
        for name, run in runners.items():  # trace, build, warm up
            if name != "1 process" or rank == 0:
                run(3)
            ferrovod.barrier()
        times: Dict[str, List[float]] = {k: [] for k in runners}
        engine: Dict[str, List[float]] = {"ferrovod": [], "tape": []}
        body: Dict[str, List[float]] = {"ferrovod": [], "tape": []}
        names = list(runners)
        for rnd in range(args.rounds):
            k = rnd % len(names)
            for name in names[k:] + names[:k]:
                ferrovod.barrier()
                clock.total = clock.body = 0.0
                t0 = time.perf_counter()
                if name != "1 process" or rank == 0:
                    runners[name](args.steps)
                times[name].append((time.perf_counter() - t0) / args.steps)
                if name in engine:
                    engine[name].append(clock.total / args.steps)
                    body[name].append(clock.body / args.steps)
        # Real values: a zero array's pages all map the one zero page, always in cache.
        grads = [rng.standard_normal(tuple(v.shape)).astype("float32")
                 for v in alone.trainable_variables]
        alone_ar: List[float] = []
        for rnd in range(args.rounds):
            ferrovod.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ferrovod.grouped_allreduce(grads, name=f"bench.{kind}")
            alone_ar.append((time.perf_counter() - t0) / args.steps)
        results["models"][kind] = {
            "params": int(sum(g.size for g in grads)),
            "grad_bytes": int(sum(g.nbytes for g in grads)),
            "batch": batch,
            "median": {k: statistics.median(v) for k, v in times.items()},
            "best": {k: min(v) for k, v in times.items()},
            "rounds": times,
            "allreduce_in_step": {k: statistics.median(v) for k, v in engine.items()},
            "host_body": {k: statistics.median(v) for k, v in body.items()},
            "allreduce_alone": statistics.median(alone_ar),
            "agree": weights_agree(kind, shape, batch, compiled, tape_loop,
                                   mwms_loop if mwms is not None else None),
        }
    if rank == 0:
        with open(args.json, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


def weights_agree(kind: str, shape: Tuple[int, ...], batch: int, compiled: Callable[..., Any],
                  tape_loop: Callable[..., Any], mwms_loop: Any) -> Dict[str, float]:
    """Trains ferrovod (fit), tape and mwms 4 steps from the same weights on the same batches;
    returns the largest weight differences between them and across ranks."""
    import numpy as np
    import tensorflow as tf

    import ferrovod

    rank = ferrovod.rank()
    rng = np.random.default_rng(100 + rank)
    batches = [(rng.standard_normal((batch,) + shape).astype("float32"),
                rng.integers(0, 10, batch)) for _ in range(4)]
    start = [np.random.default_rng(7).standard_normal(tuple(w.shape)).astype("float32") * 0.05
             for w in build(kind)[0].get_weights()]
    final: Dict[str, List[np.ndarray]] = {}
    model = compiled(kind, "ferrovod")
    model.set_weights(start)
    for xb, yb in batches:
        model.train_on_batch(xb, yb)
    final["ferrovod"] = model.get_weights()
    loops = {"tape": tape_loop}
    if mwms_loop is not None:
        loops["mwms"] = mwms_loop
    for name, make in loops.items():
        model, step = make(kind)
        model.set_weights(start)
        for xb, yb in batches:
            step(tf.constant(xb), tf.constant(yb))
        final[name] = model.get_weights()

    def gap(a: List[np.ndarray], b: List[np.ndarray]) -> float:
        return float(max(np.max(np.abs(u - v)) for u, v in zip(a, b)))

    out = {f"{name} ranks": gap(w, ferrovod.broadcast_object(w, 0)) for name, w in final.items()}
    for name in loops:
        out[f"ferrovod-{name}"] = gap(final["ferrovod"], final[name])
    out["moved"] = gap(final["ferrovod"], start)
    return out


def print_table(res: Dict[str, Any]) -> None:
    n = res["ranks"]
    cols = ["1 process", "no-comm", "host op", "sync-only", "ferrovod", "tape"] + (
        ["mwms"] if res["mwms"] else [])
    print(f"\n{n} ranks, ms/step: median of the rounds (fastest); eff. = 1 process / variant")
    print(f"{'model':9} {'grad MB':>7} " + " ".join(f"{c:>15}" for c in cols))
    for kind, m in res["models"].items():
        cells = [f"{1e3 * m['median'][c]:7.2f} ({1e3 * m['best'][c]:5.1f})" for c in cols]
        print(f"{kind:9} {m['grad_bytes'] / 2**20:7.1f} " + " ".join(cells))
    print("\nscaling efficiency and samples/s (all ranks) from the medians")
    head = ["no-comm", "sync-only", "ferrovod", "tape"] + (["mwms"] if res["mwms"] else [])
    print(f"{'model':9} " + " ".join(f"{'eff. ' + c:>14}" for c in head)
          + f" {'ferrovod/s':>11} {'tape/s':>9}"
          + (f" {'mwms/s':>9} {'fv/mwms':>8} {'tape/mwms':>9}" if res["mwms"] else ""))
    for kind, m in res["models"].items():
        med = m["median"]
        rate = {c: n * m["batch"] / med[c] for c in cols}
        line = f"{kind:9} " + " ".join(f"{med['1 process'] / med[c]:14.2f}" for c in head)
        line += f" {rate['ferrovod']:11.0f} {rate['tape']:9.0f}"
        if res["mwms"]:
            line += (f" {rate['mwms']:9.0f} {rate['ferrovod'] / rate['mwms']:7.2f}x"
                     f" {rate['tape'] / rate['mwms']:8.2f}x")
        print(line)
    print("\nwhere a step's time goes (ms, medians): fit = ferrovod, loop = tape")
    print(f"{'model':9} {'compute':>8} {'host op':>8} {'lockstep':>8} {'py body':>8} "
          f"{'allreduce':>10} {'rest':>7} {'py body':>8} {'allreduce':>10} {'allreduce':>10}")
    print(f"{'':9} {'no-comm':>8} {'extra':>8} {'wait':>8} {'fit':>8} {'in fit':>10} "
          f"{'fit':>7} {'loop':>8} {'in loop':>10} {'alone':>10}")
    for kind, m in res["models"].items():
        med, body, inside = m["median"], m["host_body"], m["allreduce_in_step"]
        extra = med["host op"] - med["no-comm"]
        lockstep = med["sync-only"] - med["host op"]
        rest = med["ferrovod"] - med["host op"] - body["ferrovod"]
        print(f"{kind:9} {1e3 * med['no-comm']:8.2f} {1e3 * extra:8.2f} {1e3 * lockstep:8.2f} "
              f"{1e3 * body['ferrovod']:8.2f} {1e3 * inside['ferrovod']:10.2f} "
              f"{1e3 * rest:7.2f} {1e3 * body['tape']:8.2f} {1e3 * inside['tape']:10.2f} "
              f"{1e3 * m['allreduce_alone']:10.2f}")
    print("host op extra: identity host op minus no-comm; lockstep wait: sync-only minus "
          "host op (waiting each step for the slower rank); py body: the host op's Python body "
          "(submit, allreduce, wait); allreduce in: submit to completion inside it (includes "
          "waiting for the other rank); rest: ferrovod minus host op minus py body (TF taking "
          "the body's outputs); alone: the same grouped allreduce on NumPy arrays, no TF")
    print("\nweights after 4 steps from the same start (largest absolute difference)")
    for kind, m in res["models"].items():
        print(f"{kind:9} " + "  ".join(f"{k}: {v:.2e}" for k, v in m["agree"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help="run under ferrovodrun")
    parser.add_argument("--np", type=int, default=2, help="ranks of the job")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=15, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", default="", help="'mwms': also MultiWorkerMirroredStrategy")
    parser.add_argument("--threads", type=int, default=1,
                        help="TensorFlow intra-op and inter-op threads per rank")
    parser.add_argument("--bind-cores", dest="bind", action="store_const",
                        const="--bind-cores", default="",
                        help="launch with ferrovodrun --bind-cores")
    parser.add_argument("--no-bind-cores", dest="bind", action="store_const",
                        const="--no-bind-cores", help="launch with ferrovodrun --no-bind-cores")
    parser.add_argument("--save", default=None, help="also write the results (every round) "
                        "to this JSON file")
    parser.add_argument("--json", default=None, help="(worker) write rank 0's results here")
    parser.add_argument("--tf-ports", default="", help="(worker) MWMS ports, one per rank")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(args.np),
               *([args.bind] if args.bind else []),
               sys.executable, os.path.abspath(__file__), "--worker", "--json", out,
               "--models", args.models, "--steps", str(args.steps), "--rounds",
               str(args.rounds), "--threads", str(args.threads)]
        if "mwms" in args.compare.split(","):
            cmd += ["--tf-ports", ",".join(str(p) for p in free_ports(args.np))]
        print(f"running: ferrovodrun -np {args.np} {args.bind} ...",
              flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.exit(f"-np {args.np} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                     f"{proc.stderr[-4000:]}")
        with open(out) as f:
            res = json.load(f)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(res, f, indent=1)
    print_table(res)


if __name__ == "__main__":
    main()
