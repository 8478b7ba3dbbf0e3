"""Train a small CNN on scikit-learn's bundled 8x8 digits with ferrovod.torch.

    ferrovodrun -np 2 python examples/pytorch_digits.py

A Horovod PyTorch script with one line changed (``import ferrovod.torch as hvd``): each rank
trains on its shard of the data (``DistributedSampler``), the initial weights and optimizer
state come from rank 0 (``broadcast_parameters`` / ``broadcast_optimizer_state``), gradients
are averaged by ``DistributedOptimizer``, metrics are averaged across ranks, and only rank 0
writes the checkpoint. The dataset ships inside scikit-learn: nothing is downloaded.
"""

import argparse
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ferrovod.torch as hvd


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


def metric_average(value: float, count: float, name: str) -> float:
    """The mean over every rank's samples: sums of value*count and of count, allreduced."""
    t = torch.tensor([value * count, count], dtype=torch.float64)
    total = hvd.allreduce(t, op=hvd.Sum, name=name)
    return float(total[0] / total[1])


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
    return (metric_average(loss / count, count, "test_loss"),
            metric_average(correct / count, count, "test_accuracy"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.01, help="scaled by the number of ranks")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(),
                                                             "ferrovod_pytorch_digits.pt"))
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed + hvd.rank())  # different on purpose: rank 0's weights win
    torch.set_num_threads(1)

    train_set, test_set = datasets()
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                       shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank(),
                                      shuffle=False)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(test_set, batch_size=256, sampler=test_sampler)

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

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
        train_loss = metric_average(loss_sum / max(seen, 1), seen, "train_loss")
        test_loss, test_acc = evaluate(model, test_loader)
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                  f"test accuracy {100 * test_acc:.2f}%", flush=True)
            torch.save({"epoch": epoch, "model": model.state_dict(),
                        "optimizer": optimizer.state_dict()}, args.checkpoint)
    if hvd.rank() == 0:
        print(f"ranks: {hvd.size()}  time: {time.time() - t0:.1f} s  "
              f"checkpoint: {args.checkpoint}", flush=True)
        print(f"test accuracy: {100 * test_acc:.2f}%", flush=True)


if __name__ == "__main__":
    main()
