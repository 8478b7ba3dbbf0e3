"""A job that keeps running checked collectives while test_auth.py attacks its sockets.

Usage: auth_worker.py DIR. Rank 0 writes DIR/info.json (the rendezvous address and the job
secret, so the test can act as a legitimate client and record a real handshake) before
init(). The last rank waits for DIR/go before init(), so the others sit with their data
listeners open while the test connects to them. Then every rank runs allreduce / allgather /
broadcast steps, each checked against NumPy, until DIR/stop appears (or a safety limit);
rank 0 writes the number of steps done to DIR/progress as it goes.
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from fvtest import Checker, gen

import ferrovod as fv

LIMIT_S = 300.0  # stop on our own if the test never says so (it kills the job when it fails)


def write_atomic(path, text):
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main():
    out = Path(sys.argv[1])
    rank = int(os.environ["FERROVOD_RANK"])
    n = int(os.environ["FERROVOD_SIZE"])
    if rank == 0:
        write_atomic(out / "info.json", json.dumps({
            "rendezvous": os.environ["FERROVOD_RENDEZVOUS_ADDR"],
            "secret": os.environ["FERROVOD_SECRET"],
        }))
    if rank == n - 1:
        t0 = time.monotonic()
        while not (out / "go").exists():
            if time.monotonic() - t0 > LIMIT_S:
                print("FAIL: the test never said go", flush=True)
                sys.exit(1)
            time.sleep(0.02)

    fv.init()
    c = Checker(rank)
    t0 = time.monotonic()
    step = 0
    while True:
        key = (7, step)
        # allreduce: float64 sum, exact enough to compare tightly
        xs = [gen(key + (1,), r, np.float64, (257,)) for r in range(n)]
        c.array(fv.allreduce(xs[rank], op=fv.Sum, name=f"ar.{step % 5}"), np.sum(xs, axis=0),
                 f"allreduce step {step}")
        # allgather: a different first dimension on every rank
        parts = [gen(key + (2,), r, np.int32, (1 + (r + step) % 4, 3)) for r in range(n)]
        c.array(fv.allgather(parts[rank], name=f"ag.{step % 3}"), np.concatenate(parts),
                f"allgather step {step}")
        # broadcast from a rotating root
        root = step % n
        b = gen(key + (3,), root, np.float32, (64,))
        mine = b if rank == root else np.zeros_like(b)
        c.array(fv.broadcast(mine, root, name="bc"), b, f"broadcast step {step}")
        step += 1
        if rank == 0 and step % 5 == 0:
            write_atomic(out / "progress", str(step))
        # Every rank must leave after the same step: agree on it.
        local = (out / "stop").exists() or time.monotonic() - t0 > LIMIT_S
        if fv.allreduce(np.array([int(local)], np.int32), op=fv.Max, name="stop")[0]:
            break
    if rank == 0:
        write_atomic(out / "progress", str(step))
    print(f"steps {step}", flush=True)
    fv.shutdown()
    print(f"OK {c.count}", flush=True)


if __name__ == "__main__":
    main()
