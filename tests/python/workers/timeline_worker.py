"""Runs a known sequence of ops for the timeline tests. Mode "env": the timeline comes from
FERROVOD_TIMELINE; mode "runtime": start_timeline()/stop_timeline() around part of it."""

import sys

import numpy as np

import ferrovod as fv

mode, path = sys.argv[1], sys.argv[2]
fv.init()
r = fv.rank()
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
print("OK")
