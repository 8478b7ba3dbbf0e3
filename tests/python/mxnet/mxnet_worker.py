"""ferrovod.mxnet with the real MXNet 1.9.1 (run by the interpreter of .venv-mxnet).

usage: mxnet_worker.py SEED

- every collective on NDArrays of MXNet's dtypes and odd shapes against NumPy on the gathered
  inputs (allreduce: every op, scale factors, in place; grouped forms; ragged allgather;
  broadcast from every root; alltoall with and without splits; reducescatter; objects; a
  process set; join; bad input refused on every rank);
- DistributedOptimizer: an updater step averages the gradient before the wrapped SGD step;
- DistributedTrainer + broadcast_parameters on a Gluon network with deferred initialization:
  after 3 steps every rank holds the same weights, equal to one process training on the
  concatenation of every rank's batch; fp16 compression and num_groups give the same;
- ranks whose models differ: DistributedTrainer fails on every rank, saying what differs;
- KVStore: dist_sync semantics (init, push sums, pushpull, an optimizer's update, Gluon's
  Trainer with it equal to one process).

Prints ``OK <n_checks>``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.mxnet as hvd  # noqa: E402
from ferrovod.exceptions import FerrovodError  # noqa: E402

DTYPES = ["uint8", "int8", "int32", "int64", "float16", "float32", "float64"]
OPS = [(T.SUM, hvd.Sum), (T.AVERAGE, hvd.Average), (T.MIN, hvd.Min), (T.MAX, hvd.Max),
       (T.PRODUCT, hvd.Product)]
SHAPES = [(1,), (17,), (3, 5), (2, 3, 4)]


class Ctx(T.Cases):
    def __init__(self, seed):
        super().__init__(seed, hvd.rank(), hvd.size())

    def nd(self, a):
        return mx.nd.array(a, dtype=a.dtype)

    def check(self, got, exp, what):
        self.ck.true(isinstance(got, mx.nd.NDArray), what, f"result is {type(got).__name__}")
        self.ck.array(got.asnumpy(), exp, what)


def sec_allreduce(c):
    for dt in DTYPES:
        for name, op in OPS:
            for shape in SHAPES:
                mode = T.input_mode(name, dt)
                if name == T.SUM and np.dtype(dt).kind in "iu":
                    mode = "nowrap"
                if name == T.PRODUCT and np.dtype(dt).kind in "iu":
                    mode = "tiny"
                xs = c.inputs(c.key(), dt, shape, mode)
                exp = T.ref_reduce(xs, name, dt, c.n)
                what = f"allreduce {dt} {name} {shape}"
                x = c.nd(xs[c.rank])
                c.check(hvd.allreduce(x, op=op), exp, what)
                c.ck.array(x.asnumpy(), xs[c.rank], f"{what}: input untouched")
                y = c.nd(xs[c.rank])
                c.ck.true(hvd.allreduce_(y, op=op, name=f"ip.{c.case}") is y, f"{what} in place",
                          "did not return its input")
                c.ck.array(y.asnumpy(), exp, f"{what} in place")
    for dt in ("float32", "float64"):
        xs = c.inputs(c.key(), dt, (33,))
        c.check(hvd.allreduce(c.nd(xs[c.rank]), average=False, prescale_factor=0.5,
                              postscale_factor=3.0), T.ref_reduce(xs, T.SUM, dt, c.n, 0.5, 3.0),
                f"allreduce {dt} pre 0.5 post 3")
        c.check(hvd.allreduce(c.nd(xs[c.rank])), T.ref_reduce(xs, T.AVERAGE, dt, c.n),
                f"allreduce {dt} default Average")
    # grouped, in place and not
    xs = c.inputs(c.key(), "float32", (6,))
    ys = c.inputs(c.key(), "int32", (2, 3), "nowrap")
    outs = hvd.grouped_allreduce([c.nd(xs[c.rank]), c.nd(ys[c.rank])], op=hvd.Sum)
    c.check(outs[0], T.ref_reduce(xs, T.SUM, "float32", c.n), "grouped_allreduce #1")
    c.check(outs[1], T.ref_reduce(ys, T.SUM, "int32", c.n), "grouped_allreduce #2")
    a, b = c.nd(xs[c.rank]), c.nd(ys[c.rank])
    hvd.grouped_allreduce_([a, b], op=hvd.Max)
    c.check(a, T.ref_reduce(xs, T.MAX, "float32", c.n), "grouped_allreduce_ #1")
    c.check(b, T.ref_reduce(ys, T.MAX, "int32", c.n), "grouped_allreduce_ #2")


def sec_gather_broadcast(c):
    for dt in DTYPES:
        k = c.key()
        rows = [T.gen(k, j, dt, (j + 1, 3)) for j in range(c.n)]
        c.check(hvd.allgather(c.nd(rows[c.rank])), np.concatenate(rows), f"allgather {dt}")
        for root in range(c.n):
            xs = c.inputs(c.key(), dt, (4, 5))
            c.check(hvd.broadcast(c.nd(xs[c.rank]), root), xs[root], f"broadcast {dt} root {root}")
            x = c.nd(xs[c.rank])
            hvd.broadcast_(x, root, name=f"b_.{c.case}")
            c.ck.array(x.asnumpy(), xs[root], f"broadcast_ {dt} root {root}")
    k = c.key()
    a = [T.gen(k, j, "float64", (j + 2,)) for j in range(c.n)]
    b = [T.gen(k + (1,), j, "int64", (2, 2)) for j in range(c.n)]
    ga, gb = hvd.grouped_allgather([c.nd(a[c.rank]), c.nd(b[c.rank])])
    c.check(ga, np.concatenate(a), "grouped_allgather #1")
    c.check(gb, np.concatenate(b), "grouped_allgather #2")


def sec_alltoall_reducescatter(c):
    n, me = c.n, c.rank
    for dt in DTYPES:
        # member i sends (i + j) % 3 + 1 rows to member j
        sp = [[(i + j) % 3 + 1 for j in range(n)] for i in range(n)]
        k = c.key()
        xs = [T.gen(k, i, dt, (sum(sp[i]), 2)) for i in range(n)]
        offs = [np.concatenate([[0], np.cumsum(s)]).astype(int) for s in sp]
        want = np.concatenate([xs[i][offs[i][me]:offs[i][me] + sp[i][me]] for i in range(n)])
        out, received = hvd.alltoall(c.nd(xs[me]), splits=sp[me])
        c.check(out, want, f"alltoall {dt} splits")
        c.ck.equal(received.asnumpy().tolist(), [sp[i][me] for i in range(n)],
                   f"alltoall {dt} received splits")
        c.ck.equal(str(received.dtype), "<class 'numpy.int32'>", "received splits dtype")
        xs = c.inputs(c.key(), dt, (2 * n, 3))
        c.check(hvd.alltoall(c.nd(xs[me])),
                np.concatenate([x[2 * me:2 * me + 2] for x in xs]), f"alltoall {dt} equal")
    for dt in ("int32", "float32", "float64"):
        for name, op in ((T.SUM, hvd.Sum), (T.AVERAGE, hvd.Average)):
            if name == T.AVERAGE and dt == "int32":
                continue
            for d0 in (2 * n, 2 * n + 1):
                xs = c.inputs(c.key(), dt, (d0, 4), "nowrap")
                full = T.ref_reduce(xs, name, dt, n)
                start, count = T.split_rows(d0, n)[me]
                c.check(hvd.reducescatter(c.nd(xs[me]), op=op), full[start:start + count],
                        f"reducescatter {dt} {name} rows {d0}")
    xs = c.inputs(c.key(), "float32", (2 * n + 1, 2))
    ys = c.inputs(c.key(), "float64", (n, 3))
    ga, gb = hvd.grouped_reducescatter([c.nd(xs[me]), c.nd(ys[me])], op=hvd.Sum)
    for got, zs, what in ((ga, xs, "#1"), (gb, ys, "#2")):
        start, count = T.split_rows(zs[0].shape[0], n)[me]
        c.check(got, T.ref_reduce(zs, T.SUM, zs[0].dtype, n)[start:start + count],
                f"grouped_reducescatter {what}")


def sec_misc(c):
    n, me = c.n, c.rank
    obj = {"rank": me, "payload": list(range(me + 1))}
    c.ck.equal(hvd.broadcast_object(obj, root_rank=n - 1),
               {"rank": n - 1, "payload": list(range(n))}, "broadcast_object")
    c.ck.equal(hvd.allgather_object(me * 10), [r * 10 for r in range(n)], "allgather_object")
    hvd.barrier()
    c.ck.true(hvd.is_initialized() and hvd.size() == n, "topology")
    if n > 1:
        evens = hvd.add_process_set(list(range(0, n, 2)))
        if me in evens.ranks:
            xs = c.inputs(c.key(), "float32", (5,))
            got = hvd.allreduce(c.nd(xs[me]), op=hvd.Sum, process_set=evens)
            c.check(got, T.ref_reduce([xs[r] for r in evens.ranks], T.SUM, "float32",
                                      len(evens.ranks)), "allreduce on a process set")
        hvd.barrier()
    c.ck.raises(ValueError, lambda: hvd.allreduce(np.ones(3)), "a NumPy array is refused",
                contains=("NDArray",))
    c.ck.raises(ValueError,
                lambda: hvd.alltoall(mx.nd.ones((n,)), mx.nd.ones((n,), dtype="float32")),
                "float alltoall splits are refused, not rounded", contains=("integers",))
    if n > 1:
        bad = mx.nd.ones((3,)) if me == 0 else mx.nd.ones((4,))
        c.ck.raises(FerrovodError, lambda: hvd.allreduce(bad, name="mismatch"),
                    "shapes that differ fail on every rank", contains=("shape",))


def net():
    blk = mx.gluon.nn.HybridSequential()
    with blk.name_scope():
        blk.add(mx.gluon.nn.Dense(8, activation="tanh"), mx.gluon.nn.Dense(3))
    return blk


def batches(step, r):
    rng = np.random.default_rng(1000 + 7 * step + r)
    return (rng.standard_normal((4, 5)).astype(np.float32),
            rng.standard_normal((4, 3)).astype(np.float32))


def train(model, trainer, ranks, steps=3, per_rank=False):
    """``steps`` steps on the batches of ``ranks``, concatenated; ``per_rank``: the step's
    batch size is one rank's (a dist_sync server sums every worker's mean gradient)."""
    loss_fn = mx.gluon.loss.L2Loss()
    for s in range(steps):
        data = [batches(s, r) for r in ranks]
        x = mx.nd.array(np.concatenate([d[0] for d in data]))
        y = mx.nd.array(np.concatenate([d[1] for d in data]))
        with mx.autograd.record():
            loss = loss_fn(model(x), y)
        loss.backward()
        trainer.step(len(data[0][0]) if per_rank else x.shape[0])


def weights(model):
    return [p.data().asnumpy() for _, p in sorted(model.collect_params().items())]


def sec_training(c):
    n, me = c.n, c.rank
    # DistributedOptimizer through MXNet's updater: the gradient is averaged, then SGD steps
    w0 = np.arange(4, dtype=np.float32)
    w = mx.nd.array(w0)
    g = mx.nd.array(np.full(4, me + 1.0, np.float32))
    updater = mx.optimizer.get_updater(hvd.DistributedOptimizer(mx.optimizer.SGD(learning_rate=0.5)))
    updater(0, g, w)
    c.ck.array(w.asnumpy(), (w0 - 0.5 * (n + 1) / 2).astype(np.float32),
               "DistributedOptimizer step with the averaged gradient")
    for label, kw in (("plain", {}), ("fp16", {"compression": hvd.Compression.fp16}),
                      ("num_groups", {"num_groups": 2}),
                      ("predivide", {"gradient_predivide_factor": 2.0})):
        mx.random.seed(100 + me)  # a different initialization on every rank
        model = net()
        model.initialize(mx.init.Xavier())  # deferred: shapes are known at the first batch
        hvd.broadcast_parameters(model.collect_params(), root_rank=0, prefix=label)
        trainer = hvd.DistributedTrainer(model.collect_params(), "sgd",
                                         {"learning_rate": 0.1}, prefix=label, **kw)
        # every rank's own batch; gradients averaged: like one process on the whole batch
        train(model, trainer, [me])
        mine = weights(model)
        theirs = hvd.allgather_object(mine)
        for r in range(n):
            for a, b in zip(theirs[r], mine):
                c.ck.array(b, a, f"{label}: rank {r}'s weights equal this rank's")
        # the reference: rank 0's initial weights, one process, the concatenated batches
        mx.random.seed(100)
        ref = net()
        ref.initialize(mx.init.Xavier())
        ref_trainer = mx.gluon.Trainer(ref.collect_params(), "sgd",
                                       {"learning_rate": 0.1 / n}, kvstore=None)
        loss_fn = mx.gluon.loss.L2Loss()
        for s in range(3):
            data = [batches(s, r) for r in range(n)]
            x = mx.nd.array(np.concatenate([d[0] for d in data]))
            y = mx.nd.array(np.concatenate([d[1] for d in data]))
            with mx.autograd.record():
                loss = loss_fn(ref(x), y)
            loss.backward()
            ref_trainer.step(4)
        tol = 2e-3 if label == "fp16" else 1e-5
        for a, b in zip(weights(ref), mine):
            c.ck.true(np.allclose(a, b, rtol=tol, atol=tol), f"{label}: equal to one process",
                      f"max diff {np.abs(a - b).max()}")


def sec_mismatch(c):
    """Ranks whose models differ get a clear error from DistributedTrainer on every rank."""
    if c.n < 2:
        return
    blk = mx.gluon.nn.Dense(3 if c.rank == 0 else 4, in_units=5)
    blk.initialize()
    trainer = hvd.DistributedTrainer(blk.collect_params(), "sgd", {"learning_rate": 0.1},
                                     prefix="mismatch")
    with mx.autograd.record():
        loss = blk(mx.nd.ones((2, 5))).sum()
    loss.backward()
    c.ck.raises(FerrovodError, lambda: trainer.step(2),
                "DistributedTrainer with models that differ across ranks", contains=("shape",))


def sec_kvstore(c):
    """dist_sync semantics: init takes rank 0's value, push sums over workers (and over a
    worker's device list), with an optimizer set a push is one update, Gluon trains with it."""
    n, me = c.n, c.rank
    kv = hvd.KVStore()
    c.ck.equal((kv.type, kv.rank, kv.num_workers), ("dist_sync", me, n), "KVStore identity")
    c.ck.true(type(mx.kv.create("ferrovod")).__name__ == "Ferrovod", "mx.kv.create('ferrovod')")
    inits = [np.full((2, 3), r + 1.0, np.float32) for r in range(n)]
    kv.init(3, mx.nd.array(inits[me]))
    out = mx.nd.zeros((2, 3))
    kv.pull(3, out=out)
    c.ck.array(out.asnumpy(), inits[0], "init takes rank 0's value")
    grads = [np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) for r in range(n)]
    kv.push(3, [mx.nd.array(grads[me]), mx.nd.array(grads[me])])  # two devices
    kv.pull(3, out=[out, out])
    c.ck.array(out.asnumpy(), 2 * sum(grads), "push sums devices and workers")
    kv.init(["a", "b"], [mx.nd.array(inits[me]), mx.nd.array(inits[me][0])])
    res = [mx.nd.zeros((2, 3)), mx.nd.zeros((3,))]
    kv.pushpull(["a", "b"], [mx.nd.array(grads[me]), mx.nd.array(grads[me][1])], out=res)
    c.ck.array(res[0].asnumpy(), sum(grads), "pushpull of a key list #1")
    c.ck.array(res[1].asnumpy(), sum(g[1] for g in grads), "pushpull of a key list #2")
    kv.set_optimizer(mx.optimizer.SGD(learning_rate=0.5, rescale_grad=1.0))
    w = mx.nd.zeros((2, 3))
    kv.broadcast(7, mx.nd.array(inits[me]), out=w)
    c.ck.array(w.asnumpy(), inits[0], "broadcast")
    kv.pushpull(7, mx.nd.array(grads[me]), out=w)
    c.ck.array(w.asnumpy(), inits[0] - 0.5 * sum(grads), "a push with an optimizer updates")
    c.ck.raises(KeyError, lambda: kv.pull("never", out=w), "an unknown key",
                contains=("never",))
    # Gluon with the store: the server's sum of every worker's gradient, like one process on
    # all the batches with the same learning rate
    mx.random.seed(300 + me)
    model = net()
    model.initialize(mx.init.Xavier())
    model(mx.nd.zeros((1, 5)))
    # The Trainer takes rank 0's values into the store only at its first step, after every
    # rank's first gradient: as with a parameter server, the ranks must start alike.
    hvd.broadcast_parameters(model.collect_params(), root_rank=0, prefix="kv")
    trainer = mx.gluon.Trainer(model.collect_params(), "sgd", {"learning_rate": 0.1},
                               kvstore=hvd.KVStore())
    train(model, trainer, [me])
    mine = weights(model)
    for r, theirs in enumerate(hvd.allgather_object(mine)):
        for a, b in zip(theirs, mine):
            c.ck.array(b, a, f"KVStore Trainer: rank {r}'s weights equal this rank's")
    mx.random.seed(300)
    ref = net()
    ref.initialize(mx.init.Xavier())
    ref(mx.nd.zeros((1, 5)))
    ref_trainer = mx.gluon.Trainer(ref.collect_params(), "sgd", {"learning_rate": 0.1},
                                   kvstore=None)
    train(ref, ref_trainer, list(range(n)), per_rank=True)
    for a, b in zip(weights(ref), mine):
        c.ck.true(np.allclose(a, b, rtol=1e-5, atol=1e-5), "KVStore Trainer: equal to one process",
                  f"max diff {np.abs(a - b).max()}")


def main():
    hvd.init(process_sets="dynamic")
    c = Ctx(int(sys.argv[1]))
    for sec in (sec_allreduce, sec_gather_broadcast, sec_alltoall_reducescatter, sec_misc,
                sec_training, sec_mismatch, sec_kvstore):
        sec(c)
        hvd.barrier()
    last = hvd.join()
    c.ck.true(0 <= last < c.n, "join returns a rank")
    hvd.shutdown()
    return c.ck.count


if __name__ == "__main__":
    T.run_main(main)
