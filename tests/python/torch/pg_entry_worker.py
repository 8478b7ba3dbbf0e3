"""One rank of a job that names the backend ``"ferrovod"`` without importing ferrovod: torch
loads it through the package's ``torch.distributed.backends`` entry point. Started as a plain
process, ``pg_entry_worker.py <rank> <size> <file store path> [how[,how...]]``, where each
``how`` is a way the job meets, tried in turn (a group made, checked and destroyed each time):
``file`` (``init_method="file://<path>"``, the default), ``tcp:<port>``
(``init_method="tcp://127.0.0.1:<port>"``, a store the test hosts there, as torchrun's agent
does) or ``store:<port>`` (``store=`` a client of the test's store at that port); prints
``rank <r> met over <how>`` for each and ``rank <r> OK <n>`` at the end."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ways = (sys.argv[4] if len(sys.argv) > 4 else "file").split(",")
assert "ferrovod" not in sys.modules, "ferrovod was imported before torch asked for it"
checks = 0
for how in ways:
    if how == "file":
        dist.init_process_group("ferrovod", init_method=f"file://{path}", rank=rank,
                                world_size=size)
    elif how.startswith("tcp:"):
        dist.init_process_group("ferrovod", init_method=f"tcp://127.0.0.1:{how[4:]}", rank=rank,
                                world_size=size)
    else:
        store = dist.TCPStore("127.0.0.1", int(how[6:]), size, False, timedelta(seconds=60))
        dist.init_process_group("ferrovod", store=store, rank=rank, world_size=size)
    assert dist.get_backend() == "ferrovod", dist.get_backend()
    assert "ferrovod.torch.process_group" in sys.modules, "torch did not load the backend"
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(size * (size + 1) // 2))), t
    dist.destroy_process_group()
    checks += 4
    print(f"rank {rank} met over {how}", flush=True)
print(f"rank {rank} OK {checks}", flush=True)
