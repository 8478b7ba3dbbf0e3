"""One rank of a job on torch.distributed's ``backend="ferrovod"`` with CUDA tensors (see
test_gpu.py; started by ferrovodrun, ``init_process_group`` with no arguments). Every result is
compared with a reference computed on the host from every rank's inputs (each rank can make
any rank's inputs: they are a function of the rank):

- the collectives DDP, FSDP2 and the object collectives use, over several dtypes and odd sizes;
- DDP on the GPU (several bucket sizes, unused parameters) equal to one process training the
  same model on the whole batch, on the same GPU.

Each rank prints ``rank <r> OK <checks>`` at the end.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

import fvtest as T  # noqa: E402
import ferrovod.torch  # noqa: E402, F401 - registers the backend

R = dist.ReduceOp
# PG_DEVICE=cpu runs the same checks on the host (how this worker is checked without a GPU).
DEV = torch.device(os.environ.get("PG_DEVICE", "cuda:0"))
CK = T.Checker(0)  # its rank is set once the group has formed


def same(got, want, what):
    """``got`` (a tensor anywhere) equals ``want`` within its dtype's tolerance
    (``fvtest.tol``; exact for integers)."""
    got = got.detach().cpu().numpy()
    CK.array(got, np.asarray(want).astype(got.dtype), what)


def make(rank, n, dtype, salt):
    """Rank ``rank``'s input: small integers (halves for floats), exact in every dtype and in
    sums of a few ranks."""
    g = torch.Generator().manual_seed(7919 * salt + rank)
    x = torch.randint(-40, 41, (n,), generator=g)
    return (x.to(dtype) / 2) if dtype.is_floating_point else x.to(dtype)


def section_collectives():
    r, n = dist.get_rank(), dist.get_world_size()
    salt = 0
    for dtype in (torch.float32, torch.float16, torch.float64, torch.int64, torch.int32):
        for size in (1, 7, 1023, 65537):
            salt += 1
            every = [make(k, size, dtype, salt) for k in range(n)]
            host = np.stack([x.double().numpy() for x in every])
            ops = [(R.SUM, host.sum(0)), (R.MAX, host.max(0)), (R.MIN, host.min(0))]
            if dtype.is_floating_point:
                ops.append((R.AVG, host.mean(0)))
            for op, want in ops:
                t = every[r].to(DEV, copy=True)
                dist.all_reduce(t, op=op)
                same(t, want, f"all_reduce {op} {dtype} [{size}]")
            root = salt % n
            t = every[r].to(DEV, copy=True)
            dist.broadcast(t, src=root)
            same(t, every[root], f"broadcast from {root} {dtype} [{size}]")
            out = torch.empty(size * n, dtype=dtype, device=DEV)
            dist.all_gather_into_tensor(out, every[r].to(DEV, copy=True))
            same(out, torch.cat(every), f"all_gather_into_tensor {dtype} [{size}]")
            outs = [torch.empty(size, dtype=dtype, device=DEV) for _ in range(n)]
            dist.all_gather(outs, every[r].to(DEV, copy=True))
            same(torch.cat([o.cpu() for o in outs]), torch.cat(every), f"all_gather {dtype} [{size}]")
            # reduce_scatter_tensor: rank k keeps the k-th block of the sum.
            whole = [make(k, size * n, dtype, salt + 1000) for k in range(n)]
            out = torch.empty(size, dtype=dtype, device=DEV)
            dist.reduce_scatter_tensor(out, whole[r].to(DEV, copy=True))
            total = np.stack([x.double().numpy() for x in whole]).sum(0)
            same(out, total[r * size:(r + 1) * size], f"reduce_scatter_tensor {dtype} [{size}]")
            # all_to_all_single with uneven splits: rank k sends k + j + 1 elements to rank j.
            sends = [r + j + 1 for j in range(n)]
            mine = make(r, sum(sends), dtype, salt + 2000)
            got = torch.empty(sum(k + r + 1 for k in range(n)), dtype=dtype, device=DEV)
            dist.all_to_all_single(got, mine.to(DEV, copy=True), output_split_sizes=[k + r + 1 for k in range(n)],
                                   input_split_sizes=sends)
            want = []
            for k in range(n):
                theirs = make(k, sum(k + j + 1 for j in range(n)), dtype, salt + 2000)
                start = sum(k + j + 1 for j in range(r))
                want.append(theirs[start:start + k + r + 1])
            same(got, torch.cat(want), f"all_to_all_single {dtype} [{size}]")
    t = torch.zeros(3, device=DEV)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    fut.wait()
    CK.true(work.wait(), "async all_reduce's wait")
    dist.barrier()


def batch(step, rank, per):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(per, 12, generator=g), torch.randn(per, 3, generator=g)


class Net(nn.Module):
    """Two layers; with ``unused``, a third that takes no part in the loss."""

    def __init__(self, unused):
        super().__init__()
        self.a, self.b = nn.Linear(12, 33), nn.Linear(33, 3)
        if unused:
            self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def section_ddp():
    """DDP on the GPU equal to one process on the whole batch: each rank's loss is its mean
    over its share of the batch, so DDP's averaged gradient is the whole batch's."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    per = 5
    for kwargs in (dict(), dict(bucket_cap_mb=0.001), dict(find_unused_parameters=True)):
        torch.manual_seed(0)
        unused = kwargs.get("find_unused_parameters", False)
        ref = Net(unused).to(DEV)
        model = Net(unused).to(DEV)
        model.load_state_dict(ref.state_dict())
        ddp = DDP(model, device_ids=[0] if DEV.type == "cuda" else None, **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        for step in range(5):
            x, y = batch(step, r, per)
            nn.functional.mse_loss(ddp(x.to(DEV, copy=True)), y.to(DEV, copy=True)).backward()
            opt.step()
            opt.zero_grad()
            xs, ys = zip(*(batch(step, k, per) for k in range(n)))
            nn.functional.mse_loss(ref(torch.cat(xs).to(DEV, copy=True)), torch.cat(ys).to(DEV, copy=True)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            same(p.detach(), q.detach().cpu(), f"DDP {kwargs} {name} after 5 steps")


def main():
    if DEV.type == "cuda":
        torch.cuda.set_device(DEV)
    dist.init_process_group("ferrovod")
    CK.rank = dist.get_rank()
    for section in sys.argv[1:] or ["collectives", "ddp"]:
        globals()[f"section_{section}"]()
    print(f"rank {dist.get_rank()} OK {CK.count}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
