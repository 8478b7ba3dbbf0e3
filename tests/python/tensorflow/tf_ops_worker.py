"""ferrovod.tensorflow ops, their gradients and DistributedGradientTape against NumPy
references, eagerly and inside tf.function, in one launch.

usage: tf_ops_worker.py SEED

Every rank regenerates every rank's input from the seed (fvtest.gen), so the expected values
never go through ferrovod. Each section runs twice, in mode ``eager`` and in mode ``graph``
(the same code inside one ``tf.function``, so many collectives share one graph). Sections:
allreduce, grouped, allgather, broadcast, alltoall, reducescatter, misc, gradients, tape,
optimizer, syncbn, psets, tf1 (TF1 graphs in a Session, once) and elastic (once; it ends by
re-initializing ferrovod). Prints ``section <name>: <n> checks`` after each and
``OK <n_checks>``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fvtest as T  # noqa: E402
from fvtest import AVERAGE, MAX, MIN, PRODUCT, SUM  # noqa: E402

import ferrovod.tensorflow as hvd  # noqa: E402

OPS = {SUM: hvd.Sum, AVERAGE: hvd.Average, MIN: hvd.Min, MAX: hvd.Max, PRODUCT: hvd.Product}
SHAPES = [(), (0,), (7,), (3, 5)]
MODES = ("eager", "graph")
F64 = np.float64
# allgather, broadcast and alltoall move bytes: also the unsigned types no reduction takes
MOVE_DTYPES = T.ALL_DTYPES + [np.dtype(t) for t in ("uint16", "uint32", "uint64")]


def const(a):
    return tf.constant(np.asarray(a))


def run(mode, fn, *args):
    """``fn(*args)`` now, or traced into one tf.function and run once."""
    if mode == "eager":
        return fn(*args)
    return tf.function(fn, autograph=False)(*args)


class Ctx(T.Cases):
    def __init__(self, seed):
        super().__init__(seed, hvd.rank(), hvd.size())

    def close(self, got, exp, what, tol=1e-5):
        """float32 arithmetic against a float64 reference: values within ``tol``."""
        got, exp = np.asarray(got, np.float64), np.asarray(exp, np.float64)
        self.ck.equal(got.shape, exp.shape, f"{what}: shape")
        self.ck.true(np.allclose(got, exp, rtol=tol, atol=tol), what,
                     f"max difference {np.max(np.abs(got - exp)) if got.size else 0}")

    def tensor(self, got, exp, what):
        """``got`` must be a tf.Tensor equal to the NumPy ``exp`` (dtype, shape, values)."""
        self.ck.true(isinstance(got, tf.Tensor), what, f"result is {type(got).__name__}")
        self.ck.array(np.asarray(got.numpy()), np.asarray(exp), what)


# ---------------------------------------------------------------------------------------------
def sec_allreduce(c, mode):
    cases = []
    for dt in T.REDUCE_DTYPES:
        for opn in T.REDUCE_OPS:
            for shape in SHAPES:
                xs = c.inputs(c.key(), dt, shape, T.input_mode(opn, dt))
                cases.append((xs, opn, dt, shape))
    scaled = []
    for dt in (np.float32, np.float64, T.BF16, np.float16, np.int32, np.int64):
        mode_ = "normal" if T.is_float(np.dtype(dt)) else "tiny"
        scaled.append((c.inputs(c.key(), dt, (9,), mode_), dt))
    static = {}

    def body(ts, ss):
        outs = [hvd.allreduce(t, op=OPS[opn]) for t, (_, opn, _, _) in zip(ts, cases)]
        static["first"] = [o.shape for o in outs]
        more = []
        for s in ss:
            more.append(hvd.allreduce(s, average=False, prescale_factor=0.5, postscale_factor=3.0))
            more.append(hvd.allreduce(s, op=hvd.Average, prescale_factor=2.0, postscale_factor=0.5))
            more.append(hvd.allreduce(s))  # default: Average
            more.append(hvd.allreduce(s, average=True, name=None))
        return outs, more

    outs, more = run(mode, body, [const(xs[c.rank]) for xs, *_ in cases],
                     [const(xs[c.rank]) for xs, _ in scaled])
    for out, shp, (xs, opn, dt, shape) in zip(outs, static["first"], cases):
        what = f"{mode} allreduce {dt} {opn} {shape}"
        c.tensor(out, T.ref_reduce(xs, opn, dt, c.n), what)
        c.ck.equal(tuple(shp), shape, f"{what}: static shape")
    for i, (xs, dt) in enumerate(scaled):
        got = more[4 * i:4 * i + 4]
        c.tensor(got[0], T.ref_reduce(xs, SUM, dt, c.n, pre=0.5, post=3.0), f"{mode} {dt} Sum scaled")
        c.tensor(got[1], T.ref_reduce(xs, AVERAGE, dt, c.n, pre=2.0, post=0.5),
                 f"{mode} {dt} Average scaled")
        c.tensor(got[2], T.ref_reduce(xs, AVERAGE, dt, c.n), f"{mode} {dt} default op")
        c.tensor(got[3], T.ref_reduce(xs, AVERAGE, dt, c.n), f"{mode} {dt} average=True")
    # compression: fp16 on the wire, the input's dtype back
    xs = c.inputs(c.key(), np.float32, (4, 3))
    ys = c.inputs(c.key(), np.float64, (5,))
    got = run(mode, lambda a, b: [hvd.allreduce(a, compression=hvd.Compression.fp16),
                                  hvd.allreduce(b, op=hvd.Sum, compression=hvd.Compression.fp16),
                                  hvd.allreduce(a, compression=hvd.Compression.bf16)],
              const(xs[c.rank]), const(ys[c.rank]))
    exp = T.ref_reduce([x.astype(np.float16) for x in xs], AVERAGE, np.float16, c.n)
    c.ck.equal(got[0].dtype, tf.float32, f"{mode} fp16 compression keeps float32")
    c.ck.array(got[0].numpy().astype(np.float16), exp, f"{mode} fp16-compressed allreduce")
    exp = T.ref_reduce([y.astype(np.float16) for y in ys], SUM, np.float16, c.n)
    c.ck.array(got[1].numpy().astype(np.float16), exp, f"{mode} fp16-compressed Sum float64")
    exp = T.ref_reduce([x.astype(T.BF16) for x in xs], AVERAGE, T.BF16, c.n)
    c.ck.array(got[2].numpy().astype(T.BF16), exp, f"{mode} bf16-compressed allreduce")
    # IndexedSlices: allgather of values and indices; Average divides the values
    k = c.key()
    vals = c.inputs(k, np.float32, (2, 3))
    idx = [np.array([j % 4, (2 * j + 1) % 4], dtype=np.int64) for j in range(c.n)]

    def sparse(v, i):
        s = tf.IndexedSlices(v, i, dense_shape=tf.constant([4, 3], tf.int64))
        a, b = hvd.allreduce(s, op=hvd.Average), hvd.allreduce(s, op=hvd.Sum, name="sparse.sum")
        return a.values, a.indices, b.values, tf.convert_to_tensor(b)

    av, ai, bv, dense = run(mode, sparse, const(vals[c.rank]), const(idx[c.rank]))
    c.tensor(av, np.concatenate(vals) / np.float32(c.n), f"{mode} IndexedSlices Average values")
    c.tensor(ai, np.concatenate(idx), f"{mode} IndexedSlices indices")
    c.tensor(bv, np.concatenate(vals), f"{mode} IndexedSlices Sum values")
    exp = np.zeros((4, 3), np.float64)
    for v, i in zip(vals, idx):
        np.add.at(exp, i, v.astype(np.float64))
    c.tensor(dense, exp.astype(np.float32), f"{mode} IndexedSlices Sum densified")
    # errors, raised at once (eager) or when traced (graph)
    ck = c.ck
    # Refused by this rank through the engine (so that every rank fails it): TensorFlow's
    # InvalidArgumentError, eagerly also ferrovod's.
    ck.raises(tf.errors.InvalidArgumentError,
              lambda: run(mode, lambda: hvd.allreduce(tf.constant([1 + 2j], tf.complex64), name="cx")),
              f"{mode} complex dtype", contains=("complex64", "cx"))
    ck.raises(tf.errors.InvalidArgumentError,
              lambda: run(mode, lambda: hvd.allreduce(tf.constant(["a"]))),
              f"{mode} string dtype", contains=("string",))
    ck.raises(ValueError, lambda: run(mode, lambda: hvd.allreduce(tf.ones(2), average=True,
                                                                 op=hvd.Sum)),
              f"{mode} average and op together")
    # Adasum: the published recurrence on power-of-two sets (one per tensor of a group),
    # refused with a message on the others
    xs = c.inputs(c.key(), np.float64, (5, 3))
    ys = c.inputs(c.key(), np.float32, (7,))
    if c.n & (c.n - 1):
        ck.raises(tf.errors.InvalidArgumentError,
                  lambda: run(mode, lambda: hvd.allreduce(tf.ones(2), op=hvd.Adasum)),
                  f"{mode} Adasum on {c.n} ranks", contains=("power-of-two",))
    else:
        got = run(mode, lambda a: hvd.allreduce(a, op=hvd.Adasum), const(xs[c.rank]))
        c.close(got.numpy(), T.ref_adasum(xs, np.float64), f"{mode} Adasum", 1e-12)
        ga, gb = run(mode, lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Adasum),
                     const(xs[c.rank]), const(ys[c.rank]))
        c.close(ga.numpy(), T.ref_adasum(xs, np.float64), f"{mode} grouped Adasum #1", 1e-12)
        c.close(gb.numpy(), T.ref_adasum(ys, np.float32), f"{mode} grouped Adasum #2", 1e-5)
    # Average of IndexedSlices divides with TensorFlow's true division, as Horovod does:
    # integer values come back as floats (int8 -> float32, int32 -> float64)
    kinds = [(np.int8, np.float32), (np.int32, np.float64), (np.float16, np.float16),
             (np.float64, np.float64)]
    sp_cases = [(c.inputs(c.key(), dt, (2, 3), "tiny"), odt) for dt, odt in kinds]

    def sparse_avg(vs):
        out = []
        for v in vs:
            s = tf.IndexedSlices(v, tf.constant([0, 1], tf.int64), tf.constant([2, 3], tf.int64))
            out.append(hvd.allreduce(s, op=hvd.Average).values)
        g = hvd.grouped_allreduce([tf.IndexedSlices(vs[0], tf.constant([1, 0], tf.int64)),
                                   tf.cast(vs[1], tf.float32)], op=hvd.Average)
        return out, g[0].values, g[1]

    got, grouped_sparse, grouped_dense = run(mode, sparse_avg,
                                             [const(x[c.rank]) for x, _ in sp_cases])
    for g, (xs, odt) in zip(got, sp_cases):
        what = f"{mode} IndexedSlices Average {xs[0].dtype}"
        ck.equal(g.dtype.as_numpy_dtype, odt, f"{what}: dtype")
        c.close(g.numpy(), np.concatenate(xs).astype(np.float64) / c.n, what,
                1e-2 if odt == np.float16 else 1e-6)
    xs = sp_cases[0][0]
    c.close(grouped_sparse.numpy(), np.concatenate(xs).astype(np.float64) / c.n,
            f"{mode} grouped_allreduce mixed: sparse int8 Average")
    c.close(grouped_dense.numpy(), np.mean([x.astype(np.float64) for x in sp_cases[1][0]], 0),
            f"{mode} grouped_allreduce mixed: dense Average")
    sl = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([0]), tf.constant([2, 2]))
    for what, fn in [("Max", lambda: hvd.allreduce(sl, op=hvd.Max)),
                     ("Min", lambda: hvd.allreduce(sl, op=hvd.Min)),
                     ("Product", lambda: hvd.allreduce(sl, op=hvd.Product)),
                     ("Adasum", lambda: hvd.allreduce(sl, op=hvd.Adasum)),
                     ("prescale", lambda: hvd.allreduce(sl, op=hvd.Sum, prescale_factor=0.5)),
                     ("postscale", lambda: hvd.allreduce(sl, average=False, postscale_factor=2.0)),
                     ("grouped Adasum", lambda: hvd.grouped_allreduce([sl, tf.ones(2)],
                                                                      op=hvd.Adasum)),
                     ("grouped Max", lambda: hvd.grouped_allreduce([tf.ones(2), sl], op=hvd.Max))]:
        ck.raises(NotImplementedError, fn, f"{mode} IndexedSlices {what}")


def sec_grouped(c, mode):
    cases = []
    for dt in (np.int32, np.float16, T.BF16, np.float32, np.float64):
        k = c.key()
        shapes = [(5,), (2, 3), (), (0,)]
        xs = [[T.gen(k + (i,), j, dt, s, T.input_mode(SUM, dt), c.n) for j in range(c.n)]
              for i, s in enumerate(shapes)]
        cases.append(xs)
    mixed = [c.inputs(c.key(), np.float32, (3,)), c.inputs(c.key(), np.int64, (2, 2))]

    def body(groups, m):
        outs = [hvd.grouped_allreduce(g, op=hvd.Sum) for g in groups]
        outs.append(hvd.grouped_allreduce(m, name="grouped.mixed", op=hvd.Max))
        outs.append(hvd.grouped_allreduce(m[:1], compression=hvd.Compression.fp16))
        return outs

    outs = run(mode, body, [[const(x[c.rank]) for x in xs] for xs in cases],
               [const(m[c.rank]) for m in mixed])
    for xs, got in zip(cases, outs):
        for i, (x, g) in enumerate(zip(xs, got)):
            c.tensor(g, T.ref_reduce(x, SUM, x[0].dtype, c.n), f"{mode} grouped {x[0].dtype} #{i}")
    for i, m in enumerate(mixed):
        c.tensor(outs[len(cases)][i], T.ref_reduce(m, MAX, m[0].dtype, c.n),
                 f"{mode} grouped mixed dtypes #{i}")
    exp = T.ref_reduce([x.astype(np.float16) for x in mixed[0]], AVERAGE, np.float16, c.n)
    c.ck.array(outs[-1][0].numpy().astype(np.float16), exp, f"{mode} grouped fp16")


def gather_inputs(c, k, dt, tail):
    return [T.gen(k, j, dt, (j + 1,) + tail) for j in range(c.n)]


def sec_allgather(c, mode):
    cases = []
    for dt in MOVE_DTYPES:
        for tail in [(), (3, 2)]:
            cases.append(gather_inputs(c, c.key(), dt, tail))
    k = c.key()
    ga, gb = gather_inputs(c, k, np.float32, (2,)), gather_inputs(c, k + (1,), np.bool_, ())
    static = []

    def body(ts, a, b):
        outs = [hvd.allgather(t) for t in ts]
        static.extend(o.shape for o in outs)
        return outs, hvd.grouped_allgather([a, b])

    outs, grouped = run(mode, body, [const(xs[c.rank]) for xs in cases], const(ga[c.rank]),
                        const(gb[c.rank]))
    for xs, out, shp in zip(cases, outs, static):
        what = f"{mode} allgather {xs[0].dtype} {xs[0].shape[1:]}"
        c.tensor(out, np.concatenate(xs), what)
        if mode == "graph":
            c.ck.equal(shp.as_list(), [None] + list(xs[0].shape[1:]), f"{what}: static shape")
    c.tensor(grouped[0], np.concatenate(ga), f"{mode} grouped_allgather #0")
    c.tensor(grouped[1], np.concatenate(gb), f"{mode} grouped_allgather #1")
    c.ck.raises(tf.errors.InvalidArgumentError, lambda: run(mode, lambda: hvd.allgather(tf.constant(1.0))),
                f"{mode} allgather of a 0-d tensor", contains=("0-d",))


def sec_broadcast(c, mode):
    cases = []
    for dt in MOVE_DTYPES:
        for root in range(c.n):
            cases.append((c.inputs(c.key(), dt, (4, 3)), root))
    scalar = c.inputs(c.key(), np.float64, ())
    outs = run(mode, lambda ts, s: ([hvd.broadcast(t, root) for t, (_, root) in zip(ts, cases)],
                                    hvd.broadcast(s, c.n - 1)),
               [const(xs[c.rank]) for xs, _ in cases], const(scalar[c.rank]))
    for (xs, root), out in zip(cases, outs[0]):
        c.tensor(out, xs[root], f"{mode} broadcast {xs[0].dtype} root {root}")
    c.tensor(outs[1], scalar[c.n - 1], f"{mode} broadcast 0-d")
    # variables: broadcast_ and broadcast_variables (tf.Variable and Keras variables)
    import keras

    root = c.n - 1
    ins = [c.inputs(c.key(), dt, s) for dt, s in ((np.float32, (3, 2)), (np.int64, (4,)),
                                                  (np.bool_, (2,)), (T.BF16, ()),
                                                  (np.uint16, (3,)), (np.uint64, (2,)))]
    tfv = [tf.Variable(x[c.rank]) for x in ins]
    kv = [keras.Variable(ins[0][c.rank]), keras.Variable(ins[1][c.rank])]
    more = c.inputs(c.key(), np.float32, (5,))
    mv = tf.Variable(more[c.rank])

    def body():
        hvd.broadcast_(tfv, root)
        hvd.broadcast_variables(kv, root_rank=root)
        hvd.broadcast_variables([mv], root_rank=0, inplace=True)
        return tf.constant(0)

    run(mode, body)
    for x, v in zip(ins, tfv):
        c.tensor(tf.convert_to_tensor(v), x[root], f"{mode} broadcast_ {x[0].dtype}")
    for x, v in zip(ins, kv):
        c.tensor(tf.convert_to_tensor(v), x[root], f"{mode} broadcast_variables keras {x[0].dtype}")
    c.tensor(tf.convert_to_tensor(mv), more[0], f"{mode} broadcast_variables inplace")
    c.ck.raises((ValueError, tf.errors.InvalidArgumentError), lambda: run(mode, lambda: hvd.broadcast(tf.ones(1), c.n)),
                f"{mode} broadcast root out of range")


def sec_alltoall(c, mode):
    n = c.n
    cases = []
    for dt in MOVE_DTYPES:
        k = c.key()
        sp = [[(i + 2 * j + k[1]) % 3 for j in range(n)] for i in range(n)]  # rank i -> rank j
        xs = [T.gen(k, i, dt, (sum(sp[i]), 2)) for i in range(n)]
        offs = [np.concatenate([[0], np.cumsum(s)]) for s in sp]
        exp = np.concatenate([xs[i][offs[i][c.rank]:offs[i][c.rank] + sp[i][c.rank]]
                              for i in range(n)])
        eq = c.inputs(c.key(), dt, (2 * n, 3))
        eq_exp = np.concatenate([eq[i][2 * c.rank:2 * c.rank + 2] for i in range(n)])
        cases.append((xs, sp, exp, eq, eq_exp))

    def body(ts, splits, eqs):
        outs = []
        for t, s, e, (_, sp, _, _, _) in zip(ts, splits, eqs, cases):
            out, rec = hvd.alltoall(t, splits=s)
            out2, _ = hvd.alltoall(t, splits=sp[c.rank])  # a Python list
            outs.append((out, rec, out2, hvd.alltoall(e)))
        return outs

    outs = run(mode, body, [const(xs[c.rank]) for xs, *_ in cases],
               [tf.constant(sp[c.rank], tf.int32) for _, sp, *_ in cases],
               [const(eq[c.rank]) for *_, eq, _ in cases])
    for (xs, sp, exp, _, eq_exp), (out, rec, out2, out3) in zip(cases, outs):
        what = f"{mode} alltoall {xs[0].dtype}"
        c.tensor(out, exp, what)
        c.tensor(rec, np.array([sp[i][c.rank] for i in range(n)], np.int32), f"{what} received")
        c.tensor(out2, exp, f"{what} list splits")
        c.tensor(out3, eq_exp, f"{what} equal split")
    if n > 1:
        e = c.ck.raises(tf.errors.InvalidArgumentError,
                        lambda: run(mode, lambda: hvd.alltoall(tf.ones([n + 1]), name="a2a.odd")),
                        f"{mode} alltoall indivisible", contains=("divisible",))
        if mode == "eager":  # eagerly also the ferrovod class
            c.ck.true(isinstance(e, hvd.InvalidArgumentError), "eager alltoall error class",
                      type(e).__mro__)


def sec_reducescatter(c, mode):
    n = c.n
    cases = []
    for dt in T.REDUCE_DTYPES:
        for opn in (SUM, AVERAGE):
            for d0 in (2 * n + 1, n):
                cases.append((c.inputs(c.key(), dt, (d0, 3), T.input_mode(opn, dt)), opn, d0))
    g = [(c.inputs(c.key(), dt, (2 * n, 2)), c.inputs(c.key(), dt, (n + 1,)))
         for dt in (np.float32, T.BF16)]

    def body(ts, gs):
        outs = [hvd.reducescatter(t, op=OPS[opn]) for t, (_, opn, _) in zip(ts, cases)]
        grouped = [hvd.grouped_reducescatter(list(p), op=hvd.Sum, prescale_factor=2.0,
                                             postscale_factor=0.25) for p in gs]
        return outs, grouped

    outs, grouped = run(mode, body, [const(xs[c.rank]) for xs, *_ in cases],
                        [(const(a[c.rank]), const(b[c.rank])) for a, b in g])
    for (xs, opn, d0), out in zip(cases, outs):
        s, cnt = T.split_rows(d0, n)[c.rank]
        full = T.ref_reduce(xs, opn, xs[0].dtype, n)
        c.tensor(out, full[s:s + cnt], f"{mode} reducescatter {xs[0].dtype} {opn} {d0}")
    for (a, b), (oa, ob) in zip(g, grouped):
        s, cnt = T.split_rows(2 * n, n)[c.rank]
        c.tensor(oa, T.ref_reduce(a, SUM, a[0].dtype, n, pre=2.0, post=0.25)[s:s + cnt],
                 f"{mode} grouped_reducescatter {a[0].dtype} #0")
        s, cnt = T.split_rows(n + 1, n)[c.rank]
        c.tensor(ob, T.ref_reduce(b, SUM, b[0].dtype, n, pre=2.0, post=0.25)[s:s + cnt],
                 f"{mode} grouped_reducescatter {b[0].dtype} #1")
    xs = c.inputs(c.key(), np.float32, (n, 2))
    got = run(mode, lambda t: hvd.reducescatter(t, op=hvd.Sum, compression=hvd.Compression.fp16),
              const(xs[c.rank]))
    exp = T.ref_reduce([x.astype(np.float16) for x in xs], SUM, np.float16, n)[c.rank:c.rank + 1]
    c.ck.equal(got.dtype, tf.float32, f"{mode} fp16 reducescatter keeps float32")
    c.ck.array(got.numpy().astype(np.float16), exp, f"{mode} fp16-compressed reducescatter")
    c.ck.raises((ValueError, tf.errors.InvalidArgumentError), lambda: run(mode, lambda: hvd.reducescatter(tf.ones(n), op=hvd.Max)),
                f"{mode} reducescatter Max", contains=("AVERAGE",))


def sec_misc(c, mode):
    ck, n, r = c.ck, c.n, c.rank

    def queries():
        return [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op(),
                hvd.process_set_included_op()]

    got = [int(t) for t in run(mode, queries)]
    ck.equal(got, [r, n, hvd.local_rank(), hvd.local_size(), 1], f"{mode} query ops")
    # join: rank 0 runs out of data first; the others' Sum allreduce sees zeros from it
    def with_join():
        if r == 0:
            return hvd.join(), tf.constant(-1.0)
        s = hvd.allreduce(tf.ones([3]), op=hvd.Sum, name="join.sum")
        return hvd.join(), s[0]

    last, s = run(mode, with_join)
    ck.true(0 <= int(last) < n, f"{mode} join returns a rank", f"got {int(last)}")
    if r != 0:
        ck.equal(float(s), float(n - 1), f"{mode} allreduce while rank 0 joined")
    lasts = hvd.allgather(tf.reshape(last, [1]), name=f"join.last.{mode}").numpy().tolist()
    ck.equal(lasts, [lasts[0]] * n, f"{mode} every rank gets the same last joined rank")
    run(mode, lambda: (hvd.barrier(), tf.constant(0))[1])
    ck.equal(hvd.barrier(), None, f"{mode} barrier returns None eagerly")
    # objects (host-side, any mode)
    obj = hvd.broadcast_object({"r": r, "a": np.arange(3)}, root_rank=n - 1)
    ck.equal(obj["r"], n - 1, "broadcast_object")
    ck.equal(hvd.allgather_object(r * 10), [q * 10 for q in range(n)], "allgather_object")
    fn = hvd.broadcast_object_fn(root_rank=0, name=f"bof.{mode}")
    ck.equal(fn(("x", r)), ("x", 0), "broadcast_object_fn")
    # names a Horovod script (or Horovod's own tests) reaches besides the collectives
    eager = run(mode, lambda: tf.constant(hvd._executing_eagerly()))
    ck.equal(bool(eager), mode == "eager", f"{mode} hvd._executing_eagerly")
    ck.equal(hvd.util._executing_eagerly(), True, "hvd.util._executing_eagerly")
    ck.equal(hvd.handle_average_backwards_compatibility(None, False), hvd.Sum,
             "handle_average_backwards_compatibility(average=False)")
    ck.equal(hvd.handle_average_backwards_compatibility(None, None), hvd.Average,
             "handle_average_backwards_compatibility default")
    ck.raises(ValueError, lambda: hvd.handle_average_backwards_compatibility(hvd.Sum, True),
              "handle_average_backwards_compatibility(op, average)")
    ck.equal([hvd.check_num_rank_power_of_2(k) for k in (1, 4, 6, 0)], [True, True, False, False],
             "check_num_rank_power_of_2")
    ck.equal(hvd.split_list(list(range(7)), 3), [[0, 1, 2], [3, 4], [5, 6]], "split_list")
    ck.equal(hvd.gpu_available("tensorflow"), bool(hvd.cuda_built() or hvd.rocm_built()),
             "gpu_available")
    from ferrovod.common.util import is_version_greater_equal_than

    ck.equal([is_version_greater_equal_than(v, "2.6.0") for v in ("2.16.1", "2.6.0", "2.5.3")],
             [True, True, False], "is_version_greater_equal_than")
    ck.raises(ValueError, lambda: is_version_greater_equal_than("2.6", "2.6"),
              "is_version_greater_equal_than needs major.minor.patch")
    xs = c.inputs(c.key(), np.float32, (n, 2))
    got = run(mode, lambda t: [hvd._allreduce(t), hvd._grouped_allreduce([t])[0],
                               hvd._reducescatter(t), hvd._grouped_reducescatter([t])[0],
                               hvd._allreduce_cond(t, op=hvd.Sum),
                               hvd._grouped_allreduce_cond([t], op=hvd.Max)[0]],
              const(xs[r]))
    total = T.ref_reduce(xs, SUM, np.float32, n)
    for i, what in enumerate(["_allreduce (Sum)", "_grouped_allreduce (Sum)"]):
        c.tensor(got[i], total, f"{mode} hvd.{what}")
    for i, what in enumerate(["_reducescatter (Sum)", "_grouped_reducescatter (Sum)"]):
        c.tensor(got[2 + i], total[r:r + 1], f"{mode} hvd.{what}")
    c.tensor(got[4], total if n > 1 else xs[r], f"{mode} hvd._allreduce_cond")
    c.tensor(got[5], T.ref_reduce(xs, MAX, np.float32, n) if n > 1 else xs[r],
             f"{mode} hvd._grouped_allreduce_cond")
    ck.true(issubclass(hvd.BroadcastGlobalVariablesHook, tf.compat.v1.train.SessionRunHook),
            "BroadcastGlobalVariablesHook is a SessionRunHook")


# ----------------------------------------------------------------------------- gradients
def sec_gradients(c, mode):
    n, r = c.n, c.rank
    k = c.key()
    xs, ws = c.inputs(k, F64, (4, 3)), c.inputs(k + (1,), F64, (4, 3))
    gx = [c.inputs(k + (2 + i,), F64, (3,)) for i in range(2)]
    gw = [c.inputs(k + (5 + i,), F64, (3,)) for i in range(2)]
    k = c.key()
    ag = gather_inputs(c, k, F64, (2,))
    tot = sum(j + 1 for j in range(n))
    agw = [T.gen(k + (1,), j, F64, (tot, 2)) for j in range(n)]
    k = c.key()
    bx, bw = c.inputs(k, F64, (5,)), c.inputs(k + (1,), F64, (5,))
    k = c.key()
    sp = [[(i + j + 1) % 3 for j in range(n)] for i in range(n)]
    ax = [T.gen(k, i, F64, (sum(sp[i]), 2)) for i in range(n)]
    recv_rows = [sum(sp[i][j] for i in range(n)) for j in range(n)]
    aw = [T.gen(k + (1,), j, F64, (recv_rows[j], 2)) for j in range(n)]
    k = c.key()
    d0 = 2 * n + 1
    rx = c.inputs(k, F64, (d0, 2))
    rw = [T.gen(k + (1,), j, F64, (T.split_rows(d0, n)[j][1], 2)) for j in range(n)]

    def body(x, w, g0, g1, w0, w1, a, aw_, b, bw_, at, atw, rt, rtw):
        srcs = [x, g0, g1, a, b, at, rt]
        with tf.GradientTape(persistent=True) as tape:
            for s in srcs:
                tape.watch(s)
            L = {}
            L["ar_sum"] = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0,
                                                      postscale_factor=0.5) * w)
            L["ar_avg"] = tf.reduce_sum(hvd.allreduce(x, op=hvd.Average, prescale_factor=2.0,
                                                      postscale_factor=0.5) * w)
            o0, o1 = hvd.grouped_allreduce([g0, g1], op=hvd.Sum)
            L["grouped"] = tf.reduce_sum(o0 * w0) + tf.reduce_sum(o1 * w1)
            L["ag"] = tf.reduce_sum(hvd.allgather(a) * aw_)
            q0, q1 = hvd.grouped_allgather([a, a[:, 0]])
            L["gag"] = tf.reduce_sum(q0 * aw_) + tf.reduce_sum(q1 * aw_[:, 1])
            L["bc"] = [tf.reduce_sum(hvd.broadcast(b, root) * bw_) for root in range(n)]
            out, _ = hvd.alltoall(at, splits=sp[r])
            L["a2a"] = tf.reduce_sum(out * atw)
            L["rs_sum"] = tf.reduce_sum(hvd.reducescatter(rt, op=hvd.Sum, prescale_factor=3.0,
                                                          postscale_factor=0.5) * rtw)
            L["rs_avg"] = tf.reduce_sum(hvd.grouped_reducescatter(
                [rt], op=hvd.Average, prescale_factor=3.0, postscale_factor=0.5)[0] * rtw)
            L["fp16"] = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum,
                                                    compression=hvd.Compression.fp16))
        G = {key: tape.gradient(L[key], x) for key in ("ar_sum", "ar_avg", "fp16")}
        G["grouped"] = tape.gradient(L["grouped"], [g0, g1])
        G["ag"] = tape.gradient(L["ag"], a)
        G["gag"] = tape.gradient(L["gag"], a)
        G["bc"] = [tape.gradient(v, b) for v in L["bc"]]
        G["a2a"] = tape.gradient(L["a2a"], at)
        G["rs_sum"] = tape.gradient(L["rs_sum"], rt)
        G["rs_avg"] = tape.gradient(L["rs_avg"], rt)
        return G

    G = run(mode, body, *[const(v[r]) for v in (xs, ws, gx[0], gx[1], gw[0], gw[1], ag, agw, bx,
                                                bw, ax, aw, rx, rw)])
    c.tensor(G["ar_sum"], np.sum(ws, 0), f"{mode} allreduce Sum grad")
    c.tensor(G["ar_avg"], np.sum(ws, 0) / n, f"{mode} allreduce Average grad")
    c.tensor(G["fp16"], np.full((4, 3), float(n)), f"{mode} fp16-compressed allreduce grad")
    for i in range(2):
        c.tensor(G["grouped"][i], np.sum(gw[i], 0), f"{mode} grouped_allreduce grad #{i}")
    start = sum(j + 1 for j in range(r))
    mean_w = (np.sum(agw, 0) / n)[start:start + r + 1]
    c.tensor(G["ag"], mean_w, f"{mode} allgather grad")
    exp = mean_w.copy()
    exp[:, 0] += mean_w[:, 1]
    c.tensor(G["gag"], exp, f"{mode} grouped_allgather grad")
    for root in range(n):
        exp = np.sum(bw, 0) / n if r == root else np.zeros(5)
        c.tensor(G["bc"][root], exp, f"{mode} broadcast grad root {root}")
    exp = np.concatenate([aw[j][sum(sp[i][j] for i in range(r)):][:sp[r][j]] for j in range(n)])
    c.tensor(G["a2a"], exp, f"{mode} alltoall grad")
    # Horovod's convention: Sum -> size x the allgathered gradient, Average -> 1 x
    c.tensor(G["rs_sum"], np.concatenate(rw) * 1.5 * n, f"{mode} reducescatter Sum grad")
    c.tensor(G["rs_avg"], np.concatenate(rw) * 1.5, f"{mode} grouped_reducescatter Average grad")


# ----------------------------------------------------------------------------- tape
def local_grads(x, t, idx, u, params):
    """Rank-local gradients of the test loss (plain TF, no ferrovod)."""
    W, b, E, unused = params
    with tf.GradientTape() as tape:
        y = tf.matmul(x, W) + b
        loss = tf.reduce_mean((y - t) ** 2) + tf.reduce_sum(tf.gather(E, idx) * u)
    return tape.gradient(loss, [W, b, E, unused])


def dense(g):
    return np.asarray(tf.convert_to_tensor(g).numpy(), dtype=np.float64)


def sec_tape(c, mode):
    n, r = c.n, c.rank
    k = c.key()
    X = c.inputs(k, np.float32, (6, 4))
    Y = c.inputs(k + (1,), np.float32, (6, 3))
    I = [np.array([j % 5, (j + 2) % 5, 4], np.int32) for j in range(n)]
    U = c.inputs(k + (2,), np.float32, (3, 2))
    init = [T.gen(k + (3 + i,), 0, np.float32, s) for i, s in enumerate([(4, 3), (3,), (5, 2), (2,)])]
    params = [tf.Variable(v, name=nm) for v, nm in zip(init, ["W", "b", "E", "unused"])]
    # the reference: every rank's local gradients from its regenerated data, densified
    per_rank = [[dense(g) if g is not None else None
                 for g in local_grads(const(X[j]), const(Y[j]), const(I[j]), const(U[j]), params)]
                for j in range(n)]
    mean = [np.mean([p[i] for p in per_rank], 0) for i in range(3)]
    total = [np.sum([p[i] for p in per_rank], 0) for i in range(3)]
    mine = per_rank[r]
    # and the same through ferrovod's allgather: every rank's local gradient as sent
    gathered = hvd.allgather(tf.reshape(tf.convert_to_tensor(mine[0]), [1, 4, 3]),
                             name=f"tape.gather.{mode}").numpy()
    for j in range(n):
        c.close(gathered[j], per_rank[j][0], f"{mode} rank {j}'s local gradient, gathered", 0)
    W, b, E, unused = params

    def step(x, t, idx, u):
        def loss_tape():
            tape = tf.GradientTape()
            with tape:
                y = tf.matmul(x, W) + b
                loss = tf.reduce_mean((y - t) ** 2) + tf.reduce_sum(tf.gather(E, idx) * u)
            return tape, loss

        out = {}
        tape, loss = loss_tape()
        out["avg"] = hvd.DistributedGradientTape(tape).gradient(loss, [W, b, E, unused])
        tape, loss = loss_tape()
        out["sum"] = hvd.DistributedGradientTape(tape, op=hvd.Sum, groups=2).gradient(
            loss, {"W": W, "b": b, "E": E})
        tape, loss = loss_tape()
        out["fp16"] = hvd.DistributedGradientTape(
            tape, compression=hvd.Compression.fp16, sparse_as_dense=True).gradient(loss, [W, b, E])
        tape, loss = loss_tape()
        out["groups"] = hvd.DistributedGradientTape(
            tape, groups=[[b, W]], gradient_predivide_factor=2.0).gradient(loss, [W, b, E])
        tape, loss = loss_tape()
        dt = hvd.DistributedGradientTape(tape)
        dt.register_local_source(b)
        out["local"] = dt.gradient(loss, [W, b])
        tape, loss = loss_tape()
        dt = hvd.DistributedGradientTape(tape, scale_local_gradients=False)
        dt.register_local_source(b)
        out["local_unscaled"] = dt.gradient(loss, [W, b])
        return out

    out = run(mode, step, const(X[r]), const(Y[r]), const(I[r]), const(U[r]))
    what = f"{mode} DistributedGradientTape"
    avg = out["avg"]
    c.tensor(avg[0], mean[0].astype(np.float32), f"{what} W = mean of ranks' gradients")
    c.tensor(avg[1], mean[1].astype(np.float32), f"{what} b")
    c.ck.true(isinstance(avg[2], tf.IndexedSlices), f"{what} E stays IndexedSlices")
    c.close(dense(avg[2]), mean[2], f"{what} E (sparse) densified")
    c.ck.equal(avg[3], None, f"{what} unused variable keeps a None gradient")
    c.ck.equal(sorted(out["sum"]), ["E", "W", "b"], f"{what} dict sources keep their structure")
    for i, key in enumerate(["W", "b", "E"]):
        c.close(dense(out["sum"][key]), total[i], f"{what} op=Sum groups=2 {key}")
    for i in range(3):
        c.ck.true(isinstance(out["fp16"][i], tf.Tensor), f"{what} sparse_as_dense gives tensors")
        c.close(out["fp16"][i].numpy(), mean[i], f"{what} fp16 #{i}", 1e-2)
        c.close(dense(out["groups"][i]), mean[i], f"{what} groups lists + predivide #{i}")
    c.close(dense(out["local"][0]), mean[0], f"{what} with a local source: W reduced")
    c.close(dense(out["local"][1]), mine[1] / n, f"{what} local source b: own gradient / n")
    c.close(dense(out["local_unscaled"][1]), mine[1], f"{what} local source unscaled")
    # PartialDistributedGradientTape: a Keras layer's weights stay local
    import keras

    layer = keras.layers.Dense(3, kernel_initializer="ones", bias_initializer="zeros")
    layer.build((None, 4))
    x = const(X[r])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x) * W[0]) + tf.reduce_sum(W)
    grads = hvd.PartialDistributedGradientTape(tape, local_layers=layer).gradient(
        loss, layer.trainable_weights + [W])
    wj = init[0][0]
    own_kernel = X[r].sum(0)[:, None] * wj[None, :]
    c.close(dense(grads[0]), own_kernel / n, f"{mode} PartialDistributedGradientTape local kernel")
    exp_w = np.ones((4, 3))
    exp_w[0] += np.mean([X[j].sum(0) @ np.ones((4, 3)) for j in range(n)], 0)
    c.close(dense(grads[2]), exp_w, f"{mode} PartialDistributedGradientTape global W")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(x) * W[0]) + tf.reduce_sum(W)
    ptape = hvd.PartialDistributedGradientTape(tape, local_layers=[layer])
    local, glob = ptape.get_local_and_global_gradients(loss, layer.trainable_weights + [W])
    c.ck.equal([id(v) for v, _ in local], [id(v) for v in layer.trainable_weights],
               f"{mode} get_local_and_global_gradients: local sources")
    c.ck.equal([id(v) for v, _ in glob], [id(W)], f"{mode} get_local_and_global_gradients: global")
    c.close(dense(local[0][1]), own_kernel / n, f"{mode} get_local_and_global_gradients local")
    c.close(dense(glob[0][1]), exp_w, f"{mode} get_local_and_global_gradients global")


def sec_optimizer(c, mode):
    """tf.compat.v1 optimizer: compute_gradients reduces (eager, callable loss; and graph)."""
    n, r = c.n, c.rank
    k = c.key()
    X = c.inputs(k, np.float32, (5, 3))
    w0 = T.gen(k + (1,), 0, np.float32, (3,))
    w = tf.Variable(w0)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5))
    c.ck.equal(type(opt).__name__, "_DistributedOptimizer", "legacy optimizer wrapped")
    x = const(X[r])

    def loss():
        return tf.reduce_sum(tf.linalg.matvec(x, w) ** 2)

    if mode == "eager":
        opt.minimize(loss, var_list=[w])
    else:
        tf.function(lambda: [opt.minimize(loss, var_list=[w])] and None, autograph=False)()
    grads = [2 * (X[j].astype(np.float64).T @ (X[j].astype(np.float64) @ w0)) for j in range(n)]
    c.close(w.numpy(), w0 - 0.5 * np.mean(grads, 0), f"{mode} legacy DistributedOptimizer.minimize step",
            1e-4)
    # backward_passes_per_step=2 (LocalGradientAggregationHelper): the first call only sums
    # locally (weights and step count as they were, the global step advanced), the second
    # reduces the sums and applies them
    for avg in (False, True):
        wb = tf.Variable(w0)
        gs = tf.Variable(0, dtype=tf.int64)
        bopt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                                        backward_passes_per_step=2,
                                        average_aggregated_gradients=avg)
        Xs = [c.inputs(c.key(), np.float32, (4, 3)) for _ in range(2)]
        for call, Xc in enumerate(Xs):
            xc = const(Xc[r])

            def bloss():
                return tf.reduce_sum(tf.linalg.matvec(xc, wb) ** 2)

            if mode == "eager":
                bopt.minimize(bloss, var_list=[wb], global_step=gs)
            else:
                tf.function(lambda: [bopt.minimize(bloss, var_list=[wb], global_step=gs)]
                            and None, autograph=False)()
            what = f"{mode} legacy backward_passes_per_step=2 avg={avg} call {call + 1}"
            c.ck.equal(int(gs.numpy()), call + 1, f"{what}: global step")
            if call == 0:
                c.close(wb.numpy(), w0, f"{what}: not applied yet", 0)
        total = sum(2 * (Xc[j].astype(np.float64).T @ (Xc[j].astype(np.float64) @ w0))
                    for Xc in Xs for j in range(n)) / n
        c.close(wb.numpy(), w0 - 0.5 * (total / 2 if avg else total), f"{what}: applied", 1e-4)
    c.ck.true(isinstance(bopt._agg_helper, hvd.LocalGradientAggregationHelper),
              "the legacy optimizer aggregates with LocalGradientAggregationHelper")
    if not n & (n - 1):
        # op=Adasum (Horovod's delta optimizer): each rank's local step, then the steps
        # combined by Adasum from the weights the step began at
        wa = tf.Variable(w0)
        aopt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.5),
                                        op=hvd.Adasum)

        def aloss():
            return tf.reduce_sum(tf.linalg.matvec(x, wa) ** 2)

        if mode == "eager":
            aopt.minimize(aloss, var_list=[wa])
        else:
            tf.function(lambda: [aopt.minimize(aloss, var_list=[wa])] and None,
                        autograph=False)()
        steps = [(-0.5 * g).astype(np.float32) for g in grads]
        c.close(wa.numpy(), w0 + T.ref_adasum(steps, np.float32),
                f"{mode} legacy DistributedOptimizer op=Adasum step", 1e-4)
    if mode == "eager":
        # a Keras optimizer goes to ferrovod.tensorflow.keras.DistributedOptimizer
        import keras

        kopt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
        c.ck.true(isinstance(kopt, keras.optimizers.SGD), "Keras optimizer forwarded",
                  type(kopt).__mro__)
        kv = keras.Variable(w0)
        kopt.apply_gradients([(tf.constant(np.float32(r + 1) * np.ones(3, np.float32)), kv)])
        c.close(kv.numpy(), w0 - 0.5 * (n + 1) / 2, "forwarded Keras optimizer averages")


def sec_syncbn(c, mode):
    """SyncBatchNormalization normalizes with the statistics of every rank's batch."""
    n, r = c.n, c.rank
    k = c.key()
    xs = [T.gen(k + (j,), 0, np.float32, (j + 2, 3)) * (j + 1) for j in range(n)]
    allx = np.concatenate(xs).astype(np.float64)
    mean, var = allx.mean(0), allx.var(0)
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    layer.build((None, 3))
    out = run(mode, lambda x: layer(x, training=True), const(xs[r]))
    c.close(out.numpy(), (xs[r] - mean) / np.sqrt(var + 1e-3), f"{mode} SyncBatchNormalization output",
            1e-4)
    c.close(layer.moving_mean.numpy(), 0.5 * mean, f"{mode} SyncBatchNormalization moving mean", 1e-5)
    c.close(layer.moving_variance.numpy(), 0.5 + 0.5 * var, f"{mode} moving variance", 1e-4)
    c.ck.raises(ValueError, lambda: hvd.SyncBatchNormalization(fused=True), "fused=True")


