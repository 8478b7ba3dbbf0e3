"""Runs Horovod's own test suites against ferrovod.

Horovod's tests are the outside judge of ferrovod's compatibility. They are never copied into
this repository: this driver reads them from a snapshot of Horovod's repository at run time (a
clone, a bare repository, or a plain directory that holds ``test/``), extracts the selected
files and the helpers they import into a temporary directory with Horovod's layout, rewrites
``horovod`` imports to ``ferrovod`` (a textual rewrite of module names only, no test logic is
touched), and runs each file under ``ferrovodrun -np 2 python -m pytest``.

Usage::

    scripts/horovod_suite.sh HOROVOD_REPO [--files test_torch.py,...] [options]
    HOROVOD_REPO=... scripts/horovod_suite.sh [options]

A hang must not hide the tests after it. pytest-timeout (thread method) ends a rank whose test
runs past ``--timeout``; a watchdog here ends a job in which some rank shows no progress for
``--timeout`` + ``--stall-grace`` seconds, and every job has a wall limit (``--job-timeout``).
When a job ends early, the test that was running is recorded as hung (timed out) or failed
(the job died), and a new job runs the tests after it. A new job also starts after every failed
test (unless ``--no-restart-on-failure``): a failure often leaves the ranks out of step (one
still waiting in the failed test while the other runs ahead), and every test after it would
then fail for that reason alone.

Results come from a small pytest plugin (this module, loaded into every rank with
``-p horovod_suite``) that appends one JSON line per event to a per-rank file, flushed at
once, so that a rank killed mid-test still leaves a record of where it was. The launcher's
output (``[rank]<stdout>:`` lines) is kept per job and read for pytest-timeout's reports.

Merging across ranks: a test passed if it passed on every rank, failed if it failed on any
rank, skipped if skipped on every rank, hung if it timed out; any other mixture (passed on one
rank, skipped on another) is a failure too, since the ranks disagreed.

Printed per file: the counts, then every failed and hung test with a one-line reason (for a
timeout, where each rank's main thread was, and the stall inspector's list of tensors each rank
had not submitted). ``--out`` (default: ``summary.json`` in the work directory) gets the same
as JSON, with per-rank outcomes, the longer error text and each job's log path; the work
directory is kept.

Horovod's elastic integration tests (``test/integration/test_elastic_*.py``) are not run under
the launcher: each test drives ``ferrovodrun`` itself, in its own process, through Horovod's
launcher API (``horovod.runner.launch.parse_args`` / ``_run_elastic``), so those files run
under plain ``python -m pytest`` as one "rank".
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple

# -- what runs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SuiteFile:
    """One of Horovod's test files and what it needs beyond ferrovod's own dependencies."""

    path: str  # inside Horovod's repository
    requires: Tuple[Tuple[str, str], ...] = ()  # (module to import, pip requirement)
    extra: Tuple[str, ...] = ()  # further files or folders it reads at run time
    # Its tests start their own jobs through the launcher's Python API: run in one process.
    drives_launcher: bool = False
    # Seconds one of its tests may take at least (each elastic test runs several jobs).
    min_timeout: float = 0.0
    # Tests the file's class skips because they fail on Horovod, to run as well, as its base
    # class writes them: (class, base class module, base class, test names). See extract().
    unskip: Optional[Tuple[str, str, str, Tuple[str, ...]]] = None


# Every file pulls in test/utils/common.py, which imports mock and cloudpickle.
_COMMON_REQS: Tuple[Tuple[str, str], ...] = (
    ("pytest_timeout", "pytest-timeout"),
    ("mock", "mock"),
    ("cloudpickle", "cloudpickle"),
    ("packaging", "packaging"),
)

SUITE_FILES: Dict[str, SuiteFile] = {
    "test_torch.py": SuiteFile("test/parallel/test_torch.py", _COMMON_REQS),
    "test_tensorflow.py": SuiteFile("test/parallel/test_tensorflow.py", _COMMON_REQS),
    "test_tensorflow2_keras.py": SuiteFile(
        "test/parallel/test_tensorflow2_keras.py",
        _COMMON_REQS + (("parameterized", "parameterized"),)),
    "test_tensorflow_keras.py": SuiteFile("test/parallel/test_tensorflow_keras.py", _COMMON_REQS),
}
# The rest of test/parallel, which Horovod's CI runs like the files above (horovodrun -np 2).
for _name in ("test_common.py", "test_timeline.py", "test_adasum_pytorch.py",
              "test_adasum_tensorflow.py", "test_process_sets_static.py",
              "test_process_sets_multi_comm.py", "test_tensorflow_process_sets.py",
              "test_tensorflow_process_sets_dynamic.py",
              "test_tensorflow2_keras_process_sets.py", "test_compute_worker.py",
              "test_keras.py", "test_xla.py", "test_xla_process_sets.py"):
    SUITE_FILES[_name] = SuiteFile(
        f"test/parallel/{_name}", _COMMON_REQS + (("parameterized", "parameterized"),))
# MXNet 1.9 runs in an interpreter of its own (scripts/setup_mxnet_venv.sh): run these with
# VENV=.venv-mxnet, where pytest itself is one more thing to install.
for _name in ("test_mxnet1.py", "test_mxnet2.py"):
    SUITE_FILES[_name] = SuiteFile(
        f"test/parallel/{_name}",
        _COMMON_REQS + (("pytest", "pytest"), ("parameterized", "parameterized")))
for _framework in ("torch", "tensorflow2", "tensorflow", "tensorflow_keras"):
    SUITE_FILES[f"test_elastic_{_framework}.py"] = SuiteFile(
        f"test/integration/test_elastic_{_framework}.py", _COMMON_REQS + (("psutil", "psutil"),),
        extra=(f"test/integration/data/elastic_{_framework}_main.py",), drives_launcher=True,
        min_timeout=600.0)
# Horovod skips these two for torch: "This test fails due to horovod#2908" (survivors abort on
# a transport exception instead of recovering), which ferrovod must not do.
SUITE_FILES["test_elastic_torch.py"] = replace(
    SUITE_FILES["test_elastic_torch.py"],
    unskip=("ElasticTorchTests", "elastic_common", "BaseElasticTests",
            ("test_single_rank_failure", "test_fault_tolerance_without_scaling")))
DEFAULT_FILES = ("test_torch.py", "test_tensorflow.py", "test_tensorflow2_keras.py",
                 "test_tensorflow_keras.py", "test_elastic_torch.py",
                 "test_elastic_tensorflow2.py", "test_elastic_tensorflow.py",
                 "test_elastic_tensorflow_keras.py")

# Directories the test files put on sys.path, relative to the test tree root, in the order a
# module name is looked up when resolving helpers (the importing file's own folder first).
_HELPER_DIRS = ("utils", "", "parallel", "integration")

# The plugin's environment; not FERROVOD_* so that ferrovod never mistakes them for its own.
ENV_EVENTS = "HVDSUITE_EVENTS"
ENV_JOB = "HVDSUITE_JOB"
ENV_RANK = "HVDSUITE_RANK"  # the rank of a file that runs without the launcher

OUTCOMES = ("passed", "failed", "skipped", "hung")


# -- the snapshot of Horovod's repository ---------------------------------------------------


class Snapshot:
    """Files of one commit of a Horovod checkout (git) or of a plain directory."""

    def __init__(self, location: Path, ref: str) -> None:
        self.location = location
        self.ref = ref
        self.commit: Optional[str] = None
        if not location.exists():
            raise SystemExit(f"horovod_suite: no such Horovod repository: {location}")
        probe = subprocess.run(["git", "-C", str(location), "rev-parse", "--verify", "--quiet",
                                f"{ref}^{{commit}}"], capture_output=True, text=True)
        if probe.returncode == 0:
            self.commit = probe.stdout.strip()
            listing = self._git("ls-tree", "-r", "--name-only", self.commit, "--", "test")
            self.files: Set[str] = set(listing.decode().splitlines())
        elif (location / "test").is_dir():
            self.files = {p.relative_to(location).as_posix()
                          for p in (location / "test").rglob("*") if p.is_file()}
        else:
            raise SystemExit(f"horovod_suite: {location} is neither a git repository with {ref} "
                             "nor a directory holding Horovod's test/ folder")

    def _git(self, *args: str) -> bytes:
        return subprocess.run(["git", "-C", str(self.location), *args], check=True,
                              capture_output=True).stdout

    def read(self, path: str) -> bytes:
        if self.commit is not None:
            return self._git("show", f"{self.commit}:{path}")
        return (self.location / path).read_bytes()

    def under(self, prefix: str) -> List[str]:
        prefix = prefix.rstrip("/")
        return sorted(f for f in self.files if f == prefix or f.startswith(prefix + "/"))

    def describe(self) -> str:
        return f"{self.location} @ {self.commit[:12]}" if self.commit else str(self.location)


# Dotted uses (imports, attribute chains, mock.patch targets, '__module__' strings) and the
# bare `import horovod` / `from horovod import` forms. Not preceded by a word character, a dot
# or a slash, so `test_horovod_x`, `x.horovod` and github.com/horovod/horovod stay as they are.
_DOTTED = re.compile(r"(?<![\w./-])horovod(?=\.[A-Za-z_])")
_BARE_IMPORT = re.compile(r"^(\s*(?:import|from)\s+)horovod\b(?!\.)", re.M)


def rewrite_imports(source: str) -> Tuple[str, int]:
    """``source`` with Horovod's package name replaced by ferrovod's; and how many places."""
    source, n_bare = _BARE_IMPORT.subn(r"\1ferrovod", source)
    source, n_dotted = _DOTTED.subn("ferrovod", source)
    return source, n_bare + n_dotted


def _imported_names(source: str) -> Set[str]:
    """Top-level module names a Python file imports (absolute imports only)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def helper_closure(snap: Snapshot, roots: Iterable[str]) -> List[str]:
    """``roots`` and every file of the test tree they import, directly or through each other."""
    todo = list(roots)
    seen: Set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if not path.endswith(".py"):
            continue
        here = str(Path(path).parent)
        for name in _imported_names(snap.read(path).decode("utf-8", "replace")):
            for folder in (here, *(str(Path("test") / d) for d in _HELPER_DIRS)):
                candidate = str(Path(folder) / f"{name}.py")
                if candidate in snap.files:
                    todo.append(candidate)
                    break
    return sorted(seen)


