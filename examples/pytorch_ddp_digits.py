"""Train a small CNN on scikit-learn's bundled 8x8 digits with torch's DistributedDataParallel on
ferrovod's engine.

    torchrun --standalone --nproc-per-node 2 examples/pytorch_ddp_digits.py
    ferrovodrun -np 2 python examples/pytorch_ddp_digits.py

A plain DDP script whose one ferrovod line is the backend's name in ``init_process_group``
(torch finds the backend through the installed package's entry point; nothing imports
ferrovod). It starts wherever torch's ``env://`` does: torchrun (one host or ``--nnodes``),
Kubeflow's PyTorchJob and TrainJob, Ray Train, or ferrovodrun, which exports torch's variables.
Each rank trains on its shard (``DistributedSampler``), DDP averages the gradients in buckets
and starts from rank 0's weights, metrics are summed with ``all_reduce``, and rank 0 writes
the checkpoint. The model, data and schedule are ``pytorch_digits.py``'s.
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def datasets():
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    return TensorDataset(xtr, ytr), TensorDataset(xte, yte)


def metric_average(value: float, count: float) -> float:
    """The mean over every rank's samples: sums of value*count and of count, all-reduced."""
    t = torch.tensor([value * count, count], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def evaluate(model: nn.Module, loader: DataLoader) -> tuple:
    model.eval()
    loss, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            out = model(x)
            loss += float(F.cross_entropy(out, y, reduction="sum"))
            correct += int((out.argmax(1) == y).sum())
            count += len(y)
    count = max(count, 1)
    return metric_average(loss / count, count), metric_average(correct / count, count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--backend", default="ferrovod", help="gloo to compare")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                             "ferrovod_pytorch_ddp_digits.pt"))
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)  # different on purpose: DDP starts from rank 0's
    torch.set_num_threads(1)

    train_set, test_set = datasets()
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = DistributedDataParallel(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * size, momentum=0.9)

    t0 = time.time()
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        seen, loss_sum = 0, 0.0
        for x, y in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach().item() * len(y)
            seen += len(y)
        train_loss = metric_average(loss_sum / max(seen, 1), seen)
        test_loss, test_acc = evaluate(model.module, test_loader)
        if rank == 0:
            print(f"epoch {epoch:2d}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                  f"test accuracy {100 * test_acc:.2f}%", flush=True)
            torch.save({"epoch": epoch, "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict()}, args.checkpoint)
    if rank == 0:
        print(f"ranks: {size}  backend: {dist.get_backend()}  time: {time.time() - t0:.1f} s  "
              f"checkpoint: {args.checkpoint}", flush=True)
        print(f"test accuracy: {100 * test_acc:.2f}%", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
