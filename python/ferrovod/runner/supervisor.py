"""Process supervision for ``ferrovodrun``: start workers, watch them, stop them all together.

Guarantees:

* every worker runs in its own session (so its process group holds its children too);
* a watchdog process (:mod:`._watchdog`) kills the workers' groups, children included, if the
  launcher dies without cleaning up (SIGKILL, the OOM killer), and every process whose
  environment carries its mark (``FERROVOD_WATCHDOG``, set in every worker's), which covers a
  worker the launcher died before it could register;
* when a worker fails, the others get a short settle time to exit on their own (a rank that
  died makes its peers raise an error naming it, which they should get to print); then, or at
  once when the launcher gets SIGINT/SIGTERM/SIGHUP, every group gets SIGTERM, then SIGKILL
  after a grace period; a further signal skips what is left of either wait;
* when the job ends, nothing started by it is left running; as the ``ferrovodrun`` process the
  launcher is also a child subreaper, so orphaned grandchildren are reaped rather than left as
  zombies under a container's PID 1.

Workers are spawned without running any code in the child (no ``preexec_fn``): Python then
uses vfork, which costs about 0.4 ms per worker whatever the launcher's size, where fork with a
``preexec_fn`` cost 8 ms each at 1024 workers. A bound worker inherits its CPUs from the
spawning thread (:func:`.cpus.spawning_bound`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import (BinaryIO, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set,
                    Tuple)

from .cpus import spawning_bound
from .output import (FRAME_STDERR, FRAME_STDOUT, RankStream, SessionReader, Sink,
                     StreamForwarder)
from .remote import RemoteStart, session_request

__all__ = ["JobOutcome", "SpawnError", "Supervisor", "WorkerSpec", "exit_status"]

_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.02
_REMOTE_EXTRA_S = 2.0
# Descriptors the launcher holds per worker: its stdout and stderr pipes, and a remote
# worker's ssh stdin; and what the launcher needs besides (store, watchdog, logs, Python).
_FDS_PER_WORKER = 3
_FDS_BESIDES = 256
_WATCHDOG_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_watchdog.py")
#: Set in every process the launcher starts to its watchdog's pid: the watchdog's mark.
WATCHDOG_VAR = "FERROVOD_WATCHDOG"

Log = Callable[[str], None]


def exit_status(returncode: int) -> int:
    """A shell-style exit status: the code itself, or 128 + signal number for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def describe_status(returncode: int) -> str:
    """Human wording of a Popen return code, e.g. ``exit code 3`` or ``signal 9 (SIGKILL)``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "unknown signal"
    return f"signal {-returncode} ({name}), exit code {exit_status(returncode)}"


class SpawnError(RuntimeError):
    """A worker could not be started; ``exit_code`` is 127 (not found) or 126 (not runnable)."""

    def __init__(self, rank: int, argv0: str, error: OSError) -> None:
        super().__init__(f"cannot start rank {rank}: {argv0}: {error.strerror or error}")
        self.rank = rank
        self.exit_code = 127 if error.errno == errno.ENOENT else 126


@dataclass
class WorkerSpec:
    """How to start one worker: its rank, command line, environment and output copies."""

    rank: int
    argv: Sequence[str]
    env: Mapping[str, str]
    hostname: str = "localhost"
    stdout_copy: Optional[BinaryIO] = None
    stderr_copy: Optional[BinaryIO] = None
    inherit_stdin: bool = False
    # Set for a worker on another host: it starts through that host's agent, in the one ssh
    # session of the host's workers (see :mod:`.remote`).
    remote: Optional[RemoteStart] = None
    # The CPUs the worker is bound to (``--bind-cores``); None: unbound.
    cpus: Optional[FrozenSet[int]] = None


@dataclass
class JobOutcome:
    """How a job ended. ``exit_code`` is what the launcher should exit with."""

    exit_code: int
    failed_rank: Optional[int] = None
    failed_returncode: Optional[int] = None
    signal: Optional[int] = None


@dataclass
class _Worker:
    spec: WorkerSpec
    # The worker itself, or for a remote worker its host's ssh session (shared by the host's
    # workers; its stdin is the agent's, and closing it stops them there).
    proc: subprocess.Popen[bytes]
    threads: List[threading.Thread] = field(default_factory=list)
    returncode: Optional[int] = None

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session makes the process its group's leader


@dataclass
class _Session:
    """One remote host's ssh session, whose agent runs ``ranks`` and reports their exits."""

    hostname: str
    proc: subprocess.Popen[bytes]
    ranks: List[int]
    threads: List[threading.Thread] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)