def extract(snap: Snapshot, entries: Sequence[SuiteFile], dest: Path) -> Dict[str, int]:
    """Writes the files of ``entries``, their helpers and ``test/conftest.py`` under ``dest``
    (Horovod's relative layout), with the import rewrite; returns rewrites per file."""
    wanted: List[str] = [e.path for e in entries]
    if "test/conftest.py" in snap.files:
        wanted.append("test/conftest.py")
    for e in entries:
        for extra in e.extra:
            wanted.extend(snap.under(extra))
    missing = [p for p in wanted if p not in snap.files]
    if missing:
        raise SystemExit(f"horovod_suite: not in {snap.describe()}: {', '.join(missing)}")
    counts: Dict[str, int] = {}
    for path in helper_closure(snap, wanted):
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        data = snap.read(path)
        if path.endswith(".py"):
            text, counts[path] = rewrite_imports(data.decode("utf-8"))
            data = text.encode("utf-8")
        target.write_bytes(data)
    for e in entries:
        if e.unskip is not None:
            with open(dest / e.path, "a", encoding="utf-8") as f:
                f.write(unskipped_class(*e.unskip))
    return counts


def unskipped_class(cls: str, module: str, base: str, tests: Tuple[str, ...]) -> str:
    """Source of a subclass of ``cls`` whose only tests are ``tests`` as ``base`` (which
    ``cls``'s own versions override with a skip) writes them."""
    return f"""


# Appended by ferrovod's horovod_suite.py: the tests {cls} skips because they fail on
# Horovod, run as {base} writes them; every other test is left to {cls}.
from {module} import {base} as _SuiteBase


class {cls}SkippedByHorovod({cls}):
    pass


for _name in dir({cls}SkippedByHorovod):
    if _name.startswith("test"):
        setattr({cls}SkippedByHorovod, _name,
                getattr(_SuiteBase, _name) if _name in {tests!r} else None)
"""


