"""Keras 2 (tf_keras) in a TF1-style v1 graph: eager execution disabled before anything runs.

usage: keras2_graph_worker.py SEED   (under TF_USE_LEGACY_KERAS=1)

Horovod-era code that calls ``tf.compat.v1.disable_eager_execution()`` trains through
Keras 2's v1 loop: the optimizer's ``get_updates`` -> ``get_gradients``, variables read and
written by running ops in Keras' session. Checked: ``fit`` with a legacy SGD with momentum,
``BroadcastGlobalVariablesCallback`` and the warm-up (whose momentum correction writes the
slots) == one process on the global batch with the same warm-up; ``broadcast_global_variables``
with no model (the graph's global variables); ``KerasState`` sync and restore.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_eager_execution()

import tf_keras as keras  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.tensorflow.keras as hvd  # noqa: E402

B, STEPS, LR = 4, 3, 0.1


def make(seed):
    m = keras.Sequential([keras.layers.Dense(4, activation="tanh", input_shape=(3,)),
                          keras.layers.Dense(2)])
    g = np.random.default_rng(seed)
    m.set_weights([g.standard_normal(w.shape) for w in m.get_weights()])
    return m


def data(seed, q):
    g = np.random.default_rng([seed, q])
    return g.standard_normal((STEPS * B, 3)), g.standard_normal((STEPS * B, 2))


def flat(model):
    return np.concatenate([w.ravel() for w in model.get_weights()])


def main():
    seed = int(sys.argv[1])
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    ck = T.Checker(r)
    keras.backend.set_floatx("float64")
    session = tf.compat.v1.keras.backend.get_session()

    def close(got, exp, what, tol=1e-12):
        ck.true(np.allclose(got, exp, rtol=tol, atol=tol), what,
                f"max abs diff {np.max(np.abs(np.asarray(got) - np.asarray(exp)))}")

    def warm():
        return hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=1)

    model = make(seed + r)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.legacy.SGD(LR, 0.9)),
                  loss="mse")
    x, y = data(seed, r)
    model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), warm()])
    ref = make(seed)
    ref.compile(optimizer=keras.optimizers.legacy.SGD(LR, 0.9), loss="mse")
    parts = [data(seed, q) for q in range(n)]
    gx = np.concatenate([p[0][k * B:(k + 1) * B] for k in range(STEPS) for p in parts])
    gy = np.concatenate([p[1][k * B:(k + 1) * B] for k in range(STEPS) for p in parts])
    # The warm-up runs no collective: the same one drives the reference.
    ref.fit(gx, gy, batch_size=n * B, epochs=2, shuffle=False, verbose=0, callbacks=[warm()])
    close(flat(model), flat(ref), "v1 graph fit with warm-up == one process on the global batch")
    rows = np.asarray(hvd.allgather(flat(model).reshape(1, -1)))
    ck.true(bool((rows == rows[0]).all()), "v1 graph fit: weights identical on all ranks")

    # broadcast_global_variables with no model: the graph's global variables, in the session.
    kernel = model.weights[0]
    session.run(kernel.assign(kernel + float(r)))
    hvd.broadcast_global_variables(0)
    close(keras.backend.get_value(kernel), ref.get_weights()[0],
          "broadcast_global_variables(0) in a v1 graph: rank 0's values")

    state = hvd.elastic.KerasState(model, batch=r)
    state.sync()
    ck.equal(state.batch, 0, "KerasState.sync in a v1 graph: rank 0's attribute")
    synced = flat(model)
    model.set_weights([w * 0 for w in model.get_weights()])
    state.restore()
    close(flat(model), synced, "KerasState.restore in a v1 graph", tol=0)
    hvd.shutdown()
    return ck.count


if __name__ == "__main__":
    T.run_main(main)
