"""Ranks that disagree get a clear error on every rank through ferrovod.tensorflow, never a
hang: eagerly, inside tf.function and in a TF1 session.

usage: tf_mismatch_worker.py

The last rank differs: an allreduce of another shape, of another dtype; broadcast_variables of
one more variable, or of a variable of another shape; a DistributedGradientTape over one more
variable, or over a variable of another shape. Every rank must raise an error naming the
disagreement, of the class Horovod raises: ``tf.errors.FailedPreconditionError`` when ranks
disagree about a collective, ``tf.errors.InvalidArgumentError`` for variable lists that
differ (eagerly these are also ``ferrovod.MismatchError`` / ``ferrovod.InvalidArgumentError``;
in a graph TensorFlow's error carries ferrovod's message), and the job must stay usable
afterwards. Prints ``error: ...`` lines and ``OK <n_checks>``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import tensorflow as tf  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.tensorflow as hvd  # noqa: E402

MODES = ("eager", "graph", "tf1")


def run(mode, fn):
    """``fn()`` eagerly, traced by tf.function, or built in a TF1 graph and run in a Session
    (``fn`` then makes its variables itself: pass factories)."""
    if mode == "eager":
        return fn()
    if mode == "graph":
        return tf.function(fn, autograph=False)()
    g = tf.Graph()
    with g.as_default():
        out = fn()
        with tf.compat.v1.Session(graph=g) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            return sess.run(out)


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    odd = r == n - 1
    ck = T.Checker(r)

    def expect(mode, what, fn, eager_exc, contains):
        tf_exc = (tf.errors.FailedPreconditionError if eager_exc is hvd.MismatchError
                  else tf.errors.InvalidArgumentError)
        e = ck.raises(tf_exc, fn, f"{mode} {what}", contains=contains)
        if mode == "eager":
            ck.true(isinstance(e, eager_exc), f"eager {what}: also {eager_exc.__name__}",
                    type(e).__mro__)
        print(f"error {mode} {what}: {str(e).splitlines()[0] if mode == 'eager' else _core_line(e)}",
              flush=True)

    def var(shape):
        """A zero variable: made now (eager, graph), or by run() inside the TF1 graph."""
        if mode == "tf1":
            return lambda: tf.Variable(tf.zeros(shape))
        return tf.Variable(tf.zeros(shape))

    def made(v):
        return v() if callable(v) and not isinstance(v, tf.Variable) else v

    for mode in MODES:
        # an op whose shape differs on the last rank
        expect(mode, "shape",
               lambda: run(mode, lambda: hvd.allreduce(tf.ones([4 if odd else 3]), name="mm.shape")),
               hvd.MismatchError, ("Mismatched", "mm.shape", f"rank {n - 1}"))
        dt = tf.float64 if odd else tf.float32
        expect(mode, "dtype", lambda: run(mode, lambda: hvd.allreduce(tf.ones([2], dt), name="mm.dtype")),
               hvd.MismatchError, ("Mismatched", "mm.dtype", f"rank {n - 1}"))
        # broadcast_variables over different variable lists
        vs = [var([3]), var([2, 2])]
        extra = vs + [var([5])] if odd else vs
        bcast = (lambda vars_: (lambda: hvd.broadcast_variables([made(v) for v in vars_], 0))
                 if mode == "tf1" else (lambda: [hvd.broadcast_variables(vars_, 0)] and None))
        expect(mode, "broadcast_variables count", lambda: run(mode, bcast(extra)),
               hvd.InvalidArgumentError, ("different variables", f"rank {n - 1} has 3 variables"))
        shaped = [var([4 if odd else 3]), vs[1]]
        expect(mode, "broadcast_variables shape", lambda: run(mode, bcast(shaped)),
               hvd.InvalidArgumentError, ("different variables", "first difference at position 0"))
        # a gradient tape over different variables
        w, b, c = var([3, 2]), var([4 if odd else 2]), var([2])
        srcs = [w, b, c] if odd else [w, b]

        def tape_grads(sources):
            def fn():
                got = [made(s) for s in sources]
                with tf.GradientTape() as tape:
                    loss = (tf.reduce_sum(tf.ones([1, 3]) @ got[0])
                            + sum(tf.reduce_sum(s) for s in got[1:]))
                return hvd.DistributedGradientTape(tape).gradient(loss, got)
            return fn

        if n > 1:
            expect(mode, "tape count", lambda: run(mode, tape_grads(srcs)), hvd.MismatchError,
                   ("number of tensors", "DistributedGradientTape", "reduces"))
            expect(mode, "tape shape", lambda: run(mode, tape_grads([w, b])), hvd.MismatchError,
                   ("Mismatched", "DistributedGradientTape", f"rank {n - 1}"))
        # one rank's argument is one it cannot send: it refuses, every rank fails the op
        refusals = [
            ("refused dtype", lambda: hvd.allreduce(tf.ones([2], tf.complex64 if odd else tf.float32),
                                                    name="rf.dtype")),
            ("refused scalar", lambda: hvd.allgather(tf.ones([] if odd else [2]), name="rf.scalar")),
            ("refused root", lambda: hvd.broadcast(tf.ones([2]), n + 2 if odd else 0, name="rf.root")),
            ("refused reducescatter op", lambda: hvd.reducescatter(tf.ones([2 * n]), name="rf.op",
                                                                   op=hvd.Max if odd else hvd.Sum)),
            ("refused alltoall dtype", lambda: hvd.alltoall(tf.ones([n], tf.complex64 if odd else tf.float32),
                                                            name="rf.a2a")),
        ]
        for what, fn in refusals:
            expect(mode, what, lambda: run(mode, fn), hvd.InvalidArgumentError,
                   (f"rank {n - 1}", "rf."))
        # unnamed: the refusal takes the op's automatic name, as its peers' ops do
        expect(mode, "refused unnamed", lambda: run(mode, lambda: hvd.reducescatter(
            tf.ones([] if odd else [2 * n]))), hvd.InvalidArgumentError, (f"rank {n - 1}", "scalar"))
        # the job is still usable afterwards
        got = run(mode, lambda: hvd.allreduce(tf.ones([1]), op=hvd.Sum, name=f"after.{mode}"))
        ck.equal(float(got[0]), float(n), f"{mode} allreduce afterwards")
    hvd.shutdown()
    return ck.count


def _core_line(e):
    """The ferrovod error's line inside TensorFlow's OpError message."""
    for line in str(e).splitlines():
        if "Error:" in line and ("Mismatch" in line or "InvalidArgument" in line):
            return line.strip()
    return str(e).splitlines()[0]


if __name__ == "__main__":
    T.run_main(main)
