"""Train a small Keras 3 model on scikit-learn's bundled 8x8 digits with ferrovod.

    ferrovodrun -np 2 python examples/keras_digits.py

A Horovod tf.keras script with one line changed (``import ferrovod.tensorflow.keras as hvd``)
that runs on TensorFlow 2.16+ / Keras 3: each rank reads its shard of a ``tf.data`` pipeline
(``.shard(size, rank)``), steps per epoch are divided by the number of ranks, the learning
rate is scaled by it and warmed up (``LearningRateWarmupCallback``), rank 0's initial weights
are broadcast (``BroadcastGlobalVariablesCallback``), gradients are averaged by
``DistributedOptimizer``, epoch metrics are averaged over ranks (``MetricAverageCallback``),
and only rank 0 writes the ``.keras`` checkpoint and the CSV log. The dataset ships inside
scikit-learn: nothing is downloaded.
"""

import argparse
import os
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import ferrovod.tensorflow.keras as hvd  # noqa: E402


def make_model() -> keras.Model:
    """A small CNN: 8x8x1 -> conv 16 -> conv 32 -> pool -> dense 64 -> 10."""
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="scaled by the number of ranks")
    parser.add_argument("--warmup-epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                             "ferrovod_keras_digits.keras"))
    parser.add_argument("--csv", default=os.path.join(tempfile.gettempdir(),
                                                      "ferrovod_keras_digits.csv"))
    args = parser.parse_args()

    hvd.init()
    # Different on purpose: BroadcastGlobalVariablesCallback makes rank 0's weights win.
    keras.utils.set_random_seed(args.seed + hvd.rank())

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.25, random_state=0,
                                          stratify=digits.target)
    train = (tf.data.Dataset.from_tensor_slices((xtr, ytr))
             .shard(hvd.size(), hvd.rank())
             .shuffle(len(xtr), seed=args.seed)
             .repeat()
             .batch(args.batch_size))
    # Every rank must run the same number of steps (each step is one allreduce).
    steps_per_epoch = len(xtr) // (args.batch_size * hvd.size())

    lr = args.lr * hvd.size()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(learning_rate=lr, momentum=0.9))
    model = make_model()
    # jit_compile: the default "auto" (no XLA on a CPU-only machine) or False — the gradient
    # exchange is a host op that XLA cannot compile.
    model.compile(optimizer=opt, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=args.warmup_epochs,
                                                 verbose=1),
    ]
    if hvd.rank() == 0:  # one writer
        callbacks += [keras.callbacks.ModelCheckpoint(args.checkpoint),
                      keras.callbacks.CSVLogger(args.csv)]

    t0 = time.time()
    model.fit(train, steps_per_epoch=steps_per_epoch, epochs=args.epochs, callbacks=callbacks,
              verbose=2 if hvd.rank() == 0 else 0)
    elapsed = time.time() - t0
    if hvd.rank() == 0:
        _, acc = model.evaluate(xte, yte, batch_size=256, verbose=0)
        print(f"ranks: {hvd.size()}  fit time: {elapsed:.1f} s  checkpoint: {args.checkpoint}  "
              f"log: {args.csv}", flush=True)
        print(f"test accuracy: {100 * acc:.2f}%", flush=True)


if __name__ == "__main__":
    main()
