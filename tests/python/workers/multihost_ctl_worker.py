"""A worker whose job is to be stopped: for the multi-host stop and failure tests.

usage: multihost_ctl_worker.py MODE [RANK]
  loop       allreduce forever; every rank prints READY after its first steps
  fail R     rank R exits with code 3 after the first steps; the others, once their next
             allreduce fails, wait to be stopped by the launcher (so rank R's is the only
             failure it sees, and stopping them is its job)
"""

import sys
import time

import numpy as np

import ferrovod as fv

mode = sys.argv[1]
fail_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
fv.init()
r = fv.rank()
step = 0
while True:
    try:
        fv.allreduce(np.ones(64), name="loop")
    except fv.FerrovodError:
        if mode != "fail":
            raise
        time.sleep(120)
    step += 1
    if step == 5:
        print(f"READY {r}", flush=True)
        if mode == "fail" and r == fail_rank:
            sys.exit(3)
    time.sleep(0.01)
