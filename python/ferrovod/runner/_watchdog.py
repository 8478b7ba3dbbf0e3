"""Kills a job's worker process groups if ``ferrovodrun`` dies without cleaning up.

Run as a separate process (by file path, with ``python -I``, so it imports nothing of
ferrovod). It reads commands from stdin, a pipe whose only writer is the launcher:

* ``+PGID`` — a worker process group was started;
* ``-PGID`` — that group is gone (the launcher checked);
* ``exit``  — the launcher finished its own cleanup; leave quietly.

End of input without ``exit`` means the launcher died (SIGKILL, OOM killer, crash): every group
still listed gets SIGKILL. ``PR_SET_PDEATHSIG`` already kills each worker itself; this catches
the workers' children, which that signal does not reach.
"""

import os
import signal
import sys
from typing import BinaryIO, Set, Tuple


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


def main() -> int:
    """Watches stdin until ``exit`` or EOF; on EOF, kills the groups still listed."""
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
