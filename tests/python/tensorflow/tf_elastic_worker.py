"""Elastic TensorFlow training with a custom loop (``ferrovod.tensorflow.elastic``):
``tf.function`` steps through ``DistributedGradientTape``, ``TensorFlowKerasState`` of the
model and its Adam, committed every 2 steps.

usage: tf_elastic_worker.py SCENARIO HOSTS_FILE
  add       at step AT rank 0 adds host 127.0.0.1 to HOSTS_FILE: two workers join at the next
            commit (their Adam has no slots until the state sync builds them)
  kill      at step AT the worker on 127.0.0.1 with local rank 1 SIGKILLs itself
  add-kill  both in one job: the add at step AT, and at step KILL_AT the worker that joined
            on 127.0.0.1 with local rank 1 SIGKILLs itself (the survivors go back to the last
            commit, and its host leaves)
At the end every rank's weights and optimizer variables must be identical, every step done,
and the weights equal to a replay in one process of the same global batches in the same order
(a step lost, repeated, or restored wrongly would differ). Prints ``size S rank R step T`` at
each start and ``OK n``.
"""

import os
import signal
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf

import ferrovod.tensorflow as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))
import fvtest as T  # noqa: E402

STEPS, AT, KILL_AT = 24, 7, 15


def main():
    scenario, hosts_file = sys.argv[1], sys.argv[2]
    hvd.init()
    rng = np.random.default_rng(3)
    x = tf.constant(rng.normal(size=(64, 4)).astype("float32"))
    y = tf.constant((rng.normal(size=(64, 4)) @ rng.normal(size=(4, 1))).astype("float32"))
    model, opt = make_model()
    state = hvd.elastic.TensorFlowKerasState(model, optimizer=opt, step=0)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    run_steps(state, x, y, train_step, scenario, hosts_file)
    flat = np.concatenate([np.asarray(v).reshape(-1).astype("float64")
                           for v in model.variables + list(opt.variables)])
    everyone = hvd.allgather_object(flat)
    for i, other in enumerate(everyone):
        assert other.shape == flat.shape and np.allclose(other, flat, rtol=0, atol=1e-6), \
            f"rank {i}'s weights or optimizer state differ from rank {hvd.rank()}'s"
    err = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(model.variables, replay(x, y)))
    assert err < 1e-4, f"weights differ from the one-process replay by {err}"
    print(f"DONE size {hvd.size()} rank {hvd.rank()} iterations {int(np.asarray(opt.iterations))}",
          flush=True)
    print(f"OK {len(everyone) + 1}", flush=True)


def run_steps(state, x, y, step, scenario, hosts_file):
    """The elastic training every TensorFlow worker here runs: ``step(xb, yb)`` on this rank's
    share of each global batch, STEPS of them, the membership change at step AT, a commit
    every 2 steps. Prints ``size S rank R step T`` at each start."""
    host = os.environ["FERROVOD_HOSTNAME"]
    slot_lr = int(os.environ["FERROVOD_ELASTIC_LOCAL_RANK"])
    plan = {AT: scenario} if scenario != "add-kill" else {AT: "add", KILL_AT: "kill"}
    acted = set()

    @hvd.elastic.run
    def train(state):
        print(f"size {hvd.size()} rank {hvd.rank()} step {state.step}", flush=True)
        r, n = hvd.rank(), hvd.size()
        while state.step < STEPS:
            if state.step in plan and state.step not in acted:
                acted.add(state.step)
                act(plan[state.step], host, slot_lr, hosts_file)
            xb, yb = global_batch(x, y, state.step)
            step(xb[r::n], yb[r::n])
            state.step += 1
            if state.step % 2 == 0:
                state.commit()

    train(state)


def make_model():
    tf.keras.utils.set_random_seed(2)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(8, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    return model, tf.keras.optimizers.Adam(0.01)


def global_batch(x, y, step):
    """The 8 rows every step trains on, shared out over the ranks (equal shares, so the
    average of their gradients is the gradient of the whole batch)."""
    lo = (step * 8) % 64
    return x[lo:lo + 8], y[lo:lo + 8]


def replay(x, y):
    """The model's variables after STEPS uninterrupted steps in this process alone."""
    model, opt = make_model()
    for step in range(STEPS):
        xb, yb = global_batch(x, y, step)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model.variables


HOST_UPDATES = T.HostUpdates()


def act(what, host, slot_lr, hosts_file):
    """The membership change ``what`` (``add`` or ``kill``), by the worker it falls to."""
    if what == "kill" and host == "127.0.0.1" and slot_lr == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "add" and hvd.rank() == 0:
        HOST_UPDATES.expect()
        with open(hosts_file + ".tmp", "w") as f:
            f.write("localhost:2\n127.0.0.1:2\n")
        os.replace(hosts_file + ".tmp", hosts_file)
        # Train on once the launcher has published the membership that takes the new host,
        # so that it lands at the next commit however long the launcher takes to see it.
        HOST_UPDATES.wait(f"writing {hosts_file}")


if __name__ == "__main__":
    main()
