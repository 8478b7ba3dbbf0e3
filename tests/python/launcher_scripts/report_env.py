"""Prints what a worker received from ferrovodrun as one JSON line on stdout."""

import json
import os
import socket
import sys


def rendezvous_reachable(addr):
    if not addr:
        return None
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5):
            return True
    except OSError:
        return False


def main():
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("FERROVOD_", "HOROVOD_", "OMP_", "OPENBLAS_", "MKL_"))}
    env["PYTHONUNBUFFERED"] = os.environ.get("PYTHONUNBUFFERED")
    with open("/proc/self/cmdline", "rb") as f:
        cmdline = f.read().decode("utf-8", "replace")
    report = {
        "env": env,
        "argv": sys.argv,
        "cmdline": cmdline,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "pgid": os.getpgid(0),
        "sid": os.getsid(0),
        "stdin_is_devnull": os.path.samefile("/proc/self/fd/0", os.devnull)
        if os.path.exists("/proc/self/fd/0")
        else None,
        "rendezvous_reachable": rendezvous_reachable(env.get("FERROVOD_RENDEZVOUS_ADDR")),
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main()