def sec_psets(c, mode):
    if c.n < 2:
        return
    evens = sorted(set(range(0, c.n, 2)))
    ps = PSETS["evens"]
    xs = c.inputs(c.key(), np.float32, (3,))
    if c.rank in evens:
        got = run(mode, lambda t: (hvd.allreduce(t, op=hvd.Sum, process_set=ps),
                                   hvd.size_op(process_set_id=ps.process_set_id)),
                  const(xs[c.rank]))
        c.tensor(got[0], T.ref_reduce([xs[j] for j in evens], SUM, np.float32, len(evens)),
                 f"{mode} allreduce in process set {evens}")
        c.ck.equal(int(got[1]), len(evens), f"{mode} size_op of a process set")
    inc = run(mode, lambda: hvd.process_set_included_op(ps.process_set_id))
    c.ck.equal(int(inc), int(c.rank in evens), f"{mode} process_set_included_op")

    # DistributedGradientTape on the set: its members average over it, the other ranks keep
    # their own gradient (Horovod's rule)
    def tape_grad(x):
        with tf.GradientTape() as g:
            g.watch(x)
            y = x * x
        return hvd.DistributedGradientTape(g, process_set=ps).gradient(y, [x])[0]

    got = run(mode, tape_grad, const(np.float32(c.rank + 1)))
    exp = 2.0 * np.mean([j + 1 for j in evens]) if c.rank in evens else 2.0 * (c.rank + 1)
    c.close(got.numpy(), np.float32(exp), f"{mode} DistributedGradientTape on a process set")
    # a set whose id was set by hand is refused where the op is made
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 1000
    c.ck.raises(ValueError, lambda: run(mode, lambda t: hvd.allreduce(t, process_set=fake),
                                        const(xs[c.rank])),
                f"{mode} an unregistered process set", contains=("not been registered",))