# -- the pytest plugin (runs inside every rank) ---------------------------------------------

_events_file: Optional[Any] = None


def _emit(event: Dict[str, Any]) -> None:
    global _events_file
    folder = os.environ.get(ENV_EVENTS)
    if not folder:
        return
    if _events_file is None:
        rank = (os.environ.get(ENV_RANK) or os.environ.get("FERROVOD_RANK")
                or os.environ.get("HOROVOD_RANK") or "collect")
        _events_file = open(Path(folder) / f"rank{rank}.jsonl", "a", encoding="utf-8")
    event["t"] = time.time()
    _events_file.write(json.dumps(event) + "\n")
    _events_file.flush()  # a rank may be killed at any moment; the page cache keeps what is flushed


def _first_line(text: str, limit: int = 300) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:limit]
    return ""


def _report_reason(report: Any) -> Tuple[str, str]:
    """(one line, the longer text) explaining a failed or skipped report."""
    longrepr = report.longrepr
    if longrepr is None:
        return "", ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, message)
        return _first_line(str(longrepr[2])), str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    detail = str(longrepr)
    if crash is not None:
        return _first_line(crash.message), detail[-4000:]
    # An import error while collecting: its headline names only the module; pytest puts the
    # exception on the last "E   " line and the import that raised it just above.
    lines = detail.splitlines()
    raised = [i for i, ln in enumerate(lines) if ln.startswith("E ")]
    if raised:
        where = next((ln.split(": in ")[0] for ln in reversed(lines[:raised[-1]])
                      if re.match(r"^\S+:\d+: in ", ln)), "")
        line = lines[raised[-1]][1:].strip() + (f" (at {where})" if where else "")
        return line[:300], detail[-4000:]
    return _first_line(detail), detail[-4000:]


def pytest_collection_finish(session: Any) -> None:
    _emit({"ev": "collected", "ids": [item.nodeid for item in session.items]})


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        line, detail = _report_reason(report)
        _emit({"ev": "collect_error", "id": report.nodeid, "reason": line, "detail": detail})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _emit({"ev": "start", "id": nodeid})


def pytest_runtest_logreport(report: Any) -> None:
    line, detail = _report_reason(report) if report.outcome != "passed" else ("", "")
    _emit({"ev": "report", "id": report.nodeid, "when": report.when, "outcome": report.outcome,
           "xfail": hasattr(report, "wasxfail"), "reason": line, "detail": detail,
           "duration": report.duration})


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _emit({"ev": "finish", "id": nodeid})


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    _emit({"ev": "sessionfinish", "exitstatus": int(exitstatus)})
    # Failed tests are in the event files. A rank that exits non-zero would make the launcher
    # stop the other ranks, possibly before they record their last test.
    if os.environ.get(ENV_EVENTS) and int(exitstatus) == 1:
        session.exitstatus = 0


# -- the driver -----------------------------------------------------------------------------


@dataclass
class RankTest:
    """What one rank recorded about one test."""

    started: Optional[float] = None
    finished: bool = False
    reports: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # by phase
    # Every "call" report in order: a test's subtests (self.subTest; graph and eager mode)
    # report before the test itself.
    calls: List[Dict[str, Any]] = field(default_factory=list)

    def outcome(self) -> Tuple[str, str, str]:
        """(passed | failed | skipped, one-line reason, detail) of a finished test."""
        for when in ("setup", "call", "teardown"):
            rep = self.reports.get(when)
            if rep and rep["outcome"] == "failed":
                where = "" if when == "call" else f"error in {when}: "
                return "failed", where + rep["reason"], rep.get("detail", "")
        for when in ("setup", "call", "teardown"):
            rep = self.reports.get(when)
            if rep and rep["outcome"] == "skipped":
                return "skipped", rep["reason"], ""
        call = self.reports.get("call")
        subtests = self.calls[:-1]
        if call and call["outcome"] == "passed" and subtests \
                and all(c["outcome"] == "skipped" for c in subtests):
            # The test ran nothing of its own: every subtest skipped (e.g. GPU only).
            return "skipped", subtests[0]["reason"], ""
        if call and call["outcome"] == "passed":
            return "passed", "", ""
        return "failed", "no result recorded", ""


