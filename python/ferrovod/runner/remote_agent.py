"""The remote end of a multi-host ``ferrovodrun``: started on each host over ssh.

``python -m ferrovod.runner.remote_agent --check [--iface NAME] [--cwd DIR]`` prints one JSON
line describing this host (the launcher calls it before starting anything): that ferrovod's
native core imports, the cores this process may use, the network interfaces, whether the
working directory exists, and ``SSH_CONNECTION`` (whose first field is the launcher's address
as this host reaches it).

``python -m ferrovod.runner.remote_agent`` (no flags) starts this host's workers of the job:
one ssh session per host, however many ranks it runs (sshd refuses concurrent logins beyond
its ``MaxStartups``, 10 by default, and a launcher holding an ssh client per rank would hold
a thousand at 1024 ranks). The launcher writes one JSON line to stdin (``cwd`` and
``workers``, each with its ``rank``, ``argv``, ``env`` and ``local_size``) and keeps stdin
open for the life of the job. The job secret travels in that line, so it is never on a
command line where ``ps`` would show it. Each worker runs in its own session; the agent

* sends every worker's stdout and stderr back on its own stdout as frames naming the rank,
  and each worker's end as a frame with its status (:mod:`.output`), so the launcher sees
  every rank as if it had started it itself;
* stops every worker's process group (SIGTERM, then SIGKILL after a grace period) when its
  stdin reaches end of file: the launcher closed it to stop the job, or the ssh connection
  died with the launcher; either way nothing is left running on this host;
* passes SIGTERM, SIGINT and SIGHUP on to the workers' groups;
* exits once every worker has ended and been reported.

The agent imports no framework, so starting a host's workers through it costs one Python
start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from .cpus import bind_worker, spawning_bound, usable_cpu_count
from .output import EXIT_CODE, FRAME_EXIT, FRAME_STDERR, FRAME_STDOUT, encode_frame
from .supervisor import _group_alive, _signal_group
from .worker_env import thread_share

GRACE_S = 3.0
_POLL_S = 0.05
# How long the exit of a worker waits for its pipes to drain: a child it left running may
# hold them open for as long as it lives.
_DRAIN_S = 0.5


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


def _stop_groups(procs: List["subprocess.Popen[bytes]"], grace_s: float) -> None:
    """SIGTERM to every worker's group, SIGKILL to what is left of them after ``grace_s``."""
    for proc in procs:
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if all(p.poll() is not None and not _group_alive(p.pid) for p in procs):
            return
        time.sleep(_POLL_S)
    for proc in procs:
        _signal_group(proc.pid, signal.SIGKILL)