# ----------------------------------------------------------------------------- TF1 graphs
def sec_tf1(c, mode):
    """tf.compat.v1 graphs run in a Session, without tf.function's automatic control
    dependencies. Runs once (in the "graph" pass)."""
    if mode != "graph":
        return
    n, r, ck = c.n, c.rank, c.ck
    g = tf.Graph()
    # One inter-op thread: collectives that ran in no fixed order would deadlock at once.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
    with g.as_default(), tf.compat.v1.Session(graph=g, config=config) as sess:
        # many independent collectives in one run
        sums = [c.inputs(c.key(), dt, (3,)) for dt in (np.float32, np.int32, np.float64) * 3]
        gath = [gather_inputs(c, c.key(), dt, (2,)) for dt in (np.uint16, np.float32, np.bool_)]
        bcs = [c.inputs(c.key(), np.float32, (2,)) for _ in range(n)]
        outs = ([hvd.allreduce(const(x[r]), op=hvd.Sum) for x in sums]
                + [hvd.allgather(const(x[r])) for x in gath]
                + [hvd.broadcast(const(x[r]), root) for root, x in enumerate(bcs)])
        got = sess.run(outs)
        for i, x in enumerate(sums):
            ck.array(got[i], T.ref_reduce(x, SUM, x[0].dtype, n), f"tf1 one run: allreduce #{i}")
        for i, x in enumerate(gath):
            ck.array(got[len(sums) + i], np.concatenate(x), f"tf1 one run: allgather {x[0].dtype}")
        for root, x in enumerate(bcs):
            ck.array(got[len(sums) + len(gath) + root], x[root], f"tf1 one run: broadcast {root}")
        # build one more, run all built so far (Horovod's tests do this)
        xs = [c.inputs(c.key(), np.float32, (2,)) for _ in range(4)]
        fetches = []
        for i, x in enumerate(xs):
            fetches.append(hvd.allreduce(const(x[r]), op=hvd.Sum))
            vals = sess.run(fetches)
            for j in range(i + 1):
                ck.array(vals[j], T.ref_reduce(xs[j], SUM, np.float32, n),
                         f"tf1 cumulative run {i}: #{j}")
        # a broadcast's gradient on the ranks that are not the root is zero, but they still
        # take part in its allreduce
        bx, bw = c.inputs(c.key(), np.float32, (4,)), c.inputs(c.key(), np.float32, (4,))
        for root in range(n):
            x = const(bx[r])
            grad = tf.gradients(hvd.broadcast(x, root), x, const(bw[r]))[0]
            exp = np.mean(bw, 0) if r == root else np.zeros(4, np.float32)
            c.close(sess.run(grad), exp, f"tf1 broadcast grad root {root}")
        # a collective fed by a placeholder does not make a later one need the feed
        feed = tf.compat.v1.placeholder(tf.float32, [2])
        fed = hvd.allreduce(feed, op=hvd.Sum)
        v = tf.compat.v1.Variable(np.full(2, float(r), np.float32))
        bcast = hvd.broadcast_variables([v], root_rank=n - 1)
        sess.run(v.initializer)
        sess.run(bcast)
        ck.array(sess.run(v), np.full(2, float(n - 1), np.float32), "tf1 bcast without a feed")
        ck.array(sess.run(fed, {feed: np.ones(2, np.float32)}), np.full(2, float(n), np.float32),
                 "tf1 allreduce of a placeholder")
        if n > 1:
            # ranks that disagree: TensorFlow's FailedPreconditionError with ferrovod's message,
            # and the graph's later collectives still run
            bad = hvd.allreduce(tf.ones([3 + (r == n - 1)]), name="tf1.mismatch")
            ck.raises(tf.errors.FailedPreconditionError, lambda: sess.run(bad),
                      "tf1 mismatch", contains=("Mismatched", "tf1.mismatch"))
            after = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="tf1.after")
            ck.array(sess.run(after), np.full(2, float(n), np.float32), "tf1 after an error")
    # BroadcastGlobalVariablesHook: a MonitoredSession starts with the root's variables
    with tf.Graph().as_default():
        w = tf.compat.v1.Variable(np.full(3, float(r + 1), np.float32))
        hook = hvd.BroadcastGlobalVariablesHook(n - 1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as msess:
            ck.array(msess.run(w), np.full(3, float(n), np.float32), "BroadcastGlobalVariablesHook")


# ----------------------------------------------------------------------------- elastic
def sec_elastic(c, mode):
    """hvd.elastic: TensorFlowState / KerasState sync, restore, commit, and the run loop.
    Runs once (in the "eager" pass); its last check re-initializes ferrovod."""
    if mode != "eager":
        return
    n, r, ck = c.n, c.rank, c.ck
    import keras

    from ferrovod.common.elastic import HostUpdateResult, notify_hosts_updated, run_fn

    ws = [c.inputs(c.key(), np.float64, s) for s in ((2, 2), (3,))]
    variables = [tf.Variable(w[r]) for w in ws]
    state = hvd.elastic.TensorFlowState(variables, batch=20 + r, epoch=10 + r)
    state.sync()
    for w, v in zip(ws, variables):
        ck.array(v.numpy(), w[0], "TensorFlowState.sync: rank 0's variables")
    ck.equal((state.batch, state.epoch), (20, 10), "TensorFlowState.sync: rank 0's attributes")
    for v in variables:
        v.assign(v * 0 + 5.0)
    state.batch = 21
    state.restore()
    ck.array(variables[0].numpy(), ws[0][0], "TensorFlowState.restore")
    ck.equal(state.batch, 20, "TensorFlowState.restore attributes")
    for v in variables:
        v.assign(v * 0 + 5.0)
    state.batch = 22
    state.commit()
    variables[0].assign(variables[0] * 0)
    state.restore()
    ck.array(variables[0].numpy(), np.full((2, 2), 5.0), "TensorFlowState commit, restore")
    ck.equal(state.batch, 22, "TensorFlowState commit keeps attributes")
    # KerasState: the model's weights and the optimizer's slots, after one step
    model = keras.Sequential([keras.layers.Dense(2, kernel_initializer=keras.initializers.Constant(r + 1.0))])
    model.build((None, 3))
    opt = keras.optimizers.Adam(0.1)
    opt.apply_gradients([(tf.ones_like(w) * (r + 1), w) for w in model.trainable_weights])
    kstate = hvd.elastic.TensorFlowKerasState(model, opt, epoch=r)
    kstate.sync()
    slots = [v.numpy() for v in opt.variables]
    every = hvd.allgather_object([float(np.sum(s)) for s in slots])
    ck.equal(every, [every[0]] * n, "KerasState.sync: every rank has the same optimizer state")
    ck.array(model.get_weights()[0], np.ones((3, 2), np.float32) - 0.1, "KerasState.sync: weights")
    model.set_weights([w * 0 for w in model.get_weights()])
    kstate.restore()
    ck.array(model.get_weights()[0], np.ones((3, 2), np.float32) - 0.1, "KerasState.restore")
    # the loop: a failed collective restores the last commit and resets; a host update seen
    # by rank 0 interrupts every rank at the same commit
    obj = hvd.elastic.TensorFlowState([tf.Variable(np.zeros(2))], batch=0)
    log = {"attempts": 0, "resets": 0, "batches": []}

    def train(st):
        log["attempts"] += 1
        log["batches"].append(st.batch)
        if log["attempts"] == 1:
            st.batch = 7  # not committed: lost
            raise hvd.HorovodInternalError("simulated rank failure")
        if log["attempts"] == 2:
            st.batch = 3
            if r == 0:
                notify_hosts_updated(1, HostUpdateResult.added)
            st.commit()  # raises HostsUpdatedInterrupt on every rank
            raise AssertionError("commit did not raise")
        return st.batch

    result = run_fn(train, lambda: log.__setitem__("resets", log["resets"] + 1))(obj)
    ck.equal((log["attempts"], log["resets"], log["batches"], result), (3, 2, [0, 0, 3], 3),
             "elastic run_fn: attempts, resets, batch seen by each attempt")
    # hvd.elastic.run: a failed collective inside tf.function surfaces as UnknownError naming
    # the ferrovod error; run treats it as HorovodInternalError (restore, shutdown, init)
    calls = []

    @hvd.elastic.run
    def train2(st):
        calls.append(hvd.size())
        if len(calls) == 1:
            raise tf.errors.UnknownError(None, None, "RankFailureError: rank 1 is gone")
        return hvd.allreduce(tf.ones([1]), op=hvd.Sum, name="after.reset").numpy()

    out = train2(hvd.elastic.TensorFlowState([tf.Variable(np.zeros(1))]))
    ck.equal((len(calls), float(out[0])), (2, float(n)), "elastic run after a reset")
    ck.raises(tf.errors.UnknownError, lambda: hvd.elastic.run(
        lambda st: (_ for _ in ()).throw(tf.errors.UnknownError(None, None, "other")))(
            hvd.elastic.TensorFlowState([])), "elastic run passes other errors through")


PSETS = {}
SECTIONS = {"allreduce": sec_allreduce, "grouped": sec_grouped, "allgather": sec_allgather,
            "broadcast": sec_broadcast, "alltoall": sec_alltoall,
            "reducescatter": sec_reducescatter, "misc": sec_misc, "gradients": sec_gradients,
            "tape": sec_tape, "optimizer": sec_optimizer, "syncbn": sec_syncbn,
            "psets": sec_psets, "tf1": sec_tf1, "elastic": sec_elastic}


def main():
    T.require_bf16()
    seed = int(sys.argv[1])
    hvd.init(process_sets="dynamic")
    import os

    share = os.environ.get("OMP_NUM_THREADS")
    if hvd.local_size() > 1 and share:
        # ferrovod.tensorflow.init() gave TF this rank's share of the cores
        assert tf.config.threading.get_intra_op_parallelism_threads() == int(share), share
        assert tf.config.threading.get_inter_op_parallelism_threads() == 2
    if hvd.size() > 1:
        PSETS["evens"] = hvd.add_process_set(list(range(0, hvd.size(), 2)))
    c = Ctx(seed)
    import time

    for name, fn in SECTIONS.items():
        before, t0 = c.ck.count, time.perf_counter()
        for mode in MODES:
            fn(c, mode)
        print(f"section {name}: {c.ck.count - before} checks in {time.perf_counter() - t0:.1f} s",
              flush=True)
    hvd.shutdown()
    return c.ck.count


if __name__ == "__main__":
    T.run_main(main)
