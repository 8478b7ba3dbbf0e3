"""Train a small Keras CNN on scikit-learn's bundled 8x8 digits with ferrovod.tensorflow and a
custom TensorFlow 2 training loop.

    ferrovodrun -np 2 python examples/tensorflow2_digits.py

A Horovod TensorFlow 2 script with one line changed (``import ferrovod.tensorflow as hvd``):
each rank trains on its shard of the data, the training step is a ``tf.function`` whose
``DistributedGradientTape`` averages the gradients across ranks, and after the first step
the model and optimizer variables are broadcast from rank 0 (``broadcast_variables``), so
every rank continues from the same weights. The learning rate is scaled by the number of
ranks. The dataset ships inside scikit-learn: nothing is downloaded.
"""

import argparse
import hashlib
import time

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import ferrovod.tensorflow as hvd


def datasets(seed: int):
    """(x_train, y_train, x_test, y_test) as float32 images in [0, 1] and int labels."""
    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)


def shard(x: np.ndarray, y: np.ndarray, seed: int):
    """This rank's equal share of a fixed shuffle (every rank gets the same number of
    samples, so every rank runs the same number of steps)."""
    order = np.random.default_rng(seed).permutation(len(x))
    per_rank = len(x) // hvd.size()
    mine = order[hvd.rank() * per_rank:(hvd.rank() + 1) * per_rank]
    return x[mine], y[mine]


def build_model():
    import keras

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
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.001, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--print-digest", action="store_true",
                        help="every rank prints a SHA-256 of its final weights")
    args = parser.parse_args()

    hvd.init()  # before any tensor exists: gives TF's thread pools this rank's core share
    import keras

    keras.utils.set_random_seed(args.seed + hvd.rank())  # different on purpose: rank 0's weights win

    x_train, x_test, y_train, y_test = datasets(args.seed)
    x_train, y_train = shard(x_train, y_train, args.seed)
    train = (tf.data.Dataset.from_tensor_slices((x_train, y_train))
             .shuffle(len(x_train), seed=args.seed, reshuffle_each_iteration=True)
             .batch(args.batch_size, drop_remainder=True))  # one shape: traced once

    model = build_model()
    opt = keras.optimizers.Adam(args.lr * hvd.size())
    opt.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        # After the first step (the optimizer's variables exist by then) every rank takes
        # rank 0's weights and optimizer state.
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    t0 = time.time()
    step = 0
    for epoch in range(1, args.epochs + 1):
        losses = []
        for images, labels in train:
            losses.append(float(training_step(images, labels, step == 0)))
            step += 1
        mean_loss = float(hvd.allreduce(tf.constant(np.mean(losses)), name="train_loss"))
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}: train loss {mean_loss:.4f}", flush=True)
    elapsed = time.time() - t0

    # Test accuracy over every rank's share of the test set (sums of counts, allreduced).
    x_mine, y_mine = x_test[hvd.rank()::hvd.size()], y_test[hvd.rank()::hvd.size()]
    pred = np.argmax(model(x_mine, training=False).numpy(), axis=1)
    counts = hvd.allreduce(tf.constant([float((pred == y_mine).sum()), float(len(y_mine))],
                                       tf.float64), op=hvd.Sum, name="test_counts").numpy()
    accuracy = counts[0] / counts[1]
    if args.print_digest:
        digest = hashlib.sha256(b"".join(np.ascontiguousarray(v.numpy()).tobytes()
                                         for v in model.variables)).hexdigest()
        print(f"weights digest: {digest}", flush=True)
    if hvd.rank() == 0:
        print(f"ranks: {hvd.size()}  steps: {step}  train time: {elapsed:.1f} s", flush=True)
        print(f"test accuracy: {100 * accuracy:.2f}%", flush=True)


if __name__ == "__main__":
    main()
