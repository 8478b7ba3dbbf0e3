"""Kills a job's worker process groups if ``ferrovodrun`` dies without cleaning up.

Run as a separate process (by file path, with ``python -I``, so it imports nothing of
ferrovod). It reads commands from stdin, a pipe whose only writer is the launcher:

* ``+PGID`` — a worker process group was started;
* ``-PGID`` — that group is gone (the launcher checked);
* ``exit``  — the launcher finished its own cleanup; leave quietly.

End of input without ``exit`` means the launcher died (SIGKILL, OOM killer, crash): every group
still listed gets SIGKILL, and so does every process whose environment holds ``VAR=<this
process's pid>`` (``VAR`` is the first argument; the launcher sets it in every process it
starts), with its group where it leads one: a worker spawned just before the launcher died,
which it could not register, or one of the workers' children that left its group.
"""

import os
import signal
import sys
from typing import BinaryIO, List, Set, Tuple


def _read_commands(stream: BinaryIO) -> Tuple[Set[int], bool]:
    """Applies the commands; returns (groups still listed, whether ``exit`` was read)."""
    groups: Set[int] = set()
    for raw in stream:
        line = raw.strip()
        if line == b"exit":
            return groups, True
        try:
            if line.startswith(b"+"):
                groups.add(int(line[1:]))
            elif line.startswith(b"-"):
                groups.discard(int(line[1:]))
        except ValueError:
            continue
    return groups, False


def _marked(mark: bytes) -> List[int]:
    """Every process whose environment holds ``mark`` (a whole ``VAR=value`` entry)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue  # gone, or not ours to read
        if mark in env.split(b"\0"):
            found.append(int(name))
    return found


def _kill(pid: int) -> None:
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


def main() -> int:
    """Watches stdin until ``exit`` or EOF; on EOF, kills the groups still listed and every
    process carrying this watchdog's mark."""
    # Terminal signals are the launcher's business; the watchdog must outlive it.
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)
    groups, clean = _read_commands(sys.stdin.buffer)
    if clean:
        return 0
    for pgid in sorted(groups):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    if len(sys.argv) > 1:
        mark = f"{sys.argv[1]}={os.getpid()}".encode()
        for pid in _marked(mark):
            _kill(pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
