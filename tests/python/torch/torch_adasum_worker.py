"""DistributedOptimizer(op=Adasum) on a real job: each rank steps its own optimizer (SGD with
momentum, then Adam) on its own batch; the parameters must equal a reference that simulates
every rank's optimizer here and combines their deltas with NumPy's Adasum recurrence. Then the
two ends it interpolates between, in training: ranks whose steps change disjoint weights
(orthogonal deltas) move as the Sum of their steps, ranks with the same batch (equal deltas)
as their Average, i.e. one rank's step.

usage: torch_adasum_worker.py   (under ferrovodrun; prints OK n)
"""

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
import fvtest as T  # noqa: E402

import ferrovod.torch as hvd  # noqa: E402

STEPS = 4


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, 1)).double()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 5, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True) * (rank + 1)


def local_step(m, opt, rank, step):
    opt.zero_grad()
    x, y = batch(rank, step)
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    ck = T.Checker(r)
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                 lambda ps: torch.optim.Adam(ps, lr=0.05)):
        m = model()
        opt = hvd.DistributedOptimizer(make(m.parameters()), named_parameters=m.named_parameters(),
                                       op=hvd.Adasum)
        # The reference: every rank's model and optimizer, stepped here.
        refs = [model() for _ in range(n)]
        ref_opts = [make(rm.parameters()) for rm in refs]
        for step in range(STEPS):
            local_step(m, opt, r, step)
            starts = [[p.detach().clone() for p in rm.parameters()] for rm in refs]
            for q, (rm, ro) in enumerate(zip(refs, ref_opts)):
                local_step(rm, ro, q, step)
            for i in range(len(starts[0])):
                deltas = [(list(rm.parameters())[i] - starts[q][i]).detach().numpy()
                          for q, rm in enumerate(refs)]
                combined = torch.from_numpy(T.ref_adasum(deltas, np.float64))
                with torch.no_grad():
                    for q, rm in enumerate(refs):
                        list(rm.parameters())[i].copy_(starts[q][i] + combined)
            for (name, p), want in zip(m.named_parameters(), refs[0].parameters()):
                ck.array(p.detach().numpy(), want.detach().numpy(),
                         f"{type(opt).__name__} step {step} {name}")
    interpolation(ck, r, n)
    return ck.count


def interpolation(ck, r, n):
    # Rank r's inputs are non-zero only in feature r: its gradient touches weight r alone.
    def linear():
        torch.manual_seed(3)
        return torch.nn.Linear(n, 1, bias=False).double()

    def sgd_step(m, x, y):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()

    def rank_batch(q, same):
        x = torch.zeros(4, n, dtype=torch.float64)
        x[:, 0 if same else q] = torch.arange(1.0, 5.0, dtype=torch.float64)
        return x, torch.ones(4, 1, dtype=torch.float64) * 3

    for same in (False, True):
        m = linear()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), op=hvd.Adasum)
        opt.zero_grad()
        x, y = rank_batch(r, same)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
        start = linear().weight.detach().clone()
        deltas = []
        for q in range(n):
            rm = linear()
            sgd_step(rm, *rank_batch(q, same))
            deltas.append(rm.weight.detach() - start)
        want = start + (deltas[0] if same else sum(deltas))  # mean of equal deltas; sum
        ck.array(m.weight.detach().numpy(), want.numpy(),
                 "Adasum of equal steps is their average" if same
                 else "Adasum of orthogonal steps is their sum")


if __name__ == "__main__":
    T.run_main(main)
