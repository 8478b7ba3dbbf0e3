"""Rank 1 skips one tensor, which every rank reduced once before (so the others submit it as
a cached id, which relays hold while a rank below them has not submitted it). Rank 0's stall
inspector must warn, naming the tensor and rank 1; with a shutdown time, every rank's pending
op on it must fail instead of hanging."""

import sys
import time

import numpy as np

import ferrovod as fv

mode = sys.argv[1]
fv.init()
r = fv.rank()
# Through the engine (an async op), so that the name gets a response-cache id.
fv.synchronize(fv.allreduce_async(np.ones(3, np.float32), name="skipped.by.rank1"))
if r != 1:
    h = fv.allreduce_async(np.ones(3, np.float32), name="skipped.by.rank1")
if mode == "warn":
    time.sleep(3.5)  # longer than FERROVOD_STALL_CHECK_TIME_SECONDS
    if r == 1:
        fv.allreduce(np.ones(3, np.float32), name="skipped.by.rank1")
        print("OK late submission")
    else:
        fv.synchronize(h)
        print("OK completed after the late submission")
else:
    if r == 1:
        time.sleep(6)
        print("OK never submitted")
    else:
        t0 = time.time()
        try:
            fv.synchronize(h)
            print("no error")
            sys.exit(1)
        except fv.FerrovodTimeoutError as e:
            print(f"OK {type(e).__name__} after {time.time() - t0:.1f}s: {e}")