@dataclass
class RankLog:
    """One rank's events in one job."""

    tests: Dict[str, RankTest] = field(default_factory=dict)
    last_event: Optional[float] = None
    session_done: bool = False
    collect_errors: List[Dict[str, Any]] = field(default_factory=list)
    current: Optional[str] = None
    collected: List[str] = field(default_factory=list)


def read_events(path: Path, offset: int, log: RankLog) -> int:
    """Applies the complete lines of ``path`` from ``offset`` to ``log``; returns the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return offset
    end = chunk.rfind(b"\n") + 1
    for raw in chunk[:end].splitlines():
        ev = json.loads(raw)
        log.last_event = ev["t"]
        kind = ev["ev"]
        if kind == "start":
            log.tests[ev["id"]] = RankTest(started=ev["t"])
            log.current = ev["id"]
        elif kind == "report":
            test = log.tests.setdefault(ev["id"], RankTest())
            reports = test.reports
            if ev["when"] == "call":
                test.calls.append(ev)
            # A test's subtests (self.subTest, graph and eager mode) report before the test
            # itself, which then says "passed": a failed subtest must not be overwritten.
            earlier = reports.get(ev["when"])
            if earlier is None or earlier["outcome"] != "failed":
                reports[ev["when"]] = ev
        elif kind == "finish":
            log.tests.setdefault(ev["id"], RankTest()).finished = True
            log.current = None
        elif kind == "sessionfinish":
            log.session_done = True
        elif kind == "collect_error":
            log.collect_errors.append(ev)
        elif kind == "collected":
            log.collected = ev["ids"]
    return offset + end


@dataclass
class TestResult:
    """The merged result of one test."""

    id: str
    outcome: str
    reason: str
    ranks: Dict[int, str]
    detail: str = ""
    job: int = 0


def merge(test_id: str, per_rank: Dict[int, RankTest]) -> TestResult:
    """Result of a test every rank finished (see the module docstring for the rules)."""
    outcomes = {r: t.outcome() for r, t in sorted(per_rank.items())}
    kinds = {r: o[0] for r, o in outcomes.items()}
    failed = [r for r, k in kinds.items() if k == "failed"]
    if failed:
        by_reason: Dict[str, List[int]] = {}
        for r in failed:
            by_reason.setdefault(outcomes[r][1], []).append(r)
        reasons = [f"[rank{'s' if len(rs) > 1 else ''} {','.join(map(str, rs))}] {why}"
                   for why, rs in by_reason.items()]
        return TestResult(test_id, "failed", " | ".join(reasons), kinds, outcomes[failed[0]][2])
    if all(k == "skipped" for k in kinds.values()):
        return TestResult(test_id, "skipped", next(iter(outcomes.values()))[1], kinds)
    if all(k == "passed" for k in kinds.values()):
        return TestResult(test_id, "passed", "", kinds)
    skip_reason = next(o[1] for o in outcomes.values() if o[0] == "skipped")
    return TestResult(test_id, "failed", f"ranks disagree {kinds}: skipped because {skip_reason}",
                      kinds)


_RANK_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def rank_lines(log_text: str) -> Tuple[Dict[int, List[str]], List[str]]:
    """The launcher's output split into each rank's lines and the launcher's own lines."""
    ranks: Dict[int, List[str]] = {}
    own: List[str] = []
    for raw in log_text.splitlines():
        m = _RANK_LINE.match(raw)
        if m:
            ranks.setdefault(int(m.group(1)), []).append(m.group(3))
        elif raw.strip():
            own.append(raw.strip())
    return ranks, own


def timeout_report(lines: List[str], test_file: str) -> Optional[str]:
    """Where pytest-timeout found the main thread of a rank, when it fired there: the innermost
    frame, and the innermost one in the test file when that is another."""
    # -v leaves the test's id on the line, so the banner follows it on the same line.
    banner = [i for i, ln in enumerate(lines) if re.search(r"\+{5} Timeout \+{5}", ln)]
    if not banner:
        return None
    inner = in_test = ""
    in_main = False
    for ln in lines[banner[0] + 1:]:
        if re.search(r"\+{5} Timeout \+{5}", ln):
            break
        if ln.startswith("~") and "Stack of " in ln:
            in_main = "Stack of MainThread" in ln
            continue
        m = _FRAME.match(ln)
        if in_main and m:
            inner = f"{m.group(3)} ({Path(m.group(1)).name}:{m.group(2)})"
            if Path(m.group(1)).name == test_file:
                in_test = inner
    if not inner:
        return "(main thread's stack not found)"
    where = inner if in_test in ("", inner) else f"{inner} <- {in_test}"
    # The stall inspector's report (Horovod's wording, which ferrovod keeps) says which
    # tensors each rank was still waiting for; it is in the captured output pytest-timeout shows.
    stalled: List[str] = []
    for ln in lines[banner[0] + 1:]:
        if re.search(r"\+{5} Timeout \+{5}", ln) or (ln.startswith("~") and "Stack of" in ln):
            break
        if ln.strip() == "Missing ranks:":
            stalled = []
        elif re.match(r"^\d+: \[.*\]$", ln.strip()):
            stalled.append(ln.strip())
    if stalled:
        where += f" [stall report, tensors each rank has not submitted: {'; '.join(stalled)}]"
    return where


