"""ferrovod's Keras adapter in one launch: DistributedOptimizer, callbacks, load_model, ops.

usage: keras_train_worker.py SEED TMPDIR   (KERAS_BACKEND=tensorflow or torch; or
TF_USE_LEGACY_KERAS=1 for Keras 2 through tf_keras, as Horovod-era scripts run on TF >= 2.16,
which adds a section for the legacy optimizers and the custom-loop entries of Keras 2)

References never go through ferrovod: each rank rebuilds every rank's data from the seed and
trains a plain Keras model (plain optimizer) in this process on the global batch, or computes
the expected update with NumPy. Float64 throughout (``keras.config.set_floatx``), so the
distributed and single-process results agree to ~1e-12. Sections print ``section NAME: k
checks``; the last line is ``OK <n_checks>``.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

KERAS2 = os.environ.get("TF_USE_LEGACY_KERAS") == "1"
if KERAS2:
    import tf_keras as keras  # noqa: E402
else:
    import keras  # noqa: E402
import numpy as np  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod  # noqa: E402
import ferrovod.keras as hvdk  # noqa: E402  (the standalone-keras module: same surface)
from ferrovod._keras.optimizer import is_distributed  # noqa: E402

BACKEND = keras.backend.backend()
if BACKEND == "tensorflow":
    import tensorflow as tf  # noqa: E402

    import ferrovod.tensorflow as hvd_tf  # noqa: E402
    import ferrovod.tensorflow.keras as hvd  # noqa: E402
else:
    tf = None
    hvd = hvdk
FLAVOR = "keras2" if KERAS2 else BACKEND

keras.backend.set_floatx("float64")
DIN, HID, DOUT, B, STEPS, LR = 5, 6, 3, 4, 6, 0.1
# Keras' torch backend computes part of the backward pass in float32 even with floatx float64
# (a batch-of-8 gradient differs from the mean of two batch-of-4 gradients by ~1e-7 there,
# with no ferrovod involved), so torch-backend comparisons get a float32-sized tolerance.
TOL = 1e-9 if BACKEND == "tensorflow" else 1e-6


def rng(*key):
    return np.random.default_rng([abs(int(k)) for k in key])


def make_model(hidden=HID):
    return keras.Sequential([keras.Input((DIN,)), keras.layers.Dense(hidden, activation="tanh"),
                             keras.layers.Dense(DOUT)])


def set_weights(model, seed):
    g = rng(seed, 999)
    model.set_weights([g.standard_normal(w.shape) * 0.5 for w in model.get_weights()])


def data(seed, r, steps=STEPS):
    g = rng(seed, r)
    return g.standard_normal((steps * B, DIN)), g.standard_normal((steps * B, DOUT))


def global_data(seed, n, micro=1, steps=STEPS):
    """The single-process batches: update k sees every rank's micro-batches of update k."""
    parts = [data(seed, r, steps) for r in range(n)]
    xs, ys = [], []
    for k in range(steps // micro):
        rows = slice(k * micro * B, (k + 1) * micro * B)
        for x, y in parts:
            xs.append(x[rows])
            ys.append(y[rows])
    return np.concatenate(xs), np.concatenate(ys)


def flat(model):
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])


def npy(v):
    return np.asarray(v.numpy() if KERAS2 else keras.ops.convert_to_numpy(v))


def tensor(a):
    return tf.convert_to_tensor(a) if KERAS2 else keras.ops.convert_to_tensor(a)


def variable(a):
    return tf.Variable(a) if KERAS2 else keras.Variable(a)


def var_name(v):
    return getattr(v, "path", None) or v.name


def load_plain(path):
    return keras.models.load_model(path) if KERAS2 else keras.saving.load_model(path)


