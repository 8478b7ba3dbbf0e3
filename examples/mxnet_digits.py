"""Train a small Gluon CNN on scikit-learn's bundled 8x8 digits with ferrovod.mxnet.

    ferrovodrun -np 2 python examples/mxnet_digits.py

A Horovod MXNet script with one line changed (``import ferrovod.mxnet as hvd``): each rank
trains on its shard of the data, rank 0's initial weights reach every rank when the first
batch initializes them (``broadcast_parameters`` on deferred parameters), gradients are
averaged by ``DistributedTrainer``, metrics are averaged across ranks, and only rank 0 writes
the checkpoint. The dataset ships inside scikit-learn: nothing is downloaded.

Under the mxnet-operator (examples/kubernetes/mxjob.yaml) every replica runs this command: the
workers find each other from MX_CONFIG, and the scheduler and server pods exit at once, saying
they are not needed.
"""

import argparse
import os
import tempfile
import time

# First: in an MXJob's scheduler and server pods (DMLC_ROLE) it ends the process before MXNet,
# once imported, would start that role.
import ferrovod.mxnet as hvd  # isort: skip

import mxnet as mx  # noqa: E402
import numpy as np  # noqa: E402
from mxnet import autograd, gluon  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402


def make_net() -> gluon.nn.HybridSequential:
    net = gluon.nn.HybridSequential()
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
                gluon.nn.Conv2D(32, 3, padding=1, activation="relu"),
                gluon.nn.MaxPool2D(2),
                gluon.nn.Flatten(),
                gluon.nn.Dense(64, activation="relu"),
                gluon.nn.Dense(10))
    return net


def datasets():
    digits = load_digits()
    x = (digits.images[:, None, :, :] / 16.0).astype(np.float32)
    y = digits.target.astype(np.float32)
    return train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)


def metric_average(value: float, count: float, name: str) -> float:
    """The mean over every rank's samples: sums of value*count and of count, allreduced."""
    total = hvd.allreduce(mx.nd.array([value * count, count], dtype="float64"), op=hvd.Sum,
                          name=name).asnumpy()
    return float(total[0] / total[1])


def evaluate(net: gluon.Block, x: np.ndarray, y: np.ndarray) -> tuple:
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    out = net(mx.nd.array(x)) if len(x) else None
    count = len(x)
    loss = float(loss_fn(out, mx.nd.array(y)).sum().asscalar()) if count else 0.0
    correct = int((out.argmax(axis=1) == mx.nd.array(y)).sum().asscalar()) if count else 0
    count = max(count, 1)
    return (metric_average(loss / count, count, "test_loss"),
            metric_average(correct / count, count, "test_accuracy"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                             "ferrovod_mxnet_digits.params"))
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mx.random.seed(args.seed + rank)  # different on purpose: rank 0's weights win

    xtr, xte, ytr, yte = datasets()
    xte, yte = xte[rank::size], yte[rank::size]

    net = make_net()
    net.initialize(mx.init.Xavier())  # deferred: shapes are known at the first batch
    params = net.collect_params()
    hvd.broadcast_parameters(params, root_rank=0)
    trainer = hvd.DistributedTrainer(params, "sgd", {"learning_rate": args.lr * size,
                                                     "momentum": 0.9})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()

    t0 = time.time()
    for epoch in range(1, args.epochs + 1):
        # every rank shuffles alike and takes its own shard
        order = np.random.default_rng(args.seed + epoch).permutation(len(xtr))[rank::size]
        seen, loss_sum = 0, 0.0
        for at in range(0, len(order), args.batch_size):
            idx = order[at:at + args.batch_size]
            x, y = mx.nd.array(xtr[idx]), mx.nd.array(ytr[idx])
            with autograd.record():
                loss = loss_fn(net(x), y)
            loss.backward()
            trainer.step(len(idx))
            loss_sum += float(loss.sum().asscalar())
            seen += len(idx)
        train_loss = metric_average(loss_sum / max(seen, 1), seen, "train_loss")
        test_loss, test_acc = evaluate(net, xte, yte)
        if rank == 0:
            print(f"epoch {epoch:2d}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                  f"test accuracy {100 * test_acc:.2f}%", flush=True)
            net.save_parameters(args.checkpoint)
    if rank == 0:
        print(f"ranks: {size}  time: {time.time() - t0:.1f} s  checkpoint: {args.checkpoint}",
              flush=True)
        print(f"test accuracy: {100 * test_acc:.2f}%", flush=True)


if __name__ == "__main__":
    main()
