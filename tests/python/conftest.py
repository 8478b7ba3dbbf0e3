"""Helpers to run real multi-process ferrovod jobs through the real launcher.

``run_job(n, script, *args)`` runs ``python -m ferrovod.runner.launch -np n python
workers/<script> args...`` and returns the ``CompletedProcess`` (text output), with two extra
attributes: ``elapsed`` (seconds) and ``ranks`` (``{rank: [line, ...]}`` parsed from the
launcher's ``[rank]<stdout>:`` prefixes). ``assert_ok`` checks that every rank ended with
``OK <n_checks>``.

Nothing is skipped: a test module that uses the ``ferrovod_importable`` fixture fails with a
message saying what is missing when ferrovod or a test dependency (numpy, ml_dtypes,
cloudpickle) cannot be imported.
"""

import os
import re
import resource
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

# FERROVOD_TEST_CPU_LOG=<file>: each test appends "<cpu s> <wall s> <start> <worker> <node id>"
# (start: Unix time; worker: pytest-xdist's name for the process that ran it), the CPU time of
# this pytest process and of every process it waited for during the test (the ranks, through
# their launcher): where the suite's time goes on a machine with few cores, which --durations
# (wall time, shared with the tests running beside it) cannot tell.
_CPU_LOG = os.environ.get("FERROVOD_TEST_CPU_LOG")


def _cpu_seconds():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_LOG:
        yield
        return
    cpu, wall, start = _cpu_seconds(), time.monotonic(), time.time()
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(_CPU_LOG, "a") as log:
        log.write(f"{_cpu_seconds() - cpu:.2f} {time.monotonic() - wall:.2f} {start:.2f} "
                  f"{worker} {item.nodeid}\n")

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "workers"
REPO = HERE.parent.parent

# Every process the suite starts (pytest's own are started already) runs site/sitecustomize.py,
# which makes Python's garbage collector run less often while TensorFlow is imported and
# skips its walks over live objects at exit.
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(HERE / "site"), os.environ.get("PYTHONPATH")]))

# Two jobs share the machine's cores at once (pytest-xdist), so a one-rank job's thread pool,
# which ferrovodrun sizes to every core as it should for a user's machine, has a core only
# half the time. OpenMP's idle threads wait without spinning (OMP_WAIT_POLICY=PASSIVE): MXNet's
# spun out 26 core-seconds of examples/mxnet_digits.py on one rank beside another job, 10
# without the spin. Thread counts and what the launcher sets are left as they are.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The torch backend's C++ half (ferrovod/torch/_front.cpp), which `make setup` builds into the
# venv's own cache: no test builds it, and no test finds a build of another clone.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

# A launch environment that init() could pick up; tests that want "no launcher at all" drop it.
LAUNCH_ENV_PREFIXES = ("FERROVOD_", "HOROVOD_", "OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_", "HYDRA_")
LAUNCH_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "GROUP_RANK", "TF_CONFIG", "TORCHELASTIC_RUN_ID")

_LINE = re.compile(r"\[(\d+)\]<(stdout|stderr)>:(.*)")


def parse_rank_lines(text):
    """``{rank: [line, ...]}`` from launcher output; stdout and stderr lines both count."""
    out = {}
    for raw in text.splitlines():
        m = _LINE.search(raw)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(3).strip())
    return out


def _kill_marked(marker):
    """SIGKILLs processes of this test (found by the marker in their environment)."""
    needle = f"FERROVOD_TEST_JOB={marker}".encode()
    killed = []
    for pid in _pids_with(lambda p: needle in _read(p / "environ")):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def _read(path):
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _pids_with(pred):
    me = os.getpid()
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != me and pred(p):
            yield int(p.name)


def live_pids_with_arg(marker):
    """Pids of live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for pid in _pids_with(lambda p: marker.encode() in _read(p / "cmdline")):
        stat = _read(Path(f"/proc/{pid}/stat")).decode(errors="replace")
        state = stat.rsplit(")", 1)[-1].split()[:1]
        if state != ["Z"]:
            found.append(pid)
    return found


def _env(extra, plain=False):
    env = os.environ.copy()
    if plain:
        for k in list(env):
            if k.startswith(LAUNCH_ENV_PREFIXES) or k in LAUNCH_ENV_NAMES:
                del env[k]
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def _run(cmd, env, timeout):
    marker = uuid.uuid4().hex
    env["FERROVOD_TEST_JOB"] = marker
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(REPO), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        killed = _kill_marked(marker)
        out, err = proc.communicate()
        pytest.fail(f"job timed out after {timeout} s (killed {len(killed)} leftover processes): "
                    f"{' '.join(cmd)}\n--- stdout (tail) ---\n{out[-6000:]}\n--- stderr (tail) ---\n{err[-6000:]}")
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    res.elapsed = time.monotonic() - t0
    res.ranks = parse_rank_lines(out + "\n" + err)
    res.marker = marker
    return res


def wait_until(predicate, timeout, interval=0.05):
    """Polls ``predicate`` until it returns something truthy (returned) or ``timeout`` seconds
    pass (then the last value, falsy): for waiting on an event a test cannot be told of."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def _ephemeral_range():
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_handed_out = set()