class Job:
    """One ``ferrovodrun -np N python -m pytest`` run over a list of test ids."""

    def __init__(self, cmd: List[str], cwd: Path, env: Dict[str, str], folder: Path) -> None:
        self.folder = folder
        self.marker = env[ENV_JOB]
        self.log_path = folder / "output.log"
        self.started = time.time()
        with open(self.log_path, "wb") as log:
            # Its own session: the launcher and everything under it can be signalled as a group.
            self.proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.offsets: Dict[Path, int] = {}
        self.ranks: Dict[int, RankLog] = {}

    def refresh(self, n_ranks: int) -> None:
        for r in range(n_ranks):
            path = self.folder / f"rank{r}.jsonl"
            log = self.ranks.setdefault(r, RankLog())
            self.offsets[path] = read_events(path, self.offsets.get(path, 0), log)

    def stalled_rank(self, limit: float, n_ranks: int) -> Optional[int]:
        now = time.time()
        for r in range(n_ranks):
            if self.ranks[r].session_done:  # waits for the others; its silence means nothing
                continue
            last = self.ranks[r].last_event or self.started
            if now - last > limit:
                return r
        return None

    def kill(self) -> int:
        """Ends the launcher and every process of this job; returns how many were SIGKILLed."""
        _signal_group(self.proc.pid, signal.SIGTERM)  # the launcher then stops its workers
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        return self.reap()

    def reap(self) -> int:
        """SIGKILLs whatever still runs with this job's marker (workers live in their own
        sessions, so the launcher's group does not reach them)."""
        killed = 0
        for _ in range(10):
            pids = _pids_with_env(f"{ENV_JOB}={self.marker}")
            if self.proc.poll() is None:
                _signal_group(self.proc.pid, signal.SIGKILL)
            if not pids and self.proc.poll() is not None:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return killed


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _pids_with_env(needle: str) -> List[int]:
    """Live processes whose environment contains ``needle`` (only ours are readable)."""
    want = needle.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if want not in (entry / "environ").read_bytes() + b"\0":
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


