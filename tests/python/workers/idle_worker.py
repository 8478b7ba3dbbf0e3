"""Rank 0 exits right after init; the other ranks idle a while and report their CPU time, which
must stay near zero: an engine whose coordinator has gone must sleep, not spin.

The idle window starts once rank 0's process has ended, so that its sockets are closed and
what the engine does about that (a closed socket polls readable for good) falls inside it.
"""

import os
import sys
import time

import numpy as np

import ferrovod as fv

WINDOW_S = 2.0


def ended(pid):
    """True once ``pid`` has exited (a zombie has closed its sockets too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


fv.init()
pids = fv.allgather(np.array([os.getpid()], np.int64), name="pids")
if fv.rank() == 0:
    fv.shutdown()
    sys.exit(0)
deadline = time.monotonic() + 60
while not ended(int(pids[0])):
    if time.monotonic() > deadline:
        print("FAIL: rank 0 did not exit within 60 s", flush=True)
        sys.exit(1)
    time.sleep(0.01)
t0 = time.process_time()
time.sleep(WINDOW_S)
used = time.process_time() - t0
print(f"CPU {used:.3f} in {WINDOW_S} s", flush=True)
try:
    fv.allreduce([1.0], name="after")
    print("no error after rank 0 left")
    sys.exit(1)
except fv.ShutdownError as e:
    print(f"OK ShutdownError: {e}")