def reserved_port(span=1):
    """A port P (with P+1 .. P+span-1) for a process started later to bind, such as a
    MASTER_PORT that rank 0's store takes.

    A port found free with bind(0) and closed again is an ephemeral one: the kernel may give
    it to any connect() or bind(0) before rank 0 binds it (the race that broke CI). This one
    lies below the kernel's ephemeral range, where nothing is handed out by chance; each
    pytest-xdist worker draws from its own 2 000 ports, and a port is handed out once per
    process, so concurrent tests never pick the same one. It is checked free when drawn.
    """
    import random
    import socket

    low, _ = _ephemeral_range()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base = 20000 + 2000 * (index % 6)
    top = min(base + 2000, low) - span
    if top <= base:
        raise RuntimeError(f"no ports below the ephemeral range ({low}) for worker {worker}")
    for _ in range(500):
        port = random.randrange(base, top)
        ports = range(port, port + span)
        if _handed_out & set(ports):
            continue
        try:
            for q in ports:
                with socket.socket() as s:
                    s.bind(("0.0.0.0", q))
        except OSError:
            continue
        _handed_out.update(ports)
        return port
    raise RuntimeError(f"no free port in {base}-{top}")


def mxnet_python():
    """The interpreter of .venv-mxnet (MXNet needs NumPy < 1.24; scripts/setup_mxnet_venv.sh,
    which `make test` runs, creates it); the test fails, not skips, without it."""
    py = REPO / ".venv-mxnet" / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{py} is missing: run scripts/setup_mxnet_venv.sh (make test does)",
                    pytrace=False)
    return str(py)


def launcher_cmd(n, script, *args, launcher_args=()):
    return [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(n), *launcher_args,
            sys.executable, str(WORKERS / script), *[str(a) for a in args]]


def run_job(n, script, *args, env=None, timeout=120, launcher_args=()):
    """Runs ``script`` (a file under workers/) on ``n`` ranks through the launcher."""
    return _run(launcher_cmd(n, script, *args, launcher_args=launcher_args), _env(env), timeout)


def run_plain(script, *args, env=None, timeout=60):
    """Runs ``script`` as a plain ``python script.py``, with no launch environment at all."""
    res = _run([sys.executable, str(WORKERS / script), *[str(a) for a in args]], _env(env, plain=True),
               timeout)
    res.ranks = {0: [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]}
    return res


def describe(res, limit=8000):
    return (f"command: {' '.join(res.args)}\nexit code: {res.returncode}, {res.elapsed:.1f} s\n"
            f"--- stdout (tail) ---\n{res.stdout[-limit:]}\n--- stderr (tail) ---\n{res.stderr[-limit:]}")


def ok_counts(res):
    """``{rank: n_checks}`` for ranks whose last ``OK``/``FAIL`` line is ``OK n``."""
    counts = {}
    for rank, lines in res.ranks.items():
        status = [ln for ln in lines if re.fullmatch(r"OK \d+", ln) or ln.startswith("FAIL")]
        if status and status[-1].startswith("OK "):
            counts[rank] = int(status[-1].split()[1])
    return counts


def assert_ok(res, n, min_checks=1, same_count=True):
    """Every rank 0..n-1 printed ``OK k`` with k >= min_checks, and the launcher exited 0."""
    counts = ok_counts(res)
    assert res.returncode == 0, f"job failed\n{describe(res)}"
    assert sorted(counts) == list(range(n)), f"ranks that printed OK: {sorted(counts)}\n{describe(res)}"
    low = {r: c for r, c in counts.items() if c < min_checks}
    assert not low, f"too few checks ran (< {min_checks}): {low}\n{describe(res)}"
    if same_count:
        assert len(set(counts.values())) == 1, f"ranks ran different numbers of checks: {counts}"
    return counts


def lines_matching(res, rank, pattern):
    return [m for m in (re.search(pattern, ln) for ln in res.ranks.get(rank, [])) if m]


@pytest.fixture(scope="session")
def ferrovod_importable():
    """Fails (does not skip) the whole suite when the package or a test dependency is missing."""
    probe = subprocess.run([sys.executable, "-c", "import ferrovod, ferrovod.runner.launch, numpy, "
                            "ml_dtypes, cloudpickle"], capture_output=True, text=True, env=_env(None, True))
    if probe.returncode != 0:
        pytest.fail(f"{sys.executable} cannot import what the tests need (run `make setup`):\n"
                    f"{probe.stderr[-3000:]}", pytrace=False)
