"""One rank of a job that names the backend ``"ferrovod"`` without importing ferrovod: torch
loads it through the package's ``torch.distributed.backends`` entry point. Started as a plain
process, ``pg_entry_worker.py <rank> <size> <file store path>``; prints ``rank <r> OK <n>``."""

import sys

import torch
import torch.distributed as dist

rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
assert "ferrovod" not in sys.modules, "ferrovod was imported before torch asked for it"
dist.init_process_group("ferrovod", init_method=f"file://{path}", rank=rank, world_size=size)
assert dist.get_backend() == "ferrovod", dist.get_backend()
assert "ferrovod.torch.process_group" in sys.modules, "torch did not load the backend"
t = torch.full((3,), float(rank + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((3,), float(size * (size + 1) // 2))), t
dist.destroy_process_group()
print(f"rank {rank} OK 4", flush=True)