def _threads(workers: Sequence[_Worker], sessions: Sequence[_Session]) -> List[threading.Thread]:
    """The output threads of ``workers`` (local ones) and ``sessions`` (a remote host's)."""
    return [t for w in workers for t in w.threads] + [t for s in sessions for t in s.threads]


def _load_prctl() -> Optional[Callable[..., int]]:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl: Callable[..., int] = libc.prctl
        return prctl
    except (OSError, AttributeError):
        return None


def ensure_descriptors(workers: int) -> None:
    """Raises this process's soft ``RLIMIT_NOFILE`` as far as ``workers`` workers need (up to
    the hard limit): the common default of 1024 is full at about 300 local workers. Raises
    ``OSError`` naming the numbers when even the hard limit is too low."""
    need = _FDS_PER_WORKER * workers + _FDS_BESIDES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise OSError(
            errno.EMFILE,
            f"{workers} workers need about {need} open files in the launcher, and its hard "
            f"limit is {hard} (raise it: ulimit -Hn, or LimitNOFILE/nofile for a service or "
            f"container)",
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


class _Watchdog:
    """The launcher's side of :mod:`._watchdog`: tells it which groups exist."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen[bytes]] = None
        #: The value of :data:`WATCHDOG_VAR` in the workers' environments (None: no watchdog).
        self.marker: Optional[str] = None
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", _WATCHDOG_PATH, WATCHDOG_VAR],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
            self.marker = str(self._proc.pid)
        except OSError:
            self._proc = None

    def _send(self, line: str) -> None:
        if self._proc is None or self._proc.stdin is None:
            return
        try:
            self._proc.stdin.write(line.encode("ascii") + b"\n")
            self._proc.stdin.flush()
        except OSError:
            self._proc = None

    def add(self, pgid: int) -> None:
        """Registers a new worker process group."""
        self._send(f"+{pgid}")

    def remove(self, pgid: int) -> None:
        """Unregisters a group known to be empty (its id may be reused later)."""
        self._send(f"-{pgid}")

    def close(self) -> None:
        """Tells the watchdog the launcher cleaned up, and waits for it to leave."""
        proc = self._proc
        if proc is None:
            return
        self._send("exit")
        try:
            if proc.stdin is not None:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._proc = None


def _become_subreaper() -> None:
    """Makes orphaned descendants of the workers our children, so they get reaped (Linux).

    Containers often run a PID 1 that never reaps orphans; their zombies would otherwise keep
    the worker's process group looking alive.
    """
    prctl = _load_prctl()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class Supervisor:
    """Starts a set of workers and supervises them until the job ends.

    With ``adopt_orphans`` (for the ``ferrovodrun`` process itself, never for a library
    caller) the launcher becomes a child subreaper and one thread reaps *every* child with
    ``waitpid(-1)``; otherwise each worker is reaped through its own ``Popen``.

    ``notify_signal`` may be called from a signal handler (it only puts on a SimpleQueue, which
    is reentrant).
    """

    def __init__(
        self,
        stdout: Sink,
        stderr: Sink,
        log: Log,
        grace_s: float = 3.0,
        timestamp: bool = False,
        verbose: bool = False,
        adopt_orphans: bool = False,
        settle_s: float = 2.0,
    ) -> None:
        self._stdout = stdout
        self._stderr = stderr
        self._log = log
        self._grace_s = grace_s
        self._settle_s = settle_s
        self._timestamp = timestamp
        self._verbose = verbose
        self._adopt = adopt_orphans
        self._events: queue.SimpleQueue[Tuple[str, int, int]] = queue.SimpleQueue()
        self._workers: List[_Worker] = []
        self._sessions: List[_Session] = []
        self._reapers: List[threading.Thread] = []
        self._watchdog: Optional[_Watchdog] = None
        # The reaper's view of the processes started, each with what its exit means (it may
        # reap one before it is recorded: that exit waits in _unclaimed until it is).
        self._by_pid: Dict[int, Callable[[int], None]] = {}
        self._unclaimed: Dict[int, int] = {}
        self._own: Set[int] = set()  # children run_command waits for itself
        self._pid_lock = threading.Lock()
        self._keep_reaping = False  # see keep_reaping()

    def notify_signal(self, signum: int) -> None:
        """Asks the supervisor to stop the job because the launcher got ``signum``."""
        self._events.put(("signal", -1, signum))

    # -- start --------------------------------------------------------------------------------

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Spawns every worker, then starts the threads that forward output and reap them.

        Raises :class:`SpawnError` if one cannot be started; the ones already started are then
        stopped before it propagates.
        """
        if self._adopt:
            _become_subreaper()
        self._watchdog = _Watchdog()
        if self._watchdog.marker is None:
            self._log("warning: the launcher's watchdog did not start: if the launcher is "
                      "killed, its workers stay")
        if self._adopt:
            self._reapers.append(threading.Thread(target=self._reap_all,
                                                  name="ferrovodrun-reaper", daemon=True))
            self._reapers[-1].start()
        try:
            self._ensure_descriptors(len(specs), specs)
            self._spawn_all(specs)
        except SpawnError:
            self._start_threads(self._workers, self._sessions)
            self._stop()
            raise
        self._start_threads(self._workers, self._sessions)

    def add(self, specs: Sequence[WorkerSpec]) -> None:
        """Spawns more workers into a running job (an elastic job's new slots). Call it from
        the thread that called :meth:`start`. Raises :class:`SpawnError` if one cannot be
        started (the others started so far keep running)."""
        self._ensure_descriptors(len(self._workers) + len(specs), specs)
        workers, sessions = len(self._workers), len(self._sessions)
        try:
            self._spawn_all(specs)
        finally:
            self._start_threads(self._workers[workers:], self._sessions[sessions:])

    @staticmethod
    def _ensure_descriptors(workers: int, specs: Sequence[WorkerSpec]) -> None:
        if not specs:
            return
        try:
            ensure_descriptors(workers)
        except OSError as exc:
            raise SpawnError(specs[0].rank, specs[0].argv[0], exc) from None

    def _spawn_all(self, specs: Sequence[WorkerSpec]) -> None:
        """Spawns the local workers one by one and each remote host's workers through one ssh
        session (specs of one host with the same ssh command line)."""
        hosts: Dict[Tuple[str, ...], List[WorkerSpec]] = {}
        for spec in specs:
            if spec.remote is None:
                worker = self._spawn(spec)
                self._workers.append(worker)
                self._claim(worker.proc, lambda code, w=worker: self._worker_exited(w, code))
            else:
                hosts.setdefault(spec.remote.ssh_argv, []).append(spec)
        for group in hosts.values():
            session = self._spawn_session(group)
            self._sessions.append(session)
            self._workers += [_Worker(spec, session.proc) for spec in group]
            self._claim(session.proc, lambda code, s=session: self._session_exited(s, code))

    def _claim(self, proc: subprocess.Popen[bytes], on_exit: Callable[[int], None]) -> None:
        """Records what ``proc``'s exit means (at once if the reaper already took it)."""
        with self._pid_lock:
            self._by_pid[proc.pid] = on_exit
            code = self._unclaimed.pop(proc.pid, None)
        if code is not None:
            on_exit(code)

    def _worker_exited(self, worker: _Worker, code: int) -> None:
        worker.proc.returncode = code  # keeps Popen from waiting for it again
        self._events.put(("exit", worker.spec.rank, code))

    def _session_exited(self, session: _Session, code: int) -> None:
        # The ranks' exits come from the agent (SessionReader): this only says the session
        # is over, for ranks the agent never reported.
        session.proc.returncode = code
        session.ended.set()

    def _session_eof(self, session: _Session, unreported: List[int]) -> None:
        """The session's output ended: ranks its agent did not report end with its status."""
        if not unreported:
            return
        session.ended.wait(timeout=10.0)
        code = session.proc.returncode
        if code is None or code == 0:
            code = 255
        self._log(
            f"the ssh session to {session.hostname} ended ({describe_status(code)}) before its "
            f"agent reported rank(s) {', '.join(map(str, unreported))}"
        )
        for rank in unreported:
            self._events.put(("exit", rank, code))

    def _spawn_session(self, specs: Sequence[WorkerSpec]) -> _Session:
        first = specs[0]
        assert first.remote is not None
        proc, out_r, err_r = self._popen(first.rank, first.remote.ssh_argv, first.env,
                                         subprocess.PIPE)
        assert proc.stdin is not None
        try:
            proc.stdin.write(session_request([s.remote for s in specs if s.remote is not None]))
            proc.stdin.flush()
        except OSError:
            pass  # ssh died at once; its status tells why
        session = _Session(first.hostname, proc, [s.rank for s in specs])
        streams = {}
        for spec in specs:
            streams[(spec.rank, FRAME_STDOUT)] = RankStream(
                str(spec.rank), "stdout", self._stdout, spec.stdout_copy, self._timestamp)
            streams[(spec.rank, FRAME_STDERR)] = RankStream(
                str(spec.rank), "stderr", self._stderr, spec.stderr_copy, self._timestamp)
        session.threads = [
            SessionReader(
                out_r, first.hostname, streams,
                lambda rank, code: self._events.put(("exit", rank, code)),
                lambda unreported: self._session_eof(session, unreported),
            ),
            # ssh's own messages, and the agent's if it could not run at all.
            StreamForwarder(err_r, RankStream(first.hostname, "stderr", self._stderr, None,
                                              self._timestamp)),
        ]
        if self._verbose:
            self._log(f"started rank(s) {', '.join(map(str, session.ranks))} on "
                      f"{first.hostname} through one ssh session (pid {proc.pid})")
        return session

    def _popen(self, rank: int, argv: Sequence[str], env: Mapping[str, str],
               stdin: Optional[int], cpus: Optional[FrozenSet[int]] = None,
               ) -> Tuple[subprocess.Popen[bytes], int, int]:
        """Starts ``argv`` in a session of its own, its stdout and stderr on new pipes, and
        registers its group with the watchdog; returns it and the pipes' read ends. Its
        environment carries the watchdog's mark, by which the watchdog finds every process
        of the job. Raises :class:`SpawnError` (naming ``rank``) if it cannot start."""
        env = dict(env)
        if self._watchdog is not None and self._watchdog.marker is not None:
            env[WATCHDOG_VAR] = self._watchdog.marker
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with spawning_bound(cpus):
                proc = subprocess.Popen(
                    list(argv),
                    env=env,
                    stdin=stdin,
                    stdout=out_w,
                    stderr=err_w,
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as exc:
            os.close(out_r)
            os.close(err_r)
            raise SpawnError(rank, argv[0], exc) from None
        finally:
            os.close(out_w)
            os.close(err_w)
        if self._watchdog is not None:
            self._watchdog.add(proc.pid)
        return proc, out_r, err_r

    def _spawn(self, spec: WorkerSpec) -> _Worker:
        stdin = None if spec.inherit_stdin else subprocess.DEVNULL
        proc, out_r, err_r = self._popen(spec.rank, spec.argv, spec.env, stdin, spec.cpus)
        worker = _Worker(spec, proc)
        label = str(spec.rank)
        worker.threads = [
            StreamForwarder(out_r, RankStream(label, "stdout", self._stdout, spec.stdout_copy,
                                              self._timestamp)),
            StreamForwarder(err_r, RankStream(label, "stderr", self._stderr, spec.stderr_copy,
                                              self._timestamp)),
        ]
        if self._verbose:
            self._log(f"started rank {spec.rank} on {spec.hostname} as pid {proc.pid}")
        return worker

    def _start_threads(self, workers: Sequence[_Worker], sessions: Sequence[_Session]) -> None:
        """Starts the output threads of ``workers`` and ``sessions`` and, unless one reaper
        takes every child (adopting orphans), a waiter per process."""
        for thread in _threads(workers, sessions):
            thread.start()
        if self._adopt:
            return
        procs = [w.proc for w in workers if w.spec.remote is None] + [s.proc for s in sessions]
        waiters = [threading.Thread(target=self._wait_for, args=(p,),
                                    name=f"ferrovodrun-wait-{p.pid}", daemon=True)
                   for p in procs]
        self._reapers += waiters
        for thread in waiters:
            thread.start()

    def _wait_for(self, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        with self._pid_lock:
            on_exit = self._by_pid.get(proc.pid)
        if on_exit is not None:
            on_exit(code)

    def _reap_all(self) -> None:
        while True:
            try:
                # Look before reaping: a child the launcher waits for itself (run_command)
                # must be left to its own wait.
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                if self._keep_reaping:
                    time.sleep(_POLL_S)
                    continue
                return  # no children left at all
            if info is None:
                continue
            pid = info.si_pid
            with self._pid_lock:
                mine = pid not in self._own
                if mine:
                    try:
                        _, status = os.waitpid(pid, 0)
                    except ChildProcessError:
                        # run_command's own wait took it after we looked.
                        mine = False
            if not mine:
                time.sleep(0.005)
                continue
            code = os.waitstatus_to_exitcode(status)
            with self._pid_lock:
                on_exit = self._by_pid.get(pid)
                if on_exit is None:
                    # An adopted orphan, the watchdog, or a process not yet recorded.
                    self._unclaimed[pid] = code
                    continue
            on_exit(code)

    def keep_reaping(self, on: bool) -> None:
        """While on, the reaper waits for children that :meth:`add` may start later instead
        of ending when there are none (an elastic job between two memberships)."""
        self._keep_reaping = on

    def run_command(self, command: str, timeout: float) -> "subprocess.CompletedProcess[str]":
        """Runs a shell command of the launcher's own (the elastic discovery script) and
        returns its output and status, which the reaper of :meth:`start` leaves to it.
        Raises ``subprocess.TimeoutExpired`` after ``timeout`` (the command is killed)."""
        with self._pid_lock:
            proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True)
            self._own.add(proc.pid)
        try:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise
            return subprocess.CompletedProcess(command, proc.returncode, out, err)
        finally:
            with self._pid_lock:
                self._own.discard(proc.pid)

    def next_event(self, timeout: float) -> Optional[Tuple[str, int, int]]:
        """The next ``("exit", rank, returncode)`` or ``("signal", -1, signum)``, or None
        after ``timeout`` seconds. For a driver that watches the workers itself (elastic
        jobs) instead of calling :meth:`run`; it records exits as :meth:`run` does."""
        event = self._next_event(timeout)
        if event is not None and event[0] == "exit":
            self._record_exit(event[1], event[2])
        return event

    def stop(self) -> None:
        """Stops every live worker (SIGTERM, SIGKILL after the grace period) and cleans up."""
        self._stop()

    # -- run ----------------------------------------------------------------------------------

    def run(self) -> JobOutcome:
        """Waits until every worker exits 0, one fails, or a signal arrives; then cleans up."""
        outcome = self._watch()
        if outcome.failed_rank is not None:
            self._settle()
        self._stop()
        return outcome

    def _settle(self) -> None:
        """Gives the other workers up to ``settle_s`` to exit by themselves after a failure.

        Their engines see the failed rank within milliseconds and raise an error naming it;
        terminating them at once would often kill them before they print it, leaving the log
        with no survivor's view of what happened. A signal to the launcher ends the wait.
        """
        deadline = time.monotonic() + self._settle_s
        running = [w for w in self._workers if w.returncode is None]
        if running and self._verbose:
            self._log(f"giving {len(running)} worker(s) up to {self._settle_s:g} s to exit")
        while any(w.returncode is None for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0 or self._wait_events(min(left, _POLL_S)):
                return

    def _record_exit(self, rank: int, returncode: int) -> _Worker:
        worker = next(w for w in self._workers if w.spec.rank == rank)
        worker.returncode = returncode
        return worker

    def _next_event(self, timeout: float) -> Optional[Tuple[str, int, int]]:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _watch(self) -> JobOutcome:
        running = len(self._workers)
        while running:
            event = self._next_event(1.0)
            if event is None:
                continue
            kind, rank, value = event
            if kind == "signal":
                self._log(
                    f"received {signal.Signals(value).name}, stopping {running} running worker(s)"
                )
                return JobOutcome(exit_code=128 + value, signal=value)
            worker = self._record_exit(rank, value)
            running -= 1
            if value != 0:
                self._log(
                    f"rank {rank} (pid {worker.proc.pid} on {worker.spec.hostname}) ended with "
                    f"{describe_status(value)}; stopping the other workers"
                )
                return JobOutcome(
                    exit_code=exit_status(value), failed_rank=rank, failed_returncode=value
                )
            if self._verbose:
                self._log(f"rank {rank} exited with code 0")
        return JobOutcome(exit_code=0)

    # -- stop ---------------------------------------------------------------------------------

    def _stop(self) -> None:
        self._terminate()
        self._finish()

    def _live_groups(self) -> List[int]:
        # A host's ssh session is one group for all of that host's workers.
        return list(dict.fromkeys(
            w.pgid for w in self._workers if w.returncode is None or _group_alive(w.pgid)))

    def _wait_events(self, timeout: float) -> bool:
        """Records exits for up to ``timeout`` s; True as soon as a signal asks to hurry."""
        deadline = time.monotonic() + timeout
        while True:
            event = self._next_event(max(deadline - time.monotonic(), 0.0))
            if event is None:
                return False
            kind, rank, value = event
            if kind == "signal":
                return True
            self._record_exit(rank, value)

    def _terminate(self) -> None:
        """Asks every live worker to stop, then SIGKILL after the grace period.

        A local worker gets SIGTERM. A remote one (ssh to its host's agent) gets its stdin
        closed instead: the agent then stops the worker there with the same grace, and ssh
        ends when the worker is gone, so waiting for ssh is waiting for the remote worker.
        """
        groups = self._live_groups()
        if not groups:
            return
        if self._verbose:
            self._log(f"stopping {len(groups)} worker process group(s)")
        for worker in self._workers:
            if worker.pgid not in groups:
                continue
            if worker.proc.stdin is not None:
                try:
                    worker.proc.stdin.close()
                except OSError:
                    pass
            else:
                _signal_group(worker.pgid, signal.SIGTERM)
        # A remote agent needs its own grace period plus the trip back over ssh.
        remote = any(w.proc.stdin is not None for w in self._workers)
        deadline = time.monotonic() + self._grace_s + (_REMOTE_EXTRA_S if remote else 0.0)
        while self._live_groups() and time.monotonic() < deadline:
            if self._wait_events(_POLL_S):
                break  # a second Ctrl-C: no more grace
        groups = self._live_groups()
        if groups:
            if self._verbose:
                self._log(f"sending SIGKILL to {len(groups)} worker process group(s)")
            for pgid in groups:
                _signal_group(pgid, signal.SIGKILL)

    def _finish(self) -> None:
        """Reaps every worker, drains their output, and releases the watchdog."""
        deadline = time.monotonic() + 10.0
        while any(w.returncode is None for w in self._workers) and time.monotonic() < deadline:
            self._wait_events(_POLL_S)
        for worker in self._workers:
            if worker.returncode is None:  # pragma: no cover - SIGKILL cannot be ignored
                self._log(f"rank {worker.spec.rank} (pid {worker.proc.pid}) did not exit")
        deadline = time.monotonic() + 5.0
        for thread in _threads(self._workers, self._sessions):
            if thread.ident is not None:
                thread.join(timeout=max(deadline - time.monotonic(), 0.0))
        for worker in self._workers:
            if worker.proc.stdin is not None:
                try:
                    worker.proc.stdin.close()
                except OSError:
                    pass
        if self._watchdog is not None:
            for pgid in dict.fromkeys(w.pgid for w in self._workers):
                if not _group_alive(pgid):
                    self._watchdog.remove(pgid)
            self._watchdog.close()
            self._watchdog = None
        for thread in self._reapers:
            thread.join(timeout=1.0)