class _Output:
    """The agent's stdout: the frames of every worker's streams and exits (see
    :mod:`.output`). A write that fails (the launcher is gone) turns it off; the closed stdin
    then stops the workers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._broken = False

    def send(self, rank: int, kind: int, payload: bytes) -> None:
        data = memoryview(encode_frame(rank, kind, payload))
        with self._lock:
            while data and not self._broken:
                try:
                    data = data[os.write(1, data):]
                except InterruptedError:
                    continue
                except OSError:
                    self._broken = True


@dataclass
class _Running:
    """One worker of this host and what is still open of it."""

    rank: int
    proc: "subprocess.Popen[bytes]"
    pipes: Dict[int, int]  # fd -> FRAME_STDOUT or FRAME_STDERR
    exit_fd: Optional[int] = None  # a pidfd, readable once the worker ends
    reported: bool = False


def _start(entry: Mapping[str, Any], cwd: Optional[str], out: _Output) -> Optional[_Running]:
    """Starts one worker (``rank``, ``argv``, ``env``, ``local_size``); None when it could not
    start (said on its stderr, its exit reported as 127 or 126)."""
    rank = int(entry["rank"])
    argv = [str(a) for a in entry["argv"]]
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in entry["env"].items()})
    # This host's cores decide the thread share and the binding: the launcher's host may have
    # another count.
    cpus = bind_worker(env)
    env.update(thread_share(entry["env"], int(entry.get("local_size", 1)), cpus))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        with spawning_bound(cpus):
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                start_new_session=True,
                close_fds=True,
            )
    except OSError as exc:
        os.close(out_r)
        os.close(err_r)
        host = os.uname().nodename
        why = f"ferrovodrun: cannot start {argv[0]} on {host}: {exc.strerror or exc}\n"
        out.send(rank, FRAME_STDERR, why.encode())
        code = 127 if isinstance(exc, FileNotFoundError) else 126
        out.send(rank, FRAME_EXIT, EXIT_CODE.pack(code))
        return None
    finally:
        os.close(out_w)
        os.close(err_w)
    running = _Running(rank, proc, {out_r: FRAME_STDOUT, err_r: FRAME_STDERR})
    try:
        running.exit_fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        running.exit_fd = None  # an old kernel: polled instead
    return running


def run_workers(request: Mapping[str, Any]) -> int:
    """Starts the workers ``request`` lists (its ``workers``, in its ``cwd``), sends their
    output and exits back as frames until every one has ended, and stops them all when stdin
    ends. Returns the agent's exit status (0: every exit was reported)."""
    out = _Output()
    cwd = request.get("cwd")
    workers = [w for w in (_start(e, cwd, out) for e in request["workers"]) if w is not None]
    procs = [w.proc for w in workers]

    def forward(signum: int, frame: Any) -> None:
        for proc in procs:
            _signal_group(proc.pid, signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    stop = threading.Event()
    threading.Thread(target=_watch_stdin, args=(procs, stop), daemon=True).start()
    _relay(workers, out)
    if stop.is_set():
        # The launcher is stopping the job: wait until every group is gone.
        deadline = time.monotonic() + GRACE_S + 1.0
        while any(_group_alive(p.pid) for p in procs) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    else:
        # The workers ended by themselves; their children must not outlive them either.
        left = [p for p in procs if _group_alive(p.pid)]
        if left:
            _stop_groups(left, GRACE_S)
    return 0


def _relay(workers: List[_Running], out: _Output) -> None:
    """Sends every worker's output as it comes, and its exit once it has ended and its
    pipes are drained or a moment has passed (a child it left may hold them open)."""
    sel = selectors.DefaultSelector()
    for w in workers:
        for fd in w.pipes:
            sel.register(fd, selectors.EVENT_READ, (w, fd))
        if w.exit_fd is not None:
            sel.register(w.exit_fd, selectors.EVENT_READ, (w, None))
    polled = any(w.exit_fd is None for w in workers)
    ended: Dict[int, float] = {}  # rank -> when its exit was seen, until it is reported
    while any(not w.reported for w in workers):
        # Wake up only to poll exits (no pidfd) or to stop waiting for a drain.
        timeout = _POLL_S if polled or ended else None
        for key, _ in sel.select(timeout):
            w, fd = key.data
            if fd is None:
                sel.unregister(w.exit_fd)
                os.close(w.exit_fd)
                w.exit_fd = None
                ended.setdefault(w.rank, time.monotonic())
                continue
            try:
                data = os.read(fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if data:
                out.send(w.rank, w.pipes[fd], data)
            else:
                sel.unregister(fd)
                os.close(fd)
                del w.pipes[fd]
        now = time.monotonic()
        for w in workers:
            if w.reported:
                continue
            if w.rank not in ended and w.exit_fd is None and w.proc.poll() is not None:
                ended[w.rank] = now
            if w.rank in ended and (not w.pipes or now - ended[w.rank] > _DRAIN_S):
                out.send(w.rank, FRAME_EXIT, EXIT_CODE.pack(w.proc.wait()))
                w.reported = True
                del ended[w.rank]
    for key in list(sel.get_map().values()):
        os.close(key.fd)
    sel.close()


def _watch_stdin(procs: List["subprocess.Popen[bytes]"], stop: threading.Event) -> None:
    """Blocks until stdin ends (launcher gone or asking us to stop), then stops the workers.

    Reads the file descriptor itself: a daemon thread blocked inside ``sys.stdin``'s buffered
    reader would hold its lock when the interpreter shuts down, which is a fatal error.
    """
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    live = [p for p in procs if p.poll() is None]
    if live:
        stop.set()
        _stop_groups(live, GRACE_S)


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
    """Entry point: ``--check`` reports on this host; otherwise runs this host's workers."""
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
    return run_workers(request)


if __name__ == "__main__":
    sys.exit(main())