def make_step(opt, variables, graph):
    """``step(*grads)``: one ``apply_gradients`` (None gradients allowed), eager or traced."""
    def step(*grads):
        opt.apply_gradients(zip(grads, variables))

    if not graph:
        return step

    def fill(grads, ts):
        it = iter(ts)
        return [None if g is None else next(it) for g in grads]

    cache = {}  # one traced function per pattern of None gradients

    def call(*grads):
        key = tuple(g is None for g in grads)
        if key not in cache:
            cache[key] = tf.function(lambda *ts: step(*fill(grads, ts)))
        return cache[key](*[g for g in grads if g is not None])

    return call


class Record(keras.callbacks.Callback):
    """Copies what it sees: epoch-end logs, and the lr / momentum buffers at batch begin."""

    def __init__(self):
        super().__init__()
        self.epoch_logs, self.batches = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs or {}))

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        slots = [npy(s) for s in getattr(opt, "momentums", []) or []]
        if not slots and "momentum" in getattr(opt, "get_slot_names", lambda: [])():
            try:  # Keras 2's legacy optimizers: a slot per variable, once they exist
                slots = [npy(opt.get_slot(v, "momentum")) for v in self.model.trainable_variables]
            except KeyError:
                slots = []
        self.batches.append((float(npy(opt.learning_rate)), slots))