@dataclass
class FileReport:
    """Everything known about one test file after its run."""

    name: str
    collection_error: Optional[str] = None
    results: List[TestResult] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    jobs: List[Dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> Dict[str, int]:
        c = {k: 0 for k in OUTCOMES}
        for res in self.results:
            c[res.outcome] += 1
        return c

    def to_json(self) -> Dict[str, Any]:
        return {
            "counts": self.counts(),
            "collection_error": self.collection_error,
            "seconds": round(self.seconds, 1),
            "notes": self.notes,
            "jobs": self.jobs,
            "tests": [{"id": r.id, "outcome": r.outcome, "reason": r.reason,
                       "ranks": {str(k): v for k, v in r.ranks.items()}, "job": r.job,
                       **({"detail": r.detail} if r.detail else {})} for r in self.results],
        }


class Runner:
    """Runs the selected files, one job at a time, and collects a :class:`FileReport` each."""

    def __init__(self, args: argparse.Namespace, test_root: Path, plugin_dir: Path) -> None:
        self.args = args
        self.test_root = test_root
        self.plugin_dir = plugin_dir
        self.python = sys.executable
        launcher = Path(self.python).parent / "ferrovodrun"
        self.launcher = [str(launcher)] if launcher.exists() else [self.python, "-m",
                                                                   "ferrovod.runner.launch"]
        self.current: Optional[Job] = None
        self.entry = SuiteFile("")

    def env(self, events: Path) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(self.plugin_dir),
                                                          env.get("PYTHONPATH")]))
        env["PYTHONUNBUFFERED"] = "1"
        env[ENV_EVENTS] = str(events)
        env[ENV_JOB] = uuid.uuid4().hex
        # As an activated virtual environment: a test's command "python" is this one.
        env["PATH"] = os.pathsep.join(filter(None, [str(Path(self.python).parent),
                                                    env.get("PATH")]))
        return env

    def pytest_args(self) -> List[str]:
        return ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "horovod_suite",
                f"--rootdir={self.test_root}"]

    def collect(self, test_file: Path, folder: Path) -> Tuple[List[str], Optional[str]]:
        """Test ids of ``test_file`` in run order (one process, no launcher), or why none."""
        folder.mkdir(parents=True)
        cmd = [self.python, *self.pytest_args(), "--collect-only", "-q", str(test_file)]
        if self.args.k:
            cmd += ["-k", self.args.k]
        env = self.env(folder)
        # Not a rank of any job: the events go to rankcollect.jsonl.
        for var in [v for v in env if v.startswith(("FERROVOD_", "HOROVOD_RANK", "HOROVOD_SIZE"))]:
            del env[var]
        proc = subprocess.run(cmd, cwd=str(test_file.parent), env=env, capture_output=True,
                              text=True, timeout=self.args.job_timeout, start_new_session=True)
        (folder / "output.log").write_text(proc.stdout + proc.stderr)
        log = RankLog()
        read_events(folder / "rankcollect.jsonl", 0, log)
        ids = log.collected
        if log.collect_errors:
            err = log.collect_errors[0]
            return ids, f"{err['reason']}  [{err['id']}]\n{err['detail']}"
        if proc.returncode not in (0, 5):
            tail = _first_line("\n".join(reversed((proc.stdout + proc.stderr).splitlines())))
            return ids, f"pytest --collect-only exited {proc.returncode}: {tail}"
        return ids, None

    @property
    def n_ranks(self) -> int:
        """The ranks of a job of the current file."""
        return 1 if self.entry.drives_launcher else self.args.np

    def run_file(self, name: str, work: Path) -> FileReport:
        report = FileReport(name)
        self.entry = SUITE_FILES[name]
        t0 = time.monotonic()
        if work.exists():  # a reused --workdir: old events would mix with the new ones
            shutil.rmtree(work)
        test_file = self.test_root.parent / SUITE_FILES[name].path
        ids, error = self.collect(test_file, work / "collect")
        if error:
            report.collection_error = error
            report.seconds = time.monotonic() - t0
            return report
        prefix = str(test_file)
        remaining = list(ids)
        n_job = 0
        while remaining:
            n_job += 1
            folder = work / f"job{n_job}"
            folder.mkdir(parents=True)
            args = [prefix + nodeid[nodeid.index("::"):] for nodeid in remaining]
            done, remaining = self.run_job(report, n_job, folder, test_file, remaining, args)
            report.results.extend(done)
        report.results.sort(key=lambda r: ids.index(r.id))
        report.seconds = time.monotonic() - t0
        return report

    def run_job(self, report: FileReport, n_job: int, folder: Path, test_file: Path,
                ids: List[str], args: List[str]) -> Tuple[List[TestResult], List[str]]:
        """Runs ``ids`` in one job; returns the results it settled and the ids still to run."""
        a = self.args
        entry = self.entry
        timeout = max(a.timeout, entry.min_timeout)
        pytest = [self.python, *self.pytest_args(), f"--timeout={timeout:g}",
                  "--timeout-method=thread", *args]
        env = self.env(folder)
        if entry.drives_launcher:
            cmd = pytest
            env[ENV_RANK] = "0"
        else:
            cmd = [*self.launcher, "-np", str(a.np), *pytest]
        n = self.n_ranks
        job = Job(cmd, test_file.parent, env, folder)
        self.current = job
        print(f"  job {n_job}: {len(ids)} tests (log: {job.log_path})", flush=True)
        killed_why: Optional[str] = None
        stopped_after: Optional[str] = None
        results: Dict[str, TestResult] = {}
        while True:
            ended = job.proc.poll() is not None
            job.refresh(n)
            failed = self._settle(job, ids, results, n_job)
            if ended:
                break
            if failed and a.restart_on_failure and len(results) < len(ids):
                stopped_after = failed
                job.kill()
                break
            if time.time() - job.started > a.job_timeout:
                killed_why = f"the job's wall limit ({a.job_timeout:.0f} s) ran out"
            else:
                stalled = job.stalled_rank(timeout + a.stall_grace, n)
                if stalled is not None:
                    killed_why = (f"rank {stalled} showed no progress for "
                                  f"{timeout + a.stall_grace:.0f} s")
            if killed_why:
                job.kill()
                job.refresh(n)
                self._settle(job, ids, results, n_job)
                break
            time.sleep(1.0)
        leftovers = job.reap()
        self.current = None
        log_text = job.log_path.read_text(errors="replace")
        per_rank, own = rank_lines(log_text)
        timeouts = {r: w for r, w in ((r, timeout_report(ln, test_file.name))
                                      for r, ln in per_rank.items()) if w}
        report.jobs.append({"job": n_job, "tests": len(ids), "returncode": job.proc.returncode,
                            "killed": killed_why, "stopped_after_failure": stopped_after,
                            "leftover_processes_killed": leftovers,
                            "seconds": round(time.time() - job.started, 1),
                            "log": str(job.log_path)})
        if leftovers:
            report.notes.append(f"job {n_job}: {leftovers} processes outlived the launcher "
                                "and were killed")
        if stopped_after:
            return [results[i] for i in ids if i in results], [i for i in ids if i not in results]
        culprit = self._where_it_ended(job, ids, results, timeouts, killed_why, own)
        if culprit is not None:
            results[culprit] = self._culprit(culprit, job, timeouts, killed_why, own, per_rank,
                                             n_job)
            self._announce(results[culprit])
        remaining = [i for i in ids if i not in results]
        why_ended = self._job_failure(job, killed_why, own, per_rank)
        if culprit is None and remaining and not results:
            # Nothing moved: running the same list again would end the same way.
            if all(job.ranks[r].session_done for r in range(n)) and job.proc.returncode == 0:
                why_ended = "pytest did not run it (not found?)"
            for log in job.ranks.values():
                for err in log.collect_errors:
                    why_ended = f"collection error: {err['reason']}"
            for test_id in remaining:
                results[test_id] = TestResult(test_id, "failed", f"not run: {why_ended}", {},
                                              job=n_job)
            remaining = []
        elif culprit is None and not remaining and (killed_why or job.proc.returncode != 0):
            report.notes.append(f"job {n_job}: every test finished, then {why_ended}")
        return [results[i] for i in ids if i in results], remaining

    def _where_it_ended(self, job: Job, ids: List[str], results: Dict[str, TestResult],
                        timeouts: Dict[int, str], killed_why: Optional[str],
                        own: List[str]) -> Optional[str]:
        """The test a job that ended early is blamed on: the first one not settled but started
        on some rank, since a rank that times out or stalls in a later test is most likely
        waiting for a peer stuck in it. A rank that died on its own (a crash, no timeout) is
        blamed on the test it was in, and the earlier unsettled ones run again."""
        unsettled = [i for i in ids if i not in results
                     and any(i in log.tests for log in job.ranks.values())]
        if not unsettled:
            return None
        if not timeouts and not killed_why:
            died = next((int(m.group(1)) for m in (re.search(r"the first was rank (\d+)", ln)
                                                   for ln in own) if m), None)
            current = job.ranks[died].current if died in job.ranks else None
            if current in unsettled:
                return current
        return unsettled[0]

    def _settle(self, job: Job, ids: List[str], results: Dict[str, TestResult],
                n_job: int) -> Optional[str]:
        """Merges each test every rank has finished, as soon as they have; returns the first
        newly settled test that failed, if any."""
        failed: Optional[str] = None
        for test_id in ids:
            if test_id in results:
                continue
            per_rank = {r: log.tests.get(test_id) for r, log in job.ranks.items()}
            if len(per_rank) == self.n_ranks and all(t and t.finished for t in per_rank.values()):
                res = merge(test_id, {r: t for r, t in per_rank.items() if t})
                res.job = n_job
                results[test_id] = res
                self._announce(res)
                if res.outcome == "failed" and failed is None:
                    failed = test_id
        return failed

    def _announce(self, res: TestResult) -> None:
        short = res.id.split("::", 1)[-1]
        if res.outcome == "passed" and not self.args.verbose:
            return
        line = f"    {res.outcome.upper():7} {short}"
        if res.reason and res.outcome != "passed":
            line += f"  -- {res.reason}"
        print(line[:400], flush=True)

    def _culprit(self, test_id: str, job: Job, timeouts: Dict[int, str], killed_why: Optional[str],
                 own: List[str], per_rank: Dict[int, List[str]], n_job: int) -> TestResult:
        ranks: Dict[int, str] = {}
        failures: List[str] = []
        detail = ""
        for r in range(self.n_ranks):
            t = job.ranks[r].tests.get(test_id)
            if t is None:
                ranks[r] = "not started"
            elif not t.finished:
                ranks[r] = "timed out" if r in timeouts else "unfinished"
            else:
                kind, why, more = t.outcome()
                ranks[r] = kind
                if kind == "failed":
                    failures.append(f"[rank {r}] {why}")
                    detail = detail or more
        also = f"; {' | '.join(failures)}" if failures else ""
        if timeouts:
            # A rank may time out in a later test, waiting for a peer still stuck in this one.
            where = []
            for r, frame in sorted(timeouts.items()):
                current = job.ranks[r].current
                other = "" if current in (None, test_id) else f" (in {current.split('::')[-1]})"
                where.append(f"rank {r}{other} at {frame}")
            limit = max(self.args.timeout, self.entry.min_timeout)
            return TestResult(test_id, "hung", f"timed out after {limit:g} s: "
                              f"{'; '.join(where)}{also}", ranks, detail, n_job)
        if killed_why:
            return TestResult(test_id, "hung", f"{killed_why} (killed by the suite's "
                              f"watchdog){also}", ranks, detail, n_job)
        ended = self._job_failure(job, None, own, per_rank)
        return TestResult(test_id, "failed", f"the job ended during the test: {ended}{also}",
                          ranks, detail, n_job)

    def _job_failure(self, job: Job, killed_why: Optional[str], own: List[str],
                     per_rank: Dict[int, List[str]]) -> str:
        """One line saying why a job ended early."""
        if killed_why:
            return killed_why
        for line in reversed(own):
            if re.search(r"exit|signal|error|fail", line, re.I):
                return line[:300]
        for r in sorted(per_rank):
            if not job.ranks.get(r, RankLog()).session_done and per_rank[r]:
                return f"rank {r}'s last line: {per_rank[r][-1].strip()[:250]}"
        return f"the launcher exited {job.proc.returncode}"


