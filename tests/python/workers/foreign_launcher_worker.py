"""Started by a launcher other than ferrovodrun (torchrun, mpirun, srun, or a test imitating
their environment): init() must find the job from that launcher's variables."""

import os
import sys
import time

import numpy as np

import ferrovod as fv

mode = sys.argv[1] if len(sys.argv) > 1 else "ops"
if mode == "torch_group":
    # As Ray Train's TorchTrainer (or a script calling init_process_group first) does: torch's
    # process group already serves its store on MASTER_PORT.
    import torch.distributed as dist

    dist.init_process_group("gloo")
fv.init()
r, n = fv.rank(), fv.size()
out = fv.allreduce(np.full(5, r + 1, np.float64), op=fv.Sum, name="sum")
assert (out == n * (n + 1) / 2).all(), out
g = fv.allgather(np.full((1, 2), r, np.int32), name="gather")
assert g[:, 0].tolist() == list(range(n)), g
if mode == "kill":
    # Rank 1 dies once every rank is up (the allgather above); the others are in the loop or
    # about to be, and either way their next op needs it.
    if r == 1:
        os.kill(os.getpid(), 9)
    t0 = time.time()
    try:
        for i in range(100000):
            fv.allreduce(np.ones(16), name="loop")
    except fv.RankFailureError as e:
        print(f"OK rank {r} saw RankFailureError rank={e.rank} after {time.time() - t0:.2f}s "
              f"msg={e}")
        sys.exit(0)
if mode == "cut":
    # Loops until the link to the other host is cut; reports the error and when it came.
    try:
        for i in range(10**9):
            fv.allreduce(np.ones(1024), name="loop")
            if i == 20:
                print("READY", flush=True)
    except fv.FerrovodError as e:
        print(f"ERR {type(e).__name__} {time.time():.3f} {e}", flush=True)
        sys.exit(0)
if mode == "torch_group":
    # A second init() agrees on its rendezvous through the same group again.
    fv.shutdown()
    fv.init()
    out = fv.allreduce(np.full(3, r, np.float64), op=fv.Sum, name="again")
    assert (out == n * (n - 1) / 2).all(), out
    dist.barrier()
    dist.destroy_process_group()
print(f"OK rank={r} size={n} local_rank={fv.local_rank()} local_size={fv.local_size()} "
      f"cross_size={fv.cross_size()}", flush=True)
