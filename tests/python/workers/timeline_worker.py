"""Runs a known sequence of ops for the timeline tests. Mode "env": the timeline comes from
FERROVOD_TIMELINE; mode "runtime": start_timeline()/stop_timeline() around part of it; mode
"live": as "env", and rank 0 then reads the file while the job still runs. Mode "torch":
ferrovod.torch's ops, an allreduce, a broadcast and an allgather given one name, in flight
together, then two called in different orders."""

import sys
import time

import numpy as np

import ferrovod as fv

mode, path = sys.argv[1], sys.argv[2]
fv.init()
r = fv.rank()
if mode == "torch":
    import torch

    import ferrovod.torch as hvd

    n = fv.size()
    for step in range(3):  # the first step in full, then from the response cache
        x = torch.full((4,), float(r + step))
        a = hvd.allreduce_async(x, op=hvd.Sum, name="tl.twin")
        b = hvd.broadcast_async(x, root_rank=1, name="tl.twin")
        g = hvd.allgather_async(torch.full((r + 1, 2), float(r)), name="tl.twin")
        assert hvd.synchronize(g).tolist() == [[float(k)] * 2 for k in range(n) for _ in range(k + 1)]
        assert hvd.synchronize(b).tolist() == [1.0 + step] * 4
        assert hvd.synchronize(a).tolist() == [float(sum(range(n)) + n * step)] * 4
    # Called in different orders, two ops under one name fail on every rank, both of them.
    x = torch.ones(3)
    calls = [lambda: hvd.allreduce_async(x, name="tl.swap"),
             lambda: hvd.broadcast_async(x, root_rank=0, name="tl.swap")]
    handles = [c() for c in (calls if r == 0 else calls[::-1])]
    for h in handles:
        try:
            hvd.synchronize(h)
            raise AssertionError(f"rank {r}: ops called in different orders did not fail")
        except fv.MismatchError as e:
            assert "'tl.swap'" in str(e) and "rank 0 sent" in str(e), str(e)
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum, name="tl.after").tolist() == [float(n)] * 2
    print("OK")
    sys.exit(0)
if mode == "runtime":
    fv.allreduce(np.ones(4), name="before.start")
    fv.start_timeline(path, mark_cycles=True)
for step in range(3):
    fv.allreduce(np.full(8, r, np.float32), name="tl.a")
fv.grouped_allreduce([np.ones(5, np.float32), np.ones(3, np.float32)], name="tl.group")
fv.allgather(np.ones((r + 1, 2), np.int32), name="tl.gather")
fv.broadcast(np.arange(4.0), root_rank=0, name="tl.bcast")
if mode == "runtime":
    fv.stop_timeline()
    fv.allreduce(np.ones(4), name="after.stop")
if mode == "live" and r == 0:
    # Horovod's timeline can be watched during training: what was recorded reaches the file
    # while the job runs (the writer wakes a few times a second), not only once it ends.
    deadline = time.monotonic() + 60
    while True:
        with open(path) as f:
            text = f.read()
        missing = [n for n in ("tl.a", "tl.group", "tl.gather", "tl.bcast") if n not in text]
        if not missing:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"while running, the timeline lacks {missing}: {text!r}")
        time.sleep(0.05)
fv.barrier()
print("OK")
