"""Elastic TensorFlow 1 graph training (``ferrovod.tensorflow.elastic.TensorFlowState`` with a
session): ``tf.compat.v1`` graph mode, a ``DistributedOptimizer`` around a TF1 optimizer,
``session.run`` steps, the state committed every 2 steps.

usage: tf1_elastic_worker.py SCENARIO HOSTS_FILE   (SCENARIO: add or kill, as in
tf_elastic_worker.py)

At the end every rank's variables must be identical, every step done, and the variables equal
to a NumPy replay of the same full-batch gradient steps (a lost, repeated or badly restored
step would differ). Prints ``size S rank R step T`` at each start and ``OK n``.
"""

import sys

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_eager_execution()

import ferrovod.tensorflow as hvd  # noqa: E402
from tf_elastic_worker import STEPS, global_batch, run_steps  # noqa: E402

LR = 0.05
v1 = tf.compat.v1


def data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 4))
    return x, x @ rng.normal(size=(4, 1)) + 0.3


def replay(x, y):
    """Plain gradient descent on the mean squared error, in float64, in this process."""
    w, b = np.full((4, 1), 0.1), np.zeros(1)
    for step in range(STEPS):
        xb, yb = global_batch(x, y, step)
        err = xb @ w + b - yb
        w = w - LR * 2 * xb.T @ err / len(xb)
        b = b - LR * 2 * err.mean(axis=0)
    return w, b


def main():
    scenario, hosts_file = sys.argv[1], sys.argv[2]
    hvd.init()
    x, y = data()
    xs = v1.placeholder(tf.float64, [None, 4])
    ys = v1.placeholder(tf.float64, [None, 1])
    w = v1.get_variable("w", initializer=np.full((4, 1), 0.1))
    b = v1.get_variable("b", initializer=np.zeros(1))
    loss = tf.reduce_mean((tf.matmul(xs, w) + b - ys) ** 2)
    train_op = hvd.DistributedOptimizer(v1.train.GradientDescentOptimizer(LR)).minimize(loss)
    session = v1.Session()
    session.run(v1.global_variables_initializer())
    state = hvd.elastic.TensorFlowState(session=session, step=0)
    run_steps(state, x, y, lambda xb, yb: session.run(train_op, {xs: xb, ys: yb}), scenario,
              hosts_file)
    got_w, got_b = session.run([w, b])
    flat = np.concatenate([got_w.reshape(-1), got_b])
    everyone = hvd.allgather_object(flat)
    for i, other in enumerate(everyone):
        assert np.array_equal(other, flat), f"rank {i}'s variables differ from rank {hvd.rank()}'s"
    want_w, want_b = replay(x, y)
    err = max(float(np.max(np.abs(got_w - want_w))), float(np.max(np.abs(got_b - want_b))))
    assert err < 1e-7, f"variables differ from the replay by {err}"
    print(f"DONE size {hvd.size()} rank {hvd.rank()} step {state.step}", flush=True)
    print(f"OK {len(everyone) + 1}", flush=True)


if __name__ == "__main__":
    main()