class Run:
    def __init__(self, seed, tmpdir):
        self.seed, self.tmpdir = seed, tmpdir
        self.r, self.n = hvd.rank(), hvd.size()
        self.ck = T.Checker(self.r)

    def close(self, got, exp, what, tol=TOL):
        got, exp = np.asarray(got, np.float64), np.asarray(exp, np.float64)
        self.ck.true(got.shape == exp.shape and np.allclose(got, exp, rtol=tol, atol=tol), what,
                     f"max abs diff {np.max(np.abs(got - exp)) if got.shape == exp.shape else 'shape'}"
                     f" > {tol}")

    def same_on_all_ranks(self, arr, what):
        rows = np.asarray(hvd.allgather(np.asarray(arr, np.float64).reshape(1, -1)))
        self.ck.true(bool((rows == rows[0]).all()), what, "ranks hold different values")

    def reference_fit(self, seed, epochs=1, micro=1, opt=None, model=None, **fit):
        """Plain Keras, one process, the global batch: rank 0's initial weights."""
        if model is None:
            model = make_model()
            set_weights(model, seed)
            model.compile(optimizer=opt or keras.optimizers.SGD(LR), loss="mse", metrics=["mae"])
        gx, gy = global_data(seed, self.n, micro)
        hist = model.fit(gx, gy, batch_size=self.n * B * micro, epochs=epochs, shuffle=False,
                         verbose=0, **fit)
        return model, hist

    # ------------------------------------------------------------------ sections

    def fit(self):
        """2 ranks on shards with Average == 1 process on the whole batch; metric averaging."""
        s = self.seed
        model = make_model()
        set_weights(model, s + self.r)  # differs per rank: the broadcast must fix it
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse",
                      metrics=["mae"], jit_compile=False)
        raw = Record()
        x, y = data(s, self.r)
        hist = model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
                         callbacks=[raw, hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                    hvd.callbacks.MetricAverageCallback()])
        ref, ref_hist = self.reference_fit(s, epochs=2)
        self.close(flat(model), flat(ref), "fit weights == single-process full-batch weights")
        self.same_on_all_ranks(flat(model), "fit weights identical on all ranks")
        for key in ("loss", "mae"):
            mine = np.array([lg[key] for lg in raw.epoch_logs])
            everyone = np.asarray(hvd.allgather(mine.reshape(1, -1)))
            self.close(hist.history[key], everyone.mean(0), f"{key}: averaged == mean of ranks")
            self.close(hist.history[key], ref_hist.history[key], f"{key}: == single process")
            if self.n > 1:
                self.ck.true(not np.allclose(everyone[0], everyone[1]), f"{key} differs per rank",
                             "ranks saw the same metric before averaging: weak test")

    def warmup(self):
        """Per-batch lr against Goyal et al.'s formula; momentum buffers rescaled; then
        load_model round trip (save on rank 0, load everywhere, keep training)."""
        s, n, W, E = self.seed + 1, self.n, 2, 3
        model = make_model()
        set_weights(model, s + self.r)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9))
        model.compile(optimizer=opt, loss="mse", metrics=["mae"])
        pre, post = Record(), Record()
        x, y = data(s, self.r)
        hist = model.fit(x, y, batch_size=B, epochs=E, shuffle=False, verbose=0, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0), pre,
            hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=W), post])
        self.ck.equal(len(post.batches), E * STEPS, "one record per batch")
        for i, ((lr0, m0), (lr1, m1)) in enumerate(zip(pre.batches, post.batches)):
            e, b = divmod(i, STEPS)
            want = LR / n * ((e + (b + 1) / STEPS) * (n - 1) / W + 1) if e < W else LR
            self.close(lr1, want, f"warm-up lr at epoch {e} batch {b}", tol=1e-12)
            for a, c in zip(m0, m1):
                self.close(c, a * (lr1 / lr0), f"momentum correction at epoch {e} batch {b}")
        nontrivial = sum(1 for (lr0, m0), (lr1, _) in zip(pre.batches, post.batches)
                         if lr0 != lr1 and m0 and np.abs(m0[0]).max() > 0)
        self.ck.true(nontrivial > 0 or n == 1, "a non-trivial momentum correction ran")
        self.close(hist.history["lr"], [post.batches[(e + 1) * STEPS - 1][0] for e in range(E)],
                   "logs['lr'] at epoch end")
        self.same_on_all_ranks(flat(model), "warm-up weights identical on all ranks")

        # load_model: the file holds a distributed SGD (saved as plain SGD) with momentum state.
        # Keras 2 code of Horovod's era saves HDF5 (Horovod's own examples write .h5).
        path = os.path.join(self.tmpdir, f"warm_{FLAVOR}." + ("h5" if KERAS2 else "keras"))
        if self.r == 0:
            model.save(path)
        ferrovod.barrier()
        loaded = hvd.load_model(path)
        self.ck.true(is_distributed(loaded.optimizer), "load_model re-wraps the optimizer")
        self.ck.equal(type(loaded.optimizer).__name__, "SGD", "wrapped class keeps its name")
        for a, b in zip(model.optimizer.variables, loaded.optimizer.variables):
            self.close(npy(b), npy(a), f"optimizer state {var_name(a)} survives save/load", tol=0)
        plain = load_plain(path)  # what a process without ferrovod gets
        self.ck.true(not is_distributed(plain.optimizer) and
                     isinstance(plain.optimizer, keras.optimizers.SGD), "reloads as plain SGD",
                     f"got {type(plain.optimizer).__mro__}")
        x2, y2 = data(s + 7, self.r)
        loaded.fit(x2, y2, batch_size=B, epochs=1, shuffle=False, verbose=0)
        self.reference_fit(s + 7, model=plain)
        self.close(flat(loaded), flat(plain), "training continues after load_model == reference")
        self.same_on_all_ranks(flat(loaded), "loaded model identical on all ranks after fit")

    def bpps(self):
        """backward_passes_per_step: custom loop (eager, and tf.function) and model.fit."""
        s, n, N = self.seed + 2, self.n, 3
        shapes = [(DIN, 2), (2,)]
        modes = [False, True] if tf is not None else [False]
        for graph in modes:
            for avg in (False, True):
                w0 = [rng(s, 50, i).standard_normal(sh) for i, sh in enumerate(shapes)]
                vs = [variable(w) for w in w0]
                opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR),
                                               backward_passes_per_step=N,
                                               average_aggregated_gradients=avg)

                step = make_step(opt, vs, graph)
                expected = [w.copy() for w in w0]
                acc = [[np.zeros(sh) for sh in shapes] for _ in range(n)]
                for k in range(2 * N):
                    grads = {r: [rng(s, r, k, i).standard_normal(sh) for i, sh in enumerate(shapes)]
                             for r in range(n)}
                    step(*[tensor(g) for g in grads[self.r]])
                    for r in range(n):
                        acc[r] = [a + g for a, g in zip(acc[r], grads[r])]
                    if k % N == N - 1:
                        for i in range(len(shapes)):
                            total = sum(acc[r][i] for r in range(n)) / n
                            expected[i] -= LR * (total / N if avg else total)
                        acc = [[np.zeros(sh) for sh in shapes] for _ in range(n)]
                    what = f"bpps={N} avg={avg} graph={graph} call {k + 1}"
                    for v, e in zip(vs, expected):
                        self.close(npy(v), e, what)
                    self.ck.equal(int(npy(opt.iterations)), k + 1, f"{what}: iterations")

        # model.fit with 2 passes per step, averaged == one process on 2x the global batch
        model = make_model()
        set_weights(model, s + self.r)
        model.compile(optimizer=hvd.DistributedOptimizer(
            keras.optimizers.SGD(LR), backward_passes_per_step=2, average_aggregated_gradients=True),
            loss="mse")
        x, y = data(s, self.r)
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        ref, _ = self.reference_fit(s, micro=2)
        self.close(flat(model), flat(ref), "fit with backward_passes_per_step=2 == reference")
        self.same_on_all_ranks(flat(model), "bpps fit weights identical on all ranks")

    def options(self):
        """op=Sum, predivide, fp16, groups, local variables, None gradients, bad arguments."""
        s, n = self.seed + 3, self.n
        shapes = [(DIN, 2), (2,), (3,)]
        w0 = [rng(s, 60, i).standard_normal(sh) for i, sh in enumerate(shapes)]
        g_all = {r: [rng(s, r, i).standard_normal(sh) for i, sh in enumerate(shapes)]
                 for r in range(n)}
        mean = [sum(g_all[r][i] for r in range(n)) / n for i in range(len(shapes))]
        total = [m * n for m in mean]
        mine = g_all[self.r]
        # Adasum (a power-of-two set): each gradient combined by the published recurrence
        adasum = [T.ref_adasum([g_all[r][i] for r in range(n)], np.float64)
                  for i in range(len(shapes))]
        cases = [
            ("adasum", {"op": ferrovod.Adasum}, adasum, 1e-5, None),
            ("average", {}, mean, TOL, None),
            ("sum", {"op": hvd.Sum}, total, TOL, None),
            ("predivide", {"gradient_predivide_factor": 4.0}, mean, TOL, None),
            ("fp16", {"compression": hvd.Compression.fp16}, mean, 2e-3, None),
            ("fp16 (ferrovod.keras)", {"compression": hvdk.Compression.fp16}, mean, 2e-3, None),
            ("num_groups", {"num_groups": 2}, mean, TOL, None),
            ("groups", {"groups": "first"}, mean, TOL, None),
            ("local", {}, mean[:2] + [mine[2] / n], TOL, "local"),
            ("none", {}, mean[:2] + [np.zeros(3)], TOL, "none"),
        ]
        for label, kw, want, tol, special in cases:
            vs = [variable(w) for w in w0]
            if kw.get("groups") == "first":
                kw = {"groups": [[vs[0]], [vs[2]]]}
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), **kw)
            if special == "local":
                opt.register_local_var(vs[2])
            grads = [tensor(g) for g in mine]
            if special == "none":
                grads[2] = None

            make_step(opt, vs, tf is not None)(*grads)
            for i, (v, w, g) in enumerate(zip(vs, w0, want)):
                self.close(npy(v), w - LR * g, f"{label}: variable {i}", tol=tol)
            self.ck.true(opt.variables() == opt.variables, f"{label}: variables() callable")
        self.ck.raises(ValueError, lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(LR), op=hvdk.Adasum, average_aggregated_gradients=True),
            "Adasum with average_aggregated_gradients rejected", contains=("Adasum",))
        self.ck.raises(ValueError, lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(LR), op=ferrovod.Max), "Max rejected", contains=("op=Average",))
        self.ck.raises(ValueError, lambda: hvd.DistributedOptimizer(
            hvd.DistributedOptimizer(keras.optimizers.SGD(LR))), "double wrap rejected")
        self.ck.raises(ValueError, lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(LR), op=hvd.Sum, gradient_predivide_factor=2.0),
            "predivide needs Average")

    def sparse(self):
        """Embedding gradients (tf.IndexedSlices on TF), reduced sparse and as dense."""
        s, V = self.seed + 4, 10

        def emb_model(seed):
            m = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(V, 4),
                                  keras.layers.Flatten(), keras.layers.Dense(DOUT)])
            g = rng(seed, 77)
            m.set_weights([g.standard_normal(w.shape) for w in m.get_weights()])
            return m

        def idata(r):
            g = rng(s, r, 5)
            return g.integers(0, V, (STEPS * B, 3)).astype("int32"), g.standard_normal((STEPS * B, DOUT))

        parts = [idata(r) for r in range(self.n)]
        gx = np.concatenate([p[0][k * B:(k + 1) * B] for k in range(STEPS) for p in parts])
        gy = np.concatenate([p[1][k * B:(k + 1) * B] for k in range(STEPS) for p in parts])
        ref = emb_model(s)
        ref.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        ref.fit(gx, gy, batch_size=self.n * B, epochs=1, shuffle=False, verbose=0)
        for as_dense in (False, True):
            m = emb_model(s + self.r)
            m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR),
                                                         sparse_as_dense=as_dense), loss="mse")
            m.fit(*parts[self.r], batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
            self.close(flat(m), flat(ref), f"embedding fit (sparse_as_dense={as_dense}) == reference")
            self.same_on_all_ranks(flat(m), f"embedding weights identical (sparse_as_dense={as_dense})")

    def jit(self):
        """jit_compile=True: a clear ValueError on every rank (fit and a custom tf.function)."""
        model = make_model()
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse",
                      jit_compile=True)
        x, y = data(self.seed, self.r)
        e = self.ck.raises(ValueError, lambda: model.fit(x, y, batch_size=B, epochs=1, verbose=0),
                           "fit with jit_compile=True", contains=("jit_compile=False", "XLA"))
        print(f"jit error: {e}", flush=True)
        v = variable(np.ones(3))
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR))
        opt.build([v])
        fn = tf.function(lambda g: opt.apply_gradients([(g, v)]), jit_compile=True)
        self.ck.raises(ValueError, lambda: fn(tf.ones(3, tf.float64)),
                       "tf.function(jit_compile=True)", contains=("jit_compile=False",))
        fn2 = tf.function(lambda g: opt.apply_gradients([(g, v)]))
        fn2(tf.ones(3, tf.float64))  # the same optimizer works without XLA
        self.close(npy(v), np.ones(3) - LR, "apply without XLA after the error")

    def ops(self):
        """Keras-level value ops (NumPy in and out) and broadcast_global_variables."""
        r, n = self.r, self.n
        x = np.arange(6, dtype=np.float64).reshape(3, 2) * (r + 1)
        tri = sum(range(1, n + 1))
        self.close(hvd.allreduce(x), np.arange(6).reshape(3, 2) * tri / n, "allreduce averages")
        self.close(hvd.allreduce(x, op=hvd.Sum), np.arange(6).reshape(3, 2) * tri, "Sum")
        self.close(hvdk.allreduce(x), np.arange(6).reshape(3, 2) * tri / n,
                   "ferrovod.keras.allreduce averages by default")
        self.close(hvdk.allreduce(x, op=hvdk.Sum), np.arange(6).reshape(3, 2) * tri,
                   "ferrovod.keras.allreduce with op=Sum")
        self.close(hvdk.allreduce(x, average=False), np.arange(6).reshape(3, 2) * tri,
                   "ferrovod.keras.allreduce(average=False)")
        if tf is not None:  # ferrovod.tensorflow.keras returns tensors eagerly, as Horovod's did
            for what, out in (("allreduce", hvd.allreduce(x)), ("allgather", hvd.allgather(x)),
                              ("broadcast", hvd.broadcast(x, 0)),
                              ("reducescatter", hvd.reducescatter(x))):
                self.ck.true(isinstance(out, tf.Tensor), f"{what} returns a tf.Tensor",
                             f"got {type(out)}")
        got = np.asarray(hvd.allreduce(x, compression=hvd.Compression.fp16))
        self.ck.true(got.dtype == np.float64, "compressed allreduce keeps the dtype")
        self.close(got, np.arange(6).reshape(3, 2) * tri / n, "fp16 allreduce", tol=1e-2)
        self.ck.array(np.asarray(hvd.allreduce(np.int32(r + 1), op=hvd.Sum)), np.array(tri, np.int32),
                      "0-d int allreduce stays 0-d")
        self.ck.array(np.asarray(hvd.allgather(np.full((r + 1, 2), r, np.int64))),
                      np.concatenate([np.full((q + 1, 2), q, np.int64) for q in range(n)]),
                      "allgather")
        self.ck.array(np.asarray(hvd.broadcast(np.full(4, r, np.float32), n - 1)),
                      np.full(4, n - 1, np.float32),
                      "broadcast")
        rows = np.stack([np.full(3, float(q)) for q in range(2 * n)]) * (r + 1)
        self.close(hvd.reducescatter(rows, op=hvd.Sum),
                   np.stack([np.full(3, float(q)) for q in range(2 * n)])[2 * r:2 * r + 2] * tri,
                   "reducescatter")
        model = make_model()
        set_weights(model, self.seed + 10 + r)
        hvd.broadcast_global_variables(0, model)
        ref = make_model()
        set_weights(ref, self.seed + 10)
        self.close(flat(model), flat(ref), "broadcast_global_variables(0, model)", tol=0)
        self.ck.raises(ValueError, lambda: hvd.broadcast_global_variables(0),
                       "broadcast_global_variables without a model", contains=("model",))
        self.elastic()

    def elastic(self):
        """hvd.elastic.KerasState and its callbacks (part of the "ops" section)."""
        r = self.r
        self.ck.true(hvdk.elastic.KerasState is hvd.elastic.KerasState,
                     "ferrovod.keras.elastic and ferrovod.tensorflow.keras.elastic agree")
        model = make_model()
        set_weights(model, self.seed + 20 + r)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR, momentum=0.9)),
                      loss="mse")
        state = hvd.elastic.KerasState(model, batch=r, epoch=0)
        state.sync()
        ref = make_model()
        set_weights(ref, self.seed + 20)
        self.close(flat(model), flat(ref), "KerasState.sync: rank 0's weights", tol=0)
        self.ck.equal((state.batch, state.epoch), (0, 0), "KerasState.sync: rank 0's attributes")
        x, y = data(self.seed, r)
        callbacks = [hvd.elastic.UpdateBatchStateCallback(state),
                     hvd.elastic.UpdateEpochStateCallback(state),
                     hvd.elastic.CommitStateCallback(state, batches_per_commit=2)]
        model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
        self.ck.equal((state.batch, state.epoch), (0, 2), "state callbacks: batch, epoch after fit")
        trained = flat(model)
        slots = [npy(v).copy() for v in model.optimizer.variables]
        set_weights(model, self.seed + 21)
        for v in model.optimizer.variables:
            v.assign(np.zeros_like(npy(v)))
        state.epoch = 99
        state.restore()
        self.close(flat(model), trained, "KerasState.restore: weights of the last commit", tol=0)
        for i, (v, want) in enumerate(zip(model.optimizer.variables, slots)):
            self.close(npy(v), want, f"KerasState.restore: optimizer variable {i}", tol=0)
        self.ck.equal(state.epoch, 2, "KerasState.restore: attributes")
        self.same_on_all_ranks(trained, "weights identical after elastic fit")

    def keras2(self):
        """Keras 2 only: legacy optimizers under fit (with the warm-up's momentum correction
        on their slots), and every custom-loop entry reducing each update exactly once."""
        s, n = self.seed + 5, self.n
        legacy = keras.optimizers.legacy
        for label, make in (("legacy SGD+momentum", lambda: legacy.SGD(LR, momentum=0.9)),
                            ("legacy Adam", lambda: legacy.Adam(0.01))):
            model = make_model()
            set_weights(model, s + self.r)
            model.compile(optimizer=hvd.DistributedOptimizer(make()), loss="mse",
                          metrics=["mae"])
            warm = lambda: hvd.callbacks.LearningRateWarmupCallback(  # noqa: E731
                initial_lr=float(npy(model.optimizer.learning_rate)), warmup_epochs=1)
            x, y = data(s, self.r)
            model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[
                hvd.callbacks.BroadcastGlobalVariablesCallback(0), warm()])
            ref = make_model()
            set_weights(ref, s)
            ref.compile(optimizer=make(), loss="mse", metrics=["mae"])
            # The schedule callback runs no collective: the same one drives the reference.
            self.reference_fit(s, epochs=2, model=ref, callbacks=[warm()])
            self.close(flat(model), flat(ref), f"{label}: fit with warm-up == reference")
            self.same_on_all_ranks(flat(model), f"{label}: weights identical on all ranks")
            self.ck.true(type(model.optimizer).__module__.startswith("tf_keras"),
                         f"{label}: the wrapper keeps the Keras 2 class's module")

        # A model given no input shape (Horovod's examples): Keras 2 builds it in the first
        # batch, after train begin; the callback sends everything at that batch's end.
        keras.utils.set_random_seed(s + self.r)  # each rank initialises its own weights
        model = keras.Sequential([keras.layers.Dense(HID, activation="tanh"),
                                  keras.layers.Dense(DOUT)])
        model.compile(optimizer=hvd.DistributedOptimizer(legacy.SGD(LR, momentum=0.9)),
                      loss="mse")
        x, y = data(s, self.r)
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                             hvd.callbacks.LearningRateWarmupCallback(LR, warmup_epochs=1)])
        self.same_on_all_ranks(flat(model), "unbuilt model: weights identical after fit")
        slots = np.concatenate([npy(v).ravel() for v in model.optimizer.variables()])
        self.same_on_all_ranks(slots, "unbuilt model: optimizer slots identical after fit")
        keras.utils.set_random_seed(self.seed)

        # SyncBatchNormalization is a Keras 2 layer here: statistics of every rank's batch.
        xs = [rng(s, q, 30).standard_normal((q + 2, 3)) * (q + 1) for q in range(n)]
        allx = np.concatenate(xs)
        for graph in (False, True):
            layer = hvd_tf.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
            self.ck.true(isinstance(layer, keras.layers.BatchNormalization),
                         "SyncBatchNormalization is a tf_keras layer")
            layer.build((None, 3))
            fn = (lambda x: layer(x, training=True))
            out = (tf.function(fn) if graph else fn)(tf.constant(xs[self.r]))
            what = f"SyncBatchNormalization graph={graph}"
            self.close(npy(out), (xs[self.r] - allx.mean(0)) / np.sqrt(allx.var(0) + 1e-3),
                       f"{what}: output", tol=1e-6)
            self.close(npy(layer.moving_mean), 0.5 * allx.mean(0), f"{what}: moving mean",
                       tol=1e-9)

        self.ck.true("keras" not in sys.modules, "Keras 3 never imported by a Keras 2 job",
                     "ferrovod (or the test) imported the keras package")

        # Custom loops with op=Sum, where a second reduction would show (Average hides it).
        c = {r: rng(s, r, 9).standard_normal(4) for r in range(n)}
        total = sum(c.values())
        entries = ["tape+apply_gradients", "minimize", "_compute_gradients+apply_gradients",
                   "compute_gradients+apply_gradients"]
        for make in (lambda: keras.optimizers.SGD(LR), lambda: legacy.SGD(LR)):
            for entry in entries:
                for graph in (False, True):
                    kind = "legacy" if ".legacy." in type(make()).__module__ else "current"
                    if entry == "compute_gradients+apply_gradients" and kind == "legacy":
                        continue  # legacy OptimizerV2 has no public compute_gradients
                    w = variable(np.ones(4))
                    opt = hvd.DistributedOptimizer(make(), op=hvd.Sum)
                    mine = tf.constant(c[self.r])

                    def loss():
                        return tf.reduce_sum(w * mine)

                    def step():
                        if entry == "tape+apply_gradients":
                            with tf.GradientTape() as tape:
                                value = loss()
                            opt.apply_gradients(zip(tape.gradient(value, [w]), [w]))
                        elif entry == "minimize":
                            opt.minimize(loss, [w])
                        else:
                            compute = getattr(opt, entry.split("+")[0])
                            opt.apply_gradients(compute(loss, [w]))

                    (tf.function(step) if graph else step)()
                    (tf.function(step) if graph else step)()
                    what = f"{kind} {entry} graph={graph}"
                    lr = float(npy(opt.learning_rate))  # a legacy one keeps it in float32
                    self.close(npy(w), np.ones(4) - 2 * lr * total, f"{what}: reduced once")

    def mismatch(self):
        """A rank whose model differs: every rank gets the same clear ValueError, no hang."""
        odd = self.r == self.n - 1
        x, y = data(self.seed, self.r)
        model = make_model(5 if odd else HID)
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
        e = self.ck.raises(ValueError, lambda: model.fit(x, y, batch_size=B, verbose=0),
                           "fit with a different model on one rank",
                           contains=("different variables", f"rank {self.n - 1}"))
        # Keras 2 puts "in user code:" and a traceback before the message of a traced step.
        print(f"error: {str(e).strip().splitlines()[-1].strip()}", flush=True)
        model = make_model(5 if odd else HID)
        model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
        self.ck.raises(ValueError, lambda: model.fit(
            x, y, batch_size=B, verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]),
            "broadcast callback with a different model", contains=("different variables",))
        cb = hvd.callbacks.MetricAverageCallback()
        logs = {"loss": 1.0, ("acc" if odd else "mae"): 2.0}
        self.ck.raises(ValueError, lambda: cb.on_epoch_end(0, logs), "different metric names",
                       contains=("different metrics",))
        self.ck.equal(float(np.asarray(hvd.allreduce(np.ones(1), op=hvd.Sum))[0]), float(self.n),
                      "the job still works afterwards")


def main():
    seed, tmpdir = int(sys.argv[1]), sys.argv[2]
    hvd.init()
    run = Run(seed, tmpdir)
    keras.utils.set_random_seed(seed)
    names = ["fit", "warmup", "bpps", "options", "sparse"] + (["jit"] if tf is not None else []) + \
        ["ops"] + (["keras2"] if KERAS2 else []) + (["mismatch"] if hvd.size() > 1 else [])
    for name in names:
        before = run.ck.count
        getattr(run, name)()
        print(f"section {name}: {run.ck.count - before} checks", flush=True)
    hvd.shutdown()
    return run.ck.count


if __name__ == "__main__":
    T.run_main(main)