# -- setup and the command line -------------------------------------------------------------


def ensure_requirements(entries: Sequence[SuiteFile]) -> None:
    """pip-installs, quietly, what the selected files import and this environment lacks."""
    missing: List[str] = []
    for entry in entries:
        for module, requirement in entry.requires:
            if importlib.util.find_spec(module) is None and requirement not in missing:
                missing.append(requirement)
    if not missing:
        return
    print(f"installing into {sys.prefix}: {' '.join(missing)}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", *missing], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"horovod_suite: pip install {' '.join(missing)} failed:\n"
                         f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    importlib.invalidate_caches()


def select_files(text: Optional[str]) -> List[str]:
    names = [n.strip() for n in (text.split(",") if text else DEFAULT_FILES) if n.strip()]
    chosen = []
    for name in names:
        key = Path(name).name
        if key not in SUITE_FILES:
            raise SystemExit(f"horovod_suite: unknown test file {name!r}; known: "
                             f"{', '.join(SUITE_FILES)}")
        chosen.append(key)
    return chosen


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="horovod_suite",
        description="Run Horovod's own test files against ferrovod (see the module docstring).",
        epilog=f"Known files: {', '.join(SUITE_FILES)}. The repository may also be given as "
               "HOROVOD_REPO in the environment.")
    p.add_argument("repo", nargs="?", help="Horovod repository: a clone, a bare repository, or "
                   "a directory holding its test/ folder (default: $HOROVOD_REPO)")
    p.add_argument("--ref", default="HEAD", help="commit, tag or branch to read from a git "
                   "repository (default: HEAD)")
    p.add_argument("--files",
                   help=f"comma-separated file names (default: {','.join(DEFAULT_FILES)})")
    p.add_argument("-k", help="pytest -k expression, to run only some tests")
    p.add_argument("--np", type=int, default=2, help="ranks per job (default: 2)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds one test may run on a rank, pytest-timeout (default: 120)")
    p.add_argument("--stall-grace", type=float, default=60.0,
                   help="a job is killed when a rank records nothing for --timeout plus this "
                        "many seconds (default: 60)")
    p.add_argument("--job-timeout", type=float, default=3600.0,
                   help="wall limit of one job in seconds (default: 3600)")
    p.add_argument("--no-restart-on-failure", dest="restart_on_failure", action="store_false",
                   help="run a file in one job as Horovod's CI does, instead of starting a new "
                        "job after each failed test (a failure that leaves the ranks out of step "
                        "then fails the tests after it too)")
    p.add_argument("--workdir", help="where to extract and keep logs (default: a new temporary "
                   "directory)")
    p.add_argument("--out", help="JSON summary path (default: summary.json in the work directory)")
    p.add_argument("--no-install", action="store_true", help="do not pip-install missing test "
                   "dependencies")
    p.add_argument("-v", "--verbose", action="store_true", help="print passed tests too")
    return p


