"""Rank 0 exits right after init; the other ranks idle a while and report their CPU time, which
must stay near zero: an engine whose coordinator has gone must sleep, not spin."""

import sys
import time

import ferrovod as fv

fv.init()
if fv.rank() == 0:
    fv.shutdown()
    sys.exit(0)
time.sleep(0.5)  # let rank 0's departure arrive
t0 = time.process_time()
time.sleep(2.0)
used = time.process_time() - t0
print(f"CPU {used:.3f}", flush=True)
try:
    fv.allreduce([1.0], name="after")
    print("no error after rank 0 left")
    sys.exit(1)
except fv.ShutdownError as e:
    print(f"OK ShutdownError: {e}")
