"""Elastic training of a small CNN on scikit-learn's bundled 8x8 digits with ferrovod.torch.

    ferrovodrun -np 4 --min-np 2 --max-np 4 \\
        --host-discovery-script ./discover_hosts.sh python examples/elastic/pytorch_digits_elastic.py

``discover_hosts.sh`` prints the hosts available now, one ``host:slots`` per line (on one
machine, try ``echo localhost:2; echo 127.0.0.1:2``). Workers may be lost (a preempted node)
or added while the job runs; training goes on in the same processes from the last commit:

* ``TorchState`` holds the model, the optimizer, the ``ElasticSampler`` and the epoch;
* ``state.commit()`` every few batches saves them in memory (and is where a host change,
  announced by the launcher, takes effect on every rank together);
* a lost worker makes the others' next collective raise ``HorovodInternalError``:
  ``hvd.elastic.run`` restores the last commit, forms the job again with the survivors and
  calls ``train`` again, which carries on from ``state.epoch`` and the sampler's position;
* the learning rate follows the number of workers through a reset callback.

A Horovod elastic script with one line changed (``import ferrovod.torch as hvd``).
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

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


def accuracy(model: nn.Module, data: TensorDataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        correct = (model(x).argmax(1) == y).sum()
    total = hvd.allreduce(torch.tensor([float(correct), float(len(y))]), op=hvd.Sum,
                          name="accuracy")
    model.train()
    return float(total[0] / total[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01, help="per worker; scaled by their number")
    ap.add_argument("--batches-per-commit", type=int, default=5)
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train_set, test_set = datasets()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=42)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    def scale_lr() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([scale_lr])

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        if hvd.rank() == 0:
            print(f"training on {hvd.size()} workers from epoch {state.epoch}", flush=True)
        for epoch in range(state.epoch, args.epochs):
            loader = DataLoader(train_set, batch_size=args.batch_size, sampler=state.sampler)
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
                state.sampler.record_batch(i, len(y))
                if (i + 1) % args.batches_per_commit == 0:
                    state.commit()
            acc = accuracy(model, test_set)
            if hvd.rank() == 0:
                print(f"epoch {epoch}: test accuracy {acc * 100:.1f}% on {hvd.size()} workers",
                      flush=True)
            state.epoch = epoch + 1
            state.sampler.set_epoch(epoch + 1)
            state.commit()

    train(state)
    acc = accuracy(model, test_set)
    if hvd.rank() == 0:
        print(f"test accuracy: {acc * 100:.1f}%", flush=True)


if __name__ == "__main__":
    main()