def print_report(report: FileReport) -> None:
    c = report.counts()
    print(f"\n== {report.name}: {c['passed']} passed, {c['failed']} failed, "
          f"{c['skipped']} skipped, {c['hung']} hung  "
          f"({report.seconds:.0f} s, {len(report.jobs)} jobs)")
    if report.collection_error:
        print(f"   COLLECTION ERROR: {report.collection_error.splitlines()[0]}")
    for note in report.notes:
        print(f"   note: {note}")
    for kind in ("failed", "hung"):
        for res in report.results:
            if res.outcome == kind:
                print(f"   {kind.upper():6} {res.id.split('::', 1)[-1]}: {res.reason}"[:600])


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    location = args.repo or os.environ.get("HOROVOD_REPO")
    if not location:
        build_parser().print_usage(sys.stderr)
        print("horovod_suite: error: say where Horovod's repository is: an argument, or "
              "HOROVOD_REPO=<clone, bare repository or directory with test/>", file=sys.stderr)
        return 2
    names = select_files(args.files)
    entries = [SUITE_FILES[n] for n in names]
    snap = Snapshot(Path(location).expanduser().resolve(), args.ref)
    if not args.no_install:
        ensure_requirements(entries)
    work = (Path(args.workdir).resolve() if args.workdir
            else Path(tempfile.mkdtemp(prefix="horovod-suite-")))
    work.mkdir(parents=True, exist_ok=True)
    tree = work / "horovod"
    if tree.exists():
        shutil.rmtree(tree)
    rewrites = extract(snap, entries, tree)
    plugin_dir = work / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    shutil.copyfile(Path(__file__), plugin_dir / "horovod_suite.py")
    out = Path(args.out).resolve() if args.out else work / "summary.json"
    print(f"Horovod tests from {snap.describe()}; work directory {work}", flush=True)
    print("rewritten to ferrovod (places): "
          + ", ".join(f"{p} ({n})" for p, n in rewrites.items()), flush=True)

    runner = Runner(args, tree / "test", plugin_dir)
    summary: Dict[str, Any] = {
        "horovod": {"location": str(snap.location), "ref": args.ref, "commit": snap.commit},
        "settings": {"np": args.np, "timeout": args.timeout, "stall_grace": args.stall_grace,
                     "restart_on_failure": args.restart_on_failure,
                     "job_timeout": args.job_timeout,
                     "k": args.k},
        "files": {},
    }
    reports: List[FileReport] = []
    status = 0

    def write_summary() -> None:
        summary["files"] = {r.name: r.to_json() for r in reports}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1) + "\n")

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # so that a SIGTERM, too, ends the running job's processes

    signal.signal(signal.SIGTERM, interrupted)
    try:
        for name in names:
            print(f"\n{name}", flush=True)
            reports.append(runner.run_file(name, work / "runs" / Path(name).stem))
            write_summary()
    except KeyboardInterrupt:
        if runner.current is not None:
            runner.current.kill()
        print("\ninterrupted; results so far follow", file=sys.stderr)
        status = 130
    for report in reports:
        print_report(report)
        c = report.counts()
        if status == 0 and (report.collection_error or c["failed"] or c["hung"]):
            status = 1
    write_summary()
    print(f"\nsummary: {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
