"""Ranks that disagree get a clear error on every rank through ferrovod.tensorflow, never a
hang: eagerly and inside tf.function.

usage: tf_mismatch_worker.py

The last rank differs: an allreduce of another shape, of another dtype; broadcast_variables of
one more variable, or of a variable of another shape; a DistributedGradientTape over one more
variable, or over a variable of another shape. Every rank must raise an error naming the
disagreement (eager: the ferrovod exception; graph: TensorFlow's OpError carrying its message),
and the job must stay usable afterwards. Prints ``error: ...`` lines and ``OK <n_checks>``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import tensorflow as tf  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.tensorflow as hvd  # noqa: E402

MODES = ("eager", "graph")


def run(mode, fn):
    if mode == "eager":
        return fn()
    return tf.function(fn, autograph=False)()


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    odd = r == n - 1
    ck = T.Checker(r)

    def expect(mode, what, fn, eager_exc, contains):
        exc = eager_exc if mode == "eager" else tf.errors.OpError
        e = ck.raises(exc, fn, f"{mode} {what}", contains=contains)
        print(f"error {mode} {what}: {str(e).splitlines()[0] if mode == 'eager' else _core_line(e)}",
              flush=True)

    for mode in MODES:
        # an op whose shape differs on the last rank
        x = tf.ones([4 if odd else 3])
        expect(mode, "shape", lambda: run(mode, lambda: hvd.allreduce(x, name="mm.shape")),
               hvd.MismatchError, ("Mismatched", "mm.shape", f"rank {n - 1}"))
        y = tf.ones([2], tf.float64 if odd else tf.float32)
        expect(mode, "dtype", lambda: run(mode, lambda: hvd.allreduce(y, name="mm.dtype")),
               hvd.MismatchError, ("Mismatched", "mm.dtype", f"rank {n - 1}"))
        # broadcast_variables over different variable lists
        vs = [tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([2, 2]))]
        extra = vs + [tf.Variable(tf.zeros([5]))] if odd else vs
        expect(mode, "broadcast_variables count",
               lambda: run(mode, lambda: [hvd.broadcast_variables(extra, 0)] and None),
               hvd.InvalidArgumentError, ("different variables", f"rank {n - 1} has 3 variables"))
        shaped = [tf.Variable(tf.zeros([4 if odd else 3])), vs[1]]
        expect(mode, "broadcast_variables shape",
               lambda: run(mode, lambda: [hvd.broadcast_variables(shaped, 0)] and None),
               hvd.InvalidArgumentError, ("different variables", "first difference at position 0"))
        # a gradient tape over different variables
        w = tf.Variable(tf.ones([3, 2]))
        b = tf.Variable(tf.ones([4 if odd else 2]))
        c = tf.Variable(tf.ones([2]))
        srcs = [w, b, c] if odd else [w, b]

        def tape_grads(sources):
            def fn():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(tf.ones([1, 3]) @ w) + sum(tf.reduce_sum(s) for s in sources[1:])
                return hvd.DistributedGradientTape(tape).gradient(loss, sources)
            return fn

        if n > 1:
            expect(mode, "tape count", lambda: run(mode, tape_grads(srcs)), hvd.MismatchError,
                   ("number of tensors", "DistributedGradientTape", "reduces"))
            expect(mode, "tape shape", lambda: run(mode, tape_grads([w, b])), hvd.MismatchError,
                   ("Mismatched", "DistributedGradientTape", f"rank {n - 1}"))
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
