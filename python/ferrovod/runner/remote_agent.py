"""The remote end of a multi-host ``ferrovodrun``: started on each host over ssh.

``python -m ferrovod.runner.remote_agent --check [--iface NAME] [--cwd DIR]`` prints one JSON
line describing this host (the launcher calls it before starting anything): that ferrovod's
native core imports, the cores this process may use, the network interfaces, whether the
working directory exists, and ``SSH_CONNECTION`` (whose first field is the launcher's address
as this host reaches it).

``python -m ferrovod.runner.remote_agent`` (no flags) starts one worker. The launcher writes one
JSON line to stdin — ``argv``, ``env``, ``cwd`` and ``local_size`` — and keeps stdin open for
the life of the job. The job secret travels in that line, so it is never on a command line where
``ps`` would show it. The worker runs in its own session; the agent

* exits with the worker's status (128 + N for a signal, as a shell reports it);
* stops the worker's whole process group (SIGTERM, then SIGKILL after a grace period) when its
  stdin reaches end of file: the launcher closed it to stop the job, or the ssh connection
  died with the launcher; either way nothing is left running on this host;
* passes SIGTERM, SIGINT and SIGHUP on to the worker's group.

The agent imports no framework, so starting a worker through it costs a Python start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Dict, List, Mapping, Optional

from .cpus import bind_in_child, bind_worker, usable_cpu_count
from .supervisor import _group_alive, _signal_group
from .worker_env import thread_share

GRACE_S = 3.0
_POLL_S = 0.05


def _interfaces() -> List[str]:
    try:
        return sorted(name for _, name in socket.if_nameindex())
    except OSError:
        return []


def check(iface: Optional[str], cwd: Optional[str]) -> Dict[str, Any]:
    """What the launcher needs to know about this host before it starts anything."""
    report: Dict[str, Any] = {
        "python": sys.executable,
        "cores": usable_cpu_count(),
        "interfaces": _interfaces(),
        "ssh_connection": os.environ.get("SSH_CONNECTION", ""),
    }
    try:
        import ferrovod
        import ferrovod._core  # noqa: F401 - the native core is what a worker needs

        report["version"] = getattr(ferrovod, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - any import failure is the answer
        report["error"] = f"ferrovod is not importable by {sys.executable}: {exc}"
        return report
    if cwd is not None and not os.path.isdir(cwd):
        report["error"] = f"the working directory {cwd} does not exist here"
    elif iface is not None and iface not in report["interfaces"]:
        report["error"] = (
            f"no network interface {iface!r} here (interfaces: {', '.join(report['interfaces'])})"
        )
    return report


def _stop_group(proc: "subprocess.Popen[bytes]", grace_s: float) -> None:
    """SIGTERM to the worker's group, SIGKILL to what is left after ``grace_s``."""
    pgid = proc.pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(pgid):
            return
        time.sleep(_POLL_S)
    _signal_group(pgid, signal.SIGKILL)


def _watch_stdin(proc: "subprocess.Popen[bytes]", stop: threading.Event) -> None:
    """Blocks until stdin ends (launcher gone or asking us to stop), then stops the worker.

    Reads the file descriptor itself: a daemon thread blocked inside ``sys.stdin``'s buffered
    reader would hold its lock when the interpreter shuts down, which is a fatal error.
    """
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    if proc.poll() is None:
        stop.set()
        _stop_group(proc, GRACE_S)


def run_worker(request: Mapping[str, Any]) -> int:
    """Starts the worker described by ``request``; returns the agent's exit status."""
    argv = [str(a) for a in request["argv"]]
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in request["env"].items()})
    # This host's cores decide the thread share and the binding: the launcher's host may have
    # another count.
    cpus = bind_worker(env)
    env.update(thread_share(request["env"], int(request.get("local_size", 1)), cpus))
    cwd = request.get("cwd")
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            close_fds=True,
            preexec_fn=None if cpus is None else bind_in_child(cpus),
        )
    except OSError as exc:
        host = os.uname().nodename
        sys.stderr.write(f"ferrovodrun: cannot start {argv[0]} on {host}: {exc.strerror or exc}\n")
        return 127 if isinstance(exc, FileNotFoundError) else 126

    def forward(signum: int, frame: Any) -> None:
        _signal_group(proc.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    stop = threading.Event()
    threading.Thread(target=_watch_stdin, args=(proc, stop), daemon=True).start()
    code = proc.wait()
    if stop.is_set():
        # The launcher is stopping the job: wait until the whole group is gone.
        deadline = time.monotonic() + GRACE_S + 1.0
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    else:
        # The worker ended by itself; its children must not outlive it either.
        if _group_alive(proc.pid):
            _stop_group(proc, GRACE_S)
    return 128 - code if code < 0 else code


def _read_line(fd: int) -> bytes:
    """One line from ``fd``, unbuffered (nothing past the newline is consumed from the pipe
    but the rest of that read, which the launcher never sends)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
    return data


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: ``--check`` reports on this host; otherwise runs one worker."""
    parser = argparse.ArgumentParser(prog="ferrovod.runner.remote_agent")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--iface")
    parser.add_argument("--cwd")
    args = parser.parse_args(argv)
    if args.check:
        sys.stdout.write(json.dumps(check(args.iface, args.cwd)) + "\n")
        return 0
    line = _read_line(0)
    if not line:
        return 0  # the launcher went away before sending the job
    try:
        request = json.loads(line)
    except ValueError as exc:
        sys.stderr.write(f"ferrovodrun: bad request from the launcher: {exc}\n")
        return 2
    return run_worker(request)


if __name__ == "__main__":
    sys.exit(main())
