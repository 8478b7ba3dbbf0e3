"""Elastic Keras 3 training (``ferrovod.tensorflow.keras.elastic``) whose membership changes.

usage: keras_elastic_worker.py SCENARIO HOSTS_FILE

``model.fit`` with Adam under ``hvd.elastic.run`` and Horovod's three callbacks
(``CommitStateCallback``, ``UpdateBatchStateCallback``, ``UpdateEpochStateCallback``).
SCENARIO at each worker's batch ``AT``:
  add       rank 0 adds host 127.0.0.1 to HOSTS_FILE: two workers join at the next commit;
            their Adam has no slots yet, and must get rank 0's
  kill      the worker on 127.0.0.1 with local rank 1 SIGKILLs itself
  add-kill  both in one job: rank 0 adds the host, and the worker that joined on 127.0.0.1
            with local rank 1 SIGKILLs itself at its own batch AT
At the end every rank's weights and optimizer variables must be identical (a new worker with
zero moments, or a survivor that missed a step, would differ), the epochs all done, and the
committed count of batches trained exactly EPOCHS * STEPS: the epoch a reset interrupted
resumes at its next uncommitted batch, none lost and none trained twice; and the weights equal
to a one-process replay of the batches the committed steps trained on (each membership reads
every rank's share of its stream from the start; the state records where each began).
Prints ``size S rank R`` at each start and ``OK n``.
"""

import os
import sys

import numpy as np

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import ferrovod.tensorflow.keras as hvd  # noqa: E402
from tf_elastic_worker import act  # noqa: E402  (the same membership changes)

EPOCHS, STEPS, AT = 3, 8, 5


def main():
    scenario, hosts_file = sys.argv[1], sys.argv[2]
    hvd.init()
    rng = np.random.default_rng(5)
    x = rng.normal(size=(256, 4)).astype("float32")
    y = (x @ rng.normal(size=(4, 1))).astype("float32")
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mse")
    # phases: (size, committed steps before it) of each membership that trained.
    state = hvd.elastic.KerasState(model, batch=0, epoch=0, trained=0, phases=[])
    host = os.environ["FERROVOD_HOSTNAME"]
    slot_lr = int(os.environ["FERROVOD_ELASTIC_LOCAL_RANK"])
    done = [0]

    class Act(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            done[0] += 1
            if done[0] == AT:
                joined = scenario == "add-kill" and host == "127.0.0.1"
                act("kill" if joined else scenario.split("-")[0], host, slot_lr, hosts_file)

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            state.trained += 1

    @hvd.elastic.run
    def train(state):
        print(f"size {hvd.size()} rank {hvd.rank()}", flush=True)
        r, n = hvd.rank(), hvd.size()
        state.phases = [p for p in state.phases if p[1] < state.trained] + [(n, state.trained)]
        # A repeated dataset, as scripts with steps_per_epoch have: Keras 3 keeps one
        # iterator across the epochs of a fit, so finite input that the shortened epoch
        # started would run out during the next one.
        data = tf.data.Dataset.from_tensor_slices((x[r::n], y[r::n])).repeat().batch(8)
        model.fit(data, steps_per_epoch=STEPS, epochs=EPOCHS,
                  initial_epoch=state.epoch, verbose=0,
                  callbacks=[Act(), Count(), hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.UpdateEpochStateCallback(state),
                             hvd.elastic.CommitStateCallback(state, batches_per_commit=2)])

    train(state)
    values = [np.asarray(v) for v in model.variables + opt.variables]
    flat = np.concatenate([v.reshape(-1).astype("float64") for v in values])
    everyone = hvd.allgather_object(flat)
    checks = 0
    for i, other in enumerate(everyone):
        assert other.shape == flat.shape and np.allclose(other, flat, rtol=0, atol=1e-6), \
            f"rank {i}'s weights or optimizer state differ from rank {hvd.rank()}'s"
        checks += 1
    assert state.epoch == EPOCHS, state.epoch
    assert state.trained == EPOCHS * STEPS, f"{state.trained} batches trained, not {EPOCHS * STEPS}"
    want = replay(x, y, state.phases, state.trained)
    err = max(float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(model.variables, want))
    assert err < 1e-4, f"weights differ from the one-process replay by {err} ({state.phases})"
    print(f"DONE size {hvd.size()} rank {hvd.rank()} iterations {int(np.asarray(opt.iterations))}",
          flush=True)
    print(f"OK {checks + 1}", flush=True)


def make_model():
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def replay(x, y, phases, total):
    """The variables after the committed steps, trained in this process alone: in a phase of
    size n that began after step s0, its j-th step trains on rows 8j..8j+8 of every rank r's
    repeated stream x[r::n] (equal shares: the ranks' averaged gradient is that of the union)."""
    model = make_model()
    opt = keras.optimizers.Adam(0.01)
    model.compile(optimizer=opt, loss="mse")
    ends = [s for _, s in phases[1:]] + [total]
    for (n, start), end in zip(phases, ends):
        streams = [np.arange(r, len(x), n) for r in range(n)]
        for j in range(end - start):
            rows = np.concatenate([s[np.arange(8 * j, 8 * j + 8) % len(s)] for s in streams])
            model.train_on_batch(x[rows], y[rows])
    return [np.asarray(v) for v in model.variables]


if __name__ == "__main__":
    main()
