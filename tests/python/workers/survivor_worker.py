"""Rank 1 SIGKILLs itself while the others wait for it in an allreduce; nobody catches the error.

usage: survivor_worker.py CLEANUP_S

Unlike errors_worker.py's ``kill`` case, the survivors keep the default SIGTERM action, as a
training script does: when the launcher stops them, they die. Each lets the RankFailureError
propagate through a ``finally`` that takes CLEANUP_S seconds (a script saving its state), so
Python prints the traceback only after that: the line can reach the log only if the launcher
leaves the survivors the time to get there.
"""

import os
import signal
import sys
import time

import numpy as np

import fvtest as T

import ferrovod as fv


def main():
    cleanup_s = float(sys.argv[1])
    fv.init()
    r = fv.rank()
    x = np.ones(256, np.float32)
    job = fv.allgather_object(os.getpid(), name="pids")[0]  # everyone is up and connected
    blocking = T.Marks(job, "survivor")
    if r == 1:
        blocking.wait([o for o in range(fv.size()) if o != 1])
        print("killing myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    blocking.set(r)
    try:
        fv.allreduce(x, name="victim")
    finally:
        time.sleep(cleanup_s)
    print("the allreduce succeeded without rank 1", flush=True)


if __name__ == "__main__":
    main()
