"""Elastic Keras 3 training on scikit-learn's bundled 8x8 digits with ferrovod.

    ferrovodrun -np 4 --min-np 2 --max-np 4 \\
        --host-discovery-script ./discover_hosts.sh python examples/elastic/keras_digits_elastic.py

A Horovod elastic tf.keras script with one line changed
(``import ferrovod.tensorflow.keras as hvd``), on TensorFlow 2.16+ / Keras 3. ``KerasState``
holds the model, its optimizer and the epoch; ``CommitStateCallback`` commits every few
batches, ``UpdateEpochStateCallback`` and ``UpdateBatchStateCallback`` keep the position. When
a worker is lost, ``hvd.elastic.run`` restores the last commit and calls ``train`` again on the
survivors; a worker that joins receives the model and the optimizer's slots from rank 0. Each
attempt shards the data over the workers it has.
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import ferrovod.tensorflow.keras as hvd  # noqa: E402


def make_model() -> keras.Model:
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.002)
    ap.add_argument("--batches-per-commit", type=int, default=5)
    args = ap.parse_args()

    hvd.init()
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                          stratify=digits.target)
    keras.utils.set_random_seed(0)
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(args.lr)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    state = hvd.elastic.KerasState(model, batch=0, epoch=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.KerasState) -> None:
        rank, size = hvd.rank(), hvd.size()
        if rank == 0:
            print(f"training on {size} workers from epoch {state.epoch}", flush=True)
        order = np.random.default_rng(state.epoch).permutation(len(xtr))
        mine = order[rank::size]
        model.fit(xtr[mine], ytr[mine], batch_size=args.batch_size, epochs=args.epochs,
                  initial_epoch=state.epoch, verbose=0,
                  callbacks=[hvd.elastic.CommitStateCallback(state, args.batches_per_commit),
                             hvd.elastic.UpdateBatchStateCallback(state),
                             hvd.elastic.UpdateEpochStateCallback(state)])

    train(state)
    _, acc = model.evaluate(xte, yte, verbose=0)
    if hvd.rank() == 0:
        print(f"test accuracy: {acc * 100:.1f}%", flush=True)


if __name__ == "__main__":
    main()
