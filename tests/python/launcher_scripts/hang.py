"""A worker that records its pid, optionally starts a grandchild, then sleeps or fails.

Usage: hang.py DIR [--grandchild] [--ignore-term] [--fail-rank R] [--code C] [--signal S]

Writes DIR/pid.<rank> (and DIR/child.<rank> for the grandchild). The failing rank first waits
until every rank has written its pid file, so the test can check that the others get stopped.
"""

import argparse
import os
import signal
import subprocess
import sys
import time


def write_atomically(path, text):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)


def wait_for_all(directory, size, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(directory, f"pid.{r}")) for r in range(size)):
            return
        time.sleep(0.01)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--grandchild", action="store_true")
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--code", type=int, default=0)
    parser.add_argument("--signal", type=int, default=0)
    args = parser.parse_args()

    rank = int(os.environ["FERROVOD_RANK"])
    size = int(os.environ["FERROVOD_SIZE"])
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        child = subprocess.Popen(["sleep", "300"])
        write_atomically(os.path.join(args.dir, f"child.{rank}"), str(child.pid))
    write_atomically(os.path.join(args.dir, f"pid.{rank}"), str(os.getpid()))
    print(f"rank {rank} ready", flush=True)

    if rank == args.fail_rank:
        wait_for_all(args.dir, size)
        print(f"rank {rank} failing", flush=True)
        if args.signal:
            os.kill(os.getpid(), args.signal)
        sys.exit(args.code)
    time.sleep(300)


if __name__ == "__main__":
    main()
