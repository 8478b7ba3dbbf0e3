"""Rank 1 skips one tensor, which every rank reduced once before (so the others submit it as
a cached id, which relays hold while a rank below them has not submitted it). Rank 0's stall
inspector must warn, naming the tensor and rank 1; with a shutdown time, every rank's pending
op on it must fail instead of hanging.

usage: stall_worker.py MODE DIR
  warn      rank 1 submits the tensor once rank 0 has warned about it (rank 0 writes
            DIR/warned when its logger gets the warning)
  quiet     rank 1 submits it after 3.5 s, more than three stall check times: with the
            inspector off there is no warning to wait for, and a window is all an absence has
  shutdown  rank 1 never submits it; it stays up until the others have seen their op fail
            (each writes DIR/failed.<rank>), so that nothing but the stall shutdown ends it
"""

import logging
import sys
import time
from pathlib import Path

import numpy as np

import ferrovod as fv

WAIT_S = 120  # for events that come within seconds: only a broken build waits this long


def wait_for(paths, what):
    deadline = time.monotonic() + WAIT_S
    while not all(p.exists() for p in paths):
        if time.monotonic() > deadline:
            print(f"FAIL: waited {WAIT_S} s for {what}", flush=True)
            sys.exit(1)
        time.sleep(0.02)


class _NoteWarning(logging.Handler):
    """Writes DIR/warned when the stall inspector names the skipped tensor."""

    def __init__(self, path):
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record):
        text = record.getMessage()
        if "Missing ranks:" in text and "skipped.by.rank1" in text:
            self.path.touch()


mode, out = sys.argv[1], Path(sys.argv[2])
fv.init()
r, n = fv.rank(), fv.size()
if r == 0:
    logging.getLogger("ferrovod").addHandler(_NoteWarning(out / "warned"))
# Through the engine (an async op), so that the name gets a response-cache id.
fv.synchronize(fv.allreduce_async(np.ones(3, np.float32), name="skipped.by.rank1"))
if r != 1:
    h = fv.allreduce_async(np.ones(3, np.float32), name="skipped.by.rank1")
if mode in ("warn", "quiet"):
    if r == 1:
        if mode == "warn":
            wait_for([out / "warned"], "rank 0's stall warning")
        else:
            time.sleep(3.5)  # FERROVOD_STALL_CHECK_TIME_SECONDS is 1
        fv.allreduce(np.ones(3, np.float32), name="skipped.by.rank1")
        print("OK late submission")
    else:
        fv.synchronize(h)
        print("OK completed after the late submission")
else:
    if r == 1:
        wait_for([out / f"failed.{q}" for q in range(n) if q != 1], "the others' errors")
        print("OK never submitted")
    else:
        t0 = time.time()
        try:
            fv.synchronize(h)
            print("no error")
            sys.exit(1)
        except fv.FerrovodTimeoutError as e:
            print(f"OK {type(e).__name__} after {time.time() - t0:.1f}s: {e}", flush=True)
        finally:
            (out / f"failed.{r}").touch()
