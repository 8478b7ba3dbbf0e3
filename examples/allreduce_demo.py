"""Data-parallel training of a small MLP with ferrovod and NumPy only.

Run it with the launcher, e.g. on 2 processes::

    ferrovodrun -np 2 python examples/allreduce_demo.py

Every rank builds the same synthetic "two moons" dataset and trains on its own shard. Rank 0's
initial weights are broadcast to all ranks; after each mini-batch the gradients are averaged
with one grouped allreduce, so every rank applies the same update and the model stays
identical everywhere. Loss and accuracy are averaged over all ranks once per epoch and printed
by rank 0. At the end the weights of every rank are gathered and compared: the script exits
with status 1 if they differ or if the model did not learn.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import ferrovod as fv

Params = dict[str, np.ndarray]


def make_moons(n: int, noise: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two interleaving half circles in 2-D, labels 0/1; the same on every rank for a seed."""
    rng = np.random.default_rng(seed)
    t = rng.uniform(0.0, np.pi, size=n)
    label = rng.integers(0, 2, size=n)
    x = np.where(label == 0, np.cos(t), 1.0 - np.cos(t))
    y = np.where(label == 0, np.sin(t), 0.5 - np.sin(t))
    points = np.stack([x, y], axis=1) + rng.normal(0.0, noise, size=(n, 2))
    return points.astype(np.float32), label.astype(np.float32)


def init_params(hidden: int, seed: int) -> Params:
    """Random weights (different on every rank until rank 0's are broadcast)."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(0.0, 1.0, size=(2, hidden)) / np.sqrt(2.0)).astype(np.float32),
        "b1": np.zeros(hidden, dtype=np.float32),
        "w2": (rng.normal(0.0, 1.0, size=(hidden, 1)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(1, dtype=np.float32),
    }


def forward(params: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hidden activations and predicted probabilities of class 1."""
    h = np.tanh(x @ params["w1"] + params["b1"])
    logits = (h @ params["w2"] + params["b2"])[:, 0]
    return h, 1.0 / (1.0 + np.exp(-logits))


def loss_and_grads(params: Params, x: np.ndarray, y: np.ndarray) -> tuple[float, Params]:
    """Mean binary cross-entropy on a batch and its gradients, by hand."""
    h, p = forward(params, x)
    eps = 1e-7
    loss = float(-np.mean(y * np.log(p + eps) + (1.0 - y) * np.log(1.0 - p + eps)))
    d_logits = ((p - y) / len(y))[:, None].astype(np.float32)
    d_h = (d_logits @ params["w2"].T) * (1.0 - h * h)
    grads = {
        "w1": x.T @ d_h,
        "b1": d_h.sum(axis=0),
        "w2": h.T @ d_logits,
        "b2": d_logits.sum(axis=0),
    }
    return loss, grads


def evaluate(params: Params, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[loss, accuracy] of the model on this rank's shard, averaged over all ranks."""
    loss, _ = loss_and_grads(params, x, y)
    _, p = forward(params, x)
    accuracy = float(np.mean((p > 0.5) == (y > 0.5)))
    local = np.array([loss, accuracy], dtype=np.float64)
    # Every shard has the same size, so the mean of the ranks' means is the global mean.
    return fv.allreduce(local, op=fv.Average, name="metrics")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8192, help="dataset size (all ranks)")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=32)
    args = parser.parse_args()

    fv.init()
    rank, size = fv.rank(), fv.size()

    # The same dataset everywhere; each rank trains on its own contiguous shard.
    x_all, y_all = make_moons(args.samples, noise=0.1, seed=0)
    per_rank = args.samples // size
    x = x_all[rank * per_rank : (rank + 1) * per_rank]
    y = y_all[rank * per_rank : (rank + 1) * per_rank]

    params = init_params(args.hidden, seed=1234 + rank)
    names = sorted(params)
    for name in names:
        fv.broadcast_(params[name], root_rank=0, name=f"init.{name}")

    steps = per_rank // args.batch_size
    rng = np.random.default_rng(rank)
    if rank == 0:
        print(
            f"ferrovod demo: {size} ranks, {per_rank} samples each, "
            f"{steps} steps of {args.batch_size} per epoch"
        )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(per_rank)
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            _, grads = loss_and_grads(params, x[batch], y[batch])
            averaged = fv.grouped_allreduce(
                [grads[name] for name in names], op=fv.Average, name="grads"
            )
            for name, grad in zip(names, averaged):
                params[name] -= args.lr * grad
        loss, accuracy = evaluate(params, x, y)
        if rank == 0 and (epoch % 5 == 4 or epoch == args.epochs - 1):
            print(f"epoch {epoch + 1:3d}  loss {loss:.4f}  accuracy {accuracy:.3f}")
    elapsed = time.perf_counter() - start

    # Identical updates from identical starting points: the weights must agree to the bit.
    flat = np.concatenate([params[name].ravel() for name in names])
    gathered = fv.allgather(flat[None, :], name="final_weights")
    identical = all(np.array_equal(gathered[0], row) for row in gathered[1:])
    ok = identical and accuracy >= 0.95
    if rank == 0:
        print(
            f"trained in {elapsed:.2f} s; weights identical on all {size} ranks: {identical}; "
            f"final accuracy {accuracy:.3f}"
        )
        if not ok:
            print("FAILED: weights differ across ranks or the model did not learn")
    fv.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
