"""Tests of ``ferrovodrun`` (ferrovod.runner): real launcher processes, real workers.

Workers are small scripts under ``launcher_scripts/`` (or ``sh -c``) that do not call
``ferrovod.init()``, so these tests need only the pure-Python launcher.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import pytest

from conftest import wait_until

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PYTHON_DIR = REPO / "python"
SCRIPTS = HERE / "launcher_scripts"

if importlib.util.find_spec("ferrovod") is None:  # not installed: test the checkout
    sys.path.insert(0, str(PYTHON_DIR))
from ferrovod.runner import cpus as cpus_mod  # noqa: E402
from ferrovod.runner import hosts as H  # noqa: E402, N812
from ferrovod.runner.output import LineSplitter, pad_rank  # noqa: E402

pytestmark = pytest.mark.timeout(60)

PREFIX_RE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
TOPOLOGY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "HOSTNAME")


# -- fixtures and helpers -------------------------------------------------------------------


def _needs_repo_path() -> bool:
    """True unless an installed ferrovod (outside this checkout) provides the launcher."""
    spec = importlib.util.find_spec("ferrovod.runner.launch")
    if spec is None or spec.origin is None:
        return True
    return Path(spec.origin).resolve().is_relative_to(PYTHON_DIR)


@pytest.fixture(scope="session")
def base_env() -> Dict[str, str]:
    """The environment for the launcher: no leftover launch variables, ferrovod importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERROVOD_", "HOROVOD_"))}
    env.pop("PYTHONUNBUFFERED", None)
    if _needs_repo_path():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PYTHON_DIR), env.get("PYTHONPATH")]))
    return env


def launcher_argv(*args: str) -> List[str]:
    return [sys.executable, "-m", "ferrovod.runner.launch", *args]


def script(name: str, *args: str) -> List[str]:
    return [sys.executable, str(SCRIPTS / name), *args]


def run(
    env: Dict[str, str], *args: str, timeout: float = 40, extra_env: Optional[Dict[str, str]] = None
) -> subprocess.CompletedProcess:
    full_env = dict(env, **(extra_env or {}))
    return subprocess.run(
        launcher_argv(*args),
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def reports(stdout: str) -> Dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        m = PREFIX_RE.match(line)
        if m and m.group(3).startswith("REPORT "):
            found[int(m.group(1))] = json.loads(m.group(3)[len("REPORT ") :])
    return found


def worker_lines(text: str, stream: str) -> Dict[int, List[str]]:
    """Forwarded lines per rank; every line that is not a launcher message must be prefixed."""
    per_rank: Dict[int, List[str]] = {}
    for line in text.splitlines():
        if line.startswith("ferrovodrun:"):
            continue
        m = PREFIX_RE.match(line)
        assert m is not None, f"unprefixed or mixed line: {line!r}"
        assert m.group(2) == stream
        per_rank.setdefault(int(m.group(1)), []).append(m.group(3))
    return per_rank


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as dead: containers' PID 1 may never reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def read_pids(directory: Path, kinds: Iterable[str], n: int) -> List[int]:
    return [int((directory / f"{kind}.{r}").read_text()) for kind in kinds for r in range(n)]


def all_written(directory: Path, kinds: Iterable[str], n: int) -> bool:
    return all((directory / f"{kind}.{r}").exists() for kind in kinds for r in range(n))


# -- hosts.py unit tests --------------------------------------------------------------------


def test_parse_hosts() -> None:
    assert H.parse_hosts("localhost:2,127.0.0.1:3") == [
        H.HostInfo("localhost", 2),
        H.HostInfo("127.0.0.1", 3),
    ]
    assert H.parse_hosts("worker-0") == [H.HostInfo("worker-0", 1)]
    assert H.parse_hosts(" a:1 , [::1]:2 ") == [H.HostInfo("a", 1), H.HostInfo("[::1]", 2)]
    for bad in ("", "a:x", "a:0", "a:-1", "a:1:2", "a b:1", "a:1,A:2"):
        with pytest.raises(H.HostSpecError):
            H.parse_hosts(bad)


def test_parse_hostfile_text() -> None:
    text = (
        "# cluster\n\nnode-1 slots=4\nnode-2:2  # trailing comment\n"
        "node-3\nnode-4 slots=1 max_slots=8\n"
    )
    assert H.parse_hostfile_text(text) == [
        H.HostInfo("node-1", 4),
        H.HostInfo("node-2", 2),
        H.HostInfo("node-3", 1),
        H.HostInfo("node-4", 1),
    ]
    for bad in (
        "node slots=zero\n",
        "node cpus=2\n",
        "# nothing\n",
        "node slots=0\n",
        "a:1\na slots=2\n",
    ):
        with pytest.raises(H.HostSpecError):
            H.parse_hostfile_text(bad, "hf")
    with pytest.raises(H.HostSpecError, match="hf:2"):
        H.parse_hostfile_text("ok:1\nbad slots=x\n", "hf")


def test_get_host_assignments_matches_horovod() -> None:
    # Worked example: hosts a:2, b:3, c:1 -> ranks fill a, then b, then c.
    hosts = [H.HostInfo("a", 2), H.HostInfo("b", 3), H.HostInfo("c", 1)]
    got = [
        (s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size, s.size)
        for s in H.get_host_assignments(hosts, 6)
    ]
    assert got == [
        ("a", 0, 0, 2, 0, 3, 6),
        ("a", 1, 1, 2, 0, 2, 6),
        ("b", 2, 0, 3, 1, 3, 6),
        ("b", 3, 1, 3, 1, 2, 6),
        ("b", 4, 2, 3, 0, 1, 6),
        ("c", 5, 0, 1, 2, 3, 6),
    ]
    # max_np stops early; the last host gets only part of its slots.
    got = [
        (s.hostname, s.rank, s.local_size, s.cross_size, s.size)
        for s in H.get_host_assignments(hosts, 1, max_np=3)
    ]
    assert got == [("a", 0, 2, 2, 3), ("a", 1, 2, 1, 3), ("b", 2, 1, 2, 3)]
    with pytest.raises(
        H.HostSpecError, match=r"more processes \(7\) than there are available slots \(6\)"
    ):
        H.get_host_assignments(hosts, 7)


def test_is_local_host() -> None:
    for name in ("localhost", "LOCALHOST", "127.0.0.1", "127.1.2.3", "[::1]", "::1"):
        assert H.is_local_host(name), name
    import socket

    assert H.is_local_host(socket.gethostname())
    assert not H.is_local_host("node-that-does-not-exist.invalid", this_machine=set())
    assert H.remote_hosts([H.HostInfo("localhost", 1), H.HostInfo("elsewhere.invalid", 1)]) == [
        "elsewhere.invalid"
    ]


def test_pad_rank_and_line_splitter() -> None:
    assert [pad_rank(r, 1) for r in (0,)] == ["0"]
    assert [pad_rank(r, 10) for r in (0, 9)] == ["0", "9"]
    assert [pad_rank(r, 11) for r in (0, 10)] == ["00", "10"]
    splitter = LineSplitter()
    assert splitter.feed(b"ab") == []
    assert splitter.feed(b"c\nd\r") == [b"abc\n"]  # the \r waits: \r\n may follow
    assert splitter.feed(b"\ne\rf") == [b"d\r\n", b"e\r"]
    assert splitter.flush() == b"f"
    assert splitter.flush() is None


# -- environment of the workers -------------------------------------------------------------


@pytest.mark.parametrize("np_", [1, 2, 3, 4])
def test_rank_environment(base_env: Dict[str, str], np_: int) -> None:
    proc = run(base_env, "-np", str(np_), *script("report_env.py"))
    assert proc.returncode == 0, proc.stderr
    got = reports(proc.stdout)
    assert sorted(got) == list(range(np_))
    secrets = {r["env"]["FERROVOD_SECRET"] for r in got.values()}
    assert len(secrets) == 1
    secret = secrets.pop()
    assert re.fullmatch(r"[0-9a-f]{64}", secret)
    for rank, r in got.items():
        env = r["env"]
        expected = {
            "RANK": rank,
            "SIZE": np_,
            "LOCAL_RANK": rank,
            "LOCAL_SIZE": np_,
            "CROSS_RANK": 0,
            "CROSS_SIZE": 1,
            "HOSTNAME": "localhost",
        }
        for prefix in ("FERROVOD_", "HOROVOD_"):
            assert {k: env[prefix + k] for k in TOPOLOGY} == {
                k: str(v) for k, v in expected.items()
            }
        assert env["FERROVOD_LAUNCHER"] == "ferrovodrun"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["FERROVOD_START_TIMEOUT"] == "60"
        # A fair share of the cores for each rank's thread pools, unless the user set them.
        cores = len(os.sched_getaffinity(0))
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            if var in base_env:
                assert env[var] == base_env[var]
            else:
                assert env[var] == str(max(1, cores // np_)), (var, env[var])
        assert "FERROVOD_FUSION_THRESHOLD" not in env and "FERROVOD_CYCLE_TIME" not in env
        # The secret is in the environment only: never on any command line.
        assert secret not in r["cmdline"] and secret not in " ".join(r["argv"])
        # Own session and process group, so stopping a rank stops its children.
        assert r["pgid"] == r["pid"] == r["sid"]
        if rank > 0:
            assert r["stdin_is_devnull"]
        addr = env.get("FERROVOD_RENDEZVOUS_ADDR")
        if addr is None:
            assert "native core is not available" in proc.stderr
        else:
            assert re.fullmatch(r"127\.0\.0\.1:\d+", addr)
            assert r["rendezvous_reachable"] is True
    assert secret not in proc.stderr


def _fake_sys_cpu(root: Path, layout: Dict[int, Tuple[int, int]]) -> str:
    """A sysfs ``cpu`` directory whose CPUs have the given (package, core) topology."""
    for cpu, (package, core) in layout.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    return str(root)


def test_core_shares_keep_hyperthreads_and_packages_together(tmp_path: Path) -> None:
    # 2 packages x 2 cores x 2 hyperthreads, numbered as Linux does: siblings are n and n + 4.
    layout = {cpu: (cpu % 4 // 2, cpu % 2) for cpu in range(8)}
    sys_cpu = _fake_sys_cpu(tmp_path / "a", layout)
    cores = cpus_mod.physical_cores(range(8), sys_cpu)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    shares = [cpus_mod.share_of(cores, r, 2) for r in range(2)]
    assert shares == [{0, 1, 4, 5}, {2, 3, 6, 7}]  # one package each
    three = [cpus_mod.share_of(cores, r, 3) for r in range(3)]
    assert three == [{0, 4}, {1, 5}, {2, 3, 6, 7}]
    # More ranks than cores: single CPUs; more than CPUs: shared round-robin.
    assert [cpus_mod.share_of(cores, r, 8) for r in range(8)] == [{c} for c in (0, 4, 1, 5,
                                                                              2, 6, 3, 7)]
    assert [cpus_mod.share_of(cores, r, 10)
            for r in (8, 9)] == [{0}, {4}]
    # Only the CPUs the launcher may use count; an unreadable topology makes single-CPU cores.
    assert cpus_mod.physical_cores([1, 5, 6], sys_cpu) == [[1, 5], [6]]
    assert cpus_mod.physical_cores([3, 9], str(tmp_path / "none")) == [[3], [9]]
    with pytest.raises(ValueError, match="local rank 2 of 2"):
        cpus_mod.share_of(cores, 2, 2)


@pytest.mark.parametrize("np_", [2, 3])
def test_bind_cores_gives_each_rank_its_share(base_env: Dict[str, str], np_: int) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    proc = run(base_env, "-np", str(np_), "--bind-cores", *script("report_env.py"))
    assert proc.returncode == 0, proc.stderr
    got = reports(proc.stdout)
    cores = cpus_mod.physical_cores(allowed)
    for rank, r in got.items():
        want = sorted(cpus_mod.share_of(cores, rank, np_))
        assert r["cpus"] == want, (rank, r["cpus"], want)
        assert r["env"]["FERROVOD_BIND_CORES"] == "1"
        if "OMP_NUM_THREADS" not in base_env:
            assert r["env"]["OMP_NUM_THREADS"] == str(len(want))
    if np_ <= len(allowed):  # every rank its own CPUs, and every CPU someone's
        seen = [c for r in got.values() for c in r["cpus"]]
        assert sorted(seen) == allowed
    verbose = run(base_env, "-np", "2", "--bind-cores", "--verbose", *script("report_env.py"))
    share = cpus_mod.share_of(cores, 1, 2)
    assert f"local rank 1/2, cross rank 0/1, cpus {cpus_mod.describe(share)}" in verbose.stderr
    assert cpus_mod.describe(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"
    off = run(base_env, "-np", "2", "--no-bind-cores", "--verbose", *script("report_env.py"))
    assert all(r["cpus"] == allowed for r in reports(off.stdout).values())
    assert all(r["env"]["FERROVOD_BIND_CORES"] == "0" for r in reports(off.stdout).values())
    assert "binding: none (--no-bind-cores" in off.stderr


def test_workers_are_bound_by_default_where_each_gets_a_core(base_env: Dict[str, str]) -> None:
    """Without a flag, ferrovodrun binds where every worker gets a whole physical core, and
    leaves them unbound (saying so) where there are fewer cores than workers."""
    allowed = sorted(os.sched_getaffinity(0))
    cores = cpus_mod.physical_cores(allowed)
    env = {k: v for k, v in base_env.items() if k != "FERROVOD_BIND_CORES"}
    fits = min(2, len(cores))
    proc = run(env, "-np", str(fits), "--verbose", *script("report_env.py"))
    assert proc.returncode == 0, proc.stderr
    got = reports(proc.stdout)
    for rank, r in got.items():
        assert r["cpus"] == sorted(cpus_mod.share_of(cores, rank, fits)), (rank, r["cpus"])
        assert r["env"]["FERROVOD_BIND_CORES"] == "1"
    assert "binding: each worker to its share" in proc.stderr
    crowded = run(env, "-np", str(len(cores) + 1), "--verbose", *script("report_env.py"))
    assert crowded.returncode == 0, crowded.stderr
    assert all(r["cpus"] == allowed for r in reports(crowded.stdout).values())
    assert all("FERROVOD_BIND_CORES" not in r["env"] for r in reports(crowded.stdout).values())
    assert "binding: none (fewer physical cores than workers" in crowded.stderr


def _core_available(env: Dict[str, str]) -> bool:
    probe = "import ferrovod._core, numpy"
    return (
        subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True).returncode == 0
    )


def test_real_job_through_rendezvous(base_env: Dict[str, str]) -> None:
    """init() in the workers finds the launcher's rendezvous store and forms the job."""
    if not _core_available(base_env):
        pytest.skip("the native core (ferrovod._core) is not built")
    proc = run(base_env, "-np", "3", "-H", "localhost:2,127.0.0.1:1", *script("allreduce_job.py"))
    assert proc.returncode == 0, proc.stderr
    results = {}
    for line in proc.stdout.splitlines():
        m = PREFIX_RE.match(line)
        if m and m.group(3).startswith("RESULT "):
            results[int(m.group(1))] = json.loads(m.group(3)[len("RESULT ") :])
    expected_sum = [float(k * (1 + 2 + 3)) for k in range(1, 6)]  # ranks contribute x(r+1)
    assert results == {
        0: {"topology": [0, 3, 0, 2, 0, 2], "sum": expected_sum},
        1: {"topology": [1, 3, 1, 2, 0, 1], "sum": expected_sum},
        2: {"topology": [2, 3, 0, 1, 1, 2], "sum": expected_sum},
    }


def _cgroup_cpu_quota(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> Optional[float]:
    """The CPU quota of this process's cgroup and its ancestors, in CPUs, read as the engine
    reads it (src/cpus.rs, ``quota``): cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``, the smallest along the path; None where there is none. A container
    with a CPU limit (Kubernetes) has one, and the engine splits it between the host's ranks."""

    def ancestors(mount: str, path: str) -> List[str]:
        parts = [p for p in path.split("/") if p]
        return [mount + "".join("/" + p for p in parts[:k]) for k in range(len(parts), -1, -1)]

    def ratio(quota: str, period: str) -> Optional[float]:
        try:
            q, p = float(quota), float(period)
        except ValueError:
            return None
        return q / p if q > 0 and p > 0 else None

    def read(path: str) -> Optional[str]:
        try:
            with open(path) as f:
                return f.read()
        except OSError:
            return None

    found: List[float] = []
    for line in (read(proc_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if not controllers:
            for d in ancestors(root, path):
                text = (read(f"{d}/cpu.max") or "").split()
                q = ratio(*text[:2]) if len(text) >= 2 else None
                if q is not None:
                    found.append(q)
        elif "cpu" in controllers.split(","):
            for mount in (f"{root}/cpu", f"{root}/cpu,cpuacct"):
                for d in ancestors(mount, path):
                    quota, period = read(f"{d}/cpu.cfs_quota_us"), read(f"{d}/cpu.cfs_period_us")
                    q = ratio(quota, period) if quota and period else None
                    if q is not None:
                        found.append(q)
    return min(found) if found else None


def test_cgroup_quota_is_read_as_the_engine_reads_it(tmp_path: Path) -> None:
    """The test's reading of the quota, on made-up cgroup trees: the smallest along the path."""
    v2 = tmp_path / "v2"
    (v2 / "kube" / "pod").mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (v2 / "kube" / "cpu.max").write_text("300000 100000\n")
    (v2 / "kube" / "pod" / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cg2").write_text("0::/kube/pod\n")
    assert _cgroup_cpu_quota(str(tmp_path / "cg2"), str(v2)) == 1.5
    v1 = tmp_path / "v1" / "cpu,cpuacct" / "job"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cg1").write_text("4:memory:/job\n3:cpu,cpuacct:/job\n")
    assert _cgroup_cpu_quota(str(tmp_path / "cg1"), str(tmp_path / "v1")) == 0.5
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert _cgroup_cpu_quota(str(tmp_path / "cg1"), str(tmp_path / "v1")) is None


def test_idle_waits_yield_where_ranks_outnumber_cpus(base_env: Dict[str, str]) -> None:
    """Each rank works out the CPUs it has to itself from its host's ranks' published CPUs and
    the host's CPU quota (split between its ranks); below one, its idle waits are crowded
    (they yield the core), unless FERROVOD_YIELD_WHEN_IDLE says otherwise."""
    if not _core_available(base_env):
        pytest.skip("the native core (ferrovod._core) is not built")
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota()
    said_quota = "none" if quota is None else f"{quota:.2f}"

    def share(ranks: int) -> float:
        # Unbound ranks share every CPU; a quota caps what they have together.
        return min(cpus, quota if quota is not None else cpus) / ranks

    n = cpus + 1
    env = dict(base_env, FERROVOD_LOG_LEVEL="debug")
    crowded = run(env, "-np", str(n), *script("allreduce_job.py"))
    assert crowded.returncode == 0, crowded.stderr
    for rank in range(n):
        assert f"rank {rank}: {share(n):.2f} CPUs to itself" in crowded.stderr, crowded.stderr
        assert f"rank(s) on this host, CPU quota {said_quota})" in crowded.stderr, crowded.stderr
        assert (f"rank {rank}: idle waits yield the core between polls, crowded "
                "(FERROVOD_YIELD_WHEN_IDLE=auto)") in crowded.stderr
    forced = run(dict(env, FERROVOD_YIELD_WHEN_IDLE="0"), "-np", str(n), *script("allreduce_job.py"))
    assert forced.returncode == 0, forced.stderr
    assert forced.stderr.count("idle waits spin, then block (FERROVOD_YIELD_WHEN_IDLE=0)") == n
    roomy = run(env, "-np", "1", *script("allreduce_job.py"))
    assert roomy.returncode == 0, roomy.stderr
    assert f"rank 0: {share(1):.2f} CPUs to itself" in roomy.stderr, roomy.stderr
    if share(1) >= 1:
        assert "idle waits spin, then block (FERROVOD_YIELD_WHEN_IDLE=auto)" in roomy.stderr
    else:  # a quota under one CPU crowds even a job of one rank
        assert "idle waits yield the core between polls, crowded" in roomy.stderr, roomy.stderr
    bad = run(dict(env, FERROVOD_YIELD_WHEN_IDLE="sometimes"), "-np", "1",
              *script("allreduce_job.py"))
    assert bad.returncode != 0
    assert "FERROVOD_YIELD_WHEN_IDLE=\"sometimes\": expected 1, 0 or auto" in bad.stderr


def test_silent_connection_to_the_rendezvous_port_does_not_block_exit(
    base_env: Dict[str, str], tmp_path: Path
) -> None:
    """A port scanner or health check holding a silent connection to the store as the job ends:
    closing the store drops it, and the launcher still exits (it used to deadlock there,
    waiting with the GIL held for a thread that needed the GIL to log the drop)."""
    if not _core_available(base_env):
        pytest.skip("the native core (ferrovod._core) is not built")
    go = tmp_path / "go"
    launcher = subprocess.Popen(
        launcher_argv("-np", "1", *script("wait_for_file.py", str(go))),
        env=base_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert launcher.stdout is not None
        line = launcher.stdout.readline()
        m = re.search(r"RENDEZVOUS (\S+):(\d+)$", line.strip())
        assert m, f"no rendezvous address in {line!r}"
        with socket.create_connection((m.group(1), int(m.group(2))), timeout=30):
            go.touch()
            # The deadlock lasted for good: a generous wait tells it from a slow machine.
            try:
                _, err = launcher.communicate(timeout=45)
            except subprocess.TimeoutExpired:
                pytest.fail("ferrovodrun did not exit with a silent connection to its store open")
    finally:
        if launcher.poll() is None:
            launcher.kill()  # a deadlocked launcher ignores SIGTERM
            launcher.communicate()
    assert launcher.returncode == 0, err


def test_secrets_differ_between_jobs(base_env: Dict[str, str]) -> None:
    a = reports(run(base_env, "-np", "1", *script("report_env.py")).stdout)[0]["env"][
        "FERROVOD_SECRET"
    ]
    b = reports(run(base_env, "-np", "1", *script("report_env.py")).stdout)[0]["env"][
        "FERROVOD_SECRET"
    ]
    assert a != b


def _topology(got: Dict[int, dict]) -> List[tuple]:
    return [tuple(got[r]["env"]["FERROVOD_" + k] for k in TOPOLOGY) for r in sorted(got)]


def test_two_local_host_names_give_cross_topology(base_env: Dict[str, str]) -> None:
    # localhost and 127.0.0.1 are both this machine but count as two hosts, as in horovodrun.
    proc = run(base_env, "-np", "3", "-H", "localhost:2,127.0.0.1:2", *script("report_env.py"))
    assert proc.returncode == 0, proc.stderr
    # (rank, size, local_rank, local_size, cross_rank, cross_size, host)
    assert _topology(reports(proc.stdout)) == [
        ("0", "3", "0", "2", "0", "2", "localhost"),
        ("1", "3", "1", "2", "0", "1", "localhost"),
        ("2", "3", "0", "1", "1", "2", "127.0.0.1"),
    ]


def test_hostfile(base_env: Dict[str, str], tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two names for this machine\nlocalhost slots=1\n127.0.0.1:2\n")
    proc = run(base_env, "-hostfile", str(hostfile), *script("report_env.py"))  # -np: all slots
    assert proc.returncode == 0, proc.stderr
    assert _topology(reports(proc.stdout)) == [
        ("0", "3", "0", "1", "0", "2", "localhost"),
        ("1", "3", "0", "2", "1", "2", "127.0.0.1"),
        ("2", "3", "1", "2", "0", "1", "127.0.0.1"),
    ]


# flag, value given, variable exported, value expected in the worker
TUNABLE_CASES = [
    ("--fusion-threshold-mb", "32", "FERROVOD_FUSION_THRESHOLD", str(32 * 1024 * 1024)),
    ("--cycle-time-ms", "2.5", "FERROVOD_CYCLE_TIME", "2.5"),
    ("--cache-capacity", "0", "FERROVOD_CACHE_CAPACITY", "0"),
    ("--timeline-filename", "tl.json", "FERROVOD_TIMELINE", "tl.json"),
    ("--log-level", "debug", "FERROVOD_LOG_LEVEL", "DEBUG"),
    ("--log-without-timestamp", None, "FERROVOD_LOG_HIDE_TIME", "1"),
    ("--start-timeout", "7", "FERROVOD_START_TIMEOUT", "7"),
    ("--gloo-timeout-seconds", "11", "FERROVOD_TIMEOUT_SECONDS", "11"),
    ("--stall-check-warning-time-seconds", "13", "FERROVOD_STALL_CHECK_TIME_SECONDS", "13"),
    ("--no-stall-check", None, "FERROVOD_STALL_CHECK_DISABLE", "1"),
    ("--no-hierarchical-allreduce", None, "FERROVOD_HIERARCHICAL_ALLREDUCE", "0"),
]


def test_tunables_exported_only_when_given(base_env: Dict[str, str]) -> None:
    args = ["-np", "1"]
    for flag, value, _, _ in TUNABLE_CASES:
        args += [flag] if value is None else [flag, value]
    proc = run(base_env, *args, *script("report_env.py"))
    assert proc.returncode == 0, proc.stderr
    env = reports(proc.stdout)[0]["env"]
    assert {var: env.get(var) for _, _, var, _ in TUNABLE_CASES} == {
        var: expected for _, _, var, expected in TUNABLE_CASES
    }
    # HOROVOD_START_TIMEOUT is the fallback default for the start timeout.
    proc = run(
        base_env, "-np", "1", *script("report_env.py"), extra_env={"HOROVOD_START_TIMEOUT": "45"}
    )
    assert reports(proc.stdout)[0]["env"]["FERROVOD_START_TIMEOUT"] == "45"
    proc = run(base_env, "-np", "1", "--fusion-threshold-mb", "-1", "true")
    assert proc.returncode == 2 and "must not be negative" in proc.stderr


def test_verbose_shows_plan_but_not_secret(base_env: Dict[str, str]) -> None:
    proc = run(base_env, "--verbose", "-np", "2", "--tcp", *script("report_env.py"))
    assert proc.returncode == 0, proc.stderr
    secret = reports(proc.stdout)[0]["env"]["FERROVOD_SECRET"]
    assert "rank 1: host localhost, local rank 1/2, cross rank 0/1" in proc.stderr
    assert "FERROVOD_SECRET=<hidden>" in proc.stderr
    assert "--tcp has no effect" in proc.stderr
    assert secret not in proc.stderr


# -- output ---------------------------------------------------------------------------------


def test_output_prefixing(base_env: Dict[str, str]) -> None:
    n = 200
    proc = run(base_env, "-np", "3", *script("echo_streams.py", str(n)))
    assert proc.returncode == 0, proc.stderr
    out = worker_lines(proc.stdout, "stdout")
    err = worker_lines(proc.stderr, "stderr")
    for rank in range(3):
        assert out[rank] == [f"out rank={rank} i={i} end" for i in range(n)] + [f"tail rank={rank}"]
        assert err[rank] == [f"err rank={rank} i={i}" for i in range(n)]


def test_worker_arguments_are_the_workers_own(base_env: Dict[str, str]) -> None:
    """Arguments after the command reach it untouched, even when they look like (or abbreviate)
    ferrovodrun's own flags."""
    worker_args = ["--log", "x", "-np", "5", "--verbose", "--timeline-filename=t"]
    proc = run(base_env, "-np", "1", sys.executable, "-c",
               "import sys, json; print(json.dumps(sys.argv[1:]))", *worker_args)
    assert proc.returncode == 0, proc.stderr
    assert worker_lines(proc.stdout, "stdout")[0] == [json.dumps(worker_args)]


def test_carriage_returns_and_partial_last_line(base_env: Dict[str, str]) -> None:
    proc = subprocess.run(
        launcher_argv("-np", "1", "sh", "-c", r"printf 'a\rb\r\nc\nlast'"),
        env=base_env,
        capture_output=True,
        timeout=30,
    )
    assert proc.returncode == 0
    assert proc.stdout == b"[0]<stdout>:a\r[0]<stdout>:b\r\n[0]<stdout>:c\n[0]<stdout>:last\n"


def test_timestamp_prefix(base_env: Dict[str, str]) -> None:
    proc = run(base_env, "-np", "1", "-prefix-timestamp", "sh", "-c", "echo hello")
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(
        r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}\[0\]<stdout>:hello\n",
        proc.stdout,
    )


def test_output_filename(base_env: Dict[str, str], tmp_path: Path) -> None:
    out_dir = tmp_path / "logs"
    proc = run(
        base_env, "-np", "2", "--output-filename", str(out_dir), *script("echo_streams.py", "3")
    )
    assert proc.returncode == 0, proc.stderr
    for rank in range(2):
        expected_out = (
            "".join(f"out rank={rank} i={i} end\n" for i in range(3)) + f"tail rank={rank}"
        )
        assert (out_dir / f"rank.{rank}" / "stdout").read_text() == expected_out
        assert (out_dir / f"rank.{rank}" / "stderr").read_text() == "".join(
            f"err rank={rank} i={i}\n" for i in range(3)
        )
    assert "[0]<stdout>:out rank=0 i=0 end" in proc.stdout  # the console still gets it


def test_output_filename_pads_ranks(base_env: Dict[str, str], tmp_path: Path) -> None:
    proc = run(
        base_env,
        "-np",
        "11",
        "--output-filename",
        str(tmp_path),
        "sh",
        "-c",
        'echo "r$FERROVOD_RANK"',
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"rank.{r:02d}" for r in range(11)]
    for r in range(11):
        assert (tmp_path / f"rank.{r:02d}" / "stdout").read_text() == f"r{r}\n"


# -- failures and signals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "fail_args, expected_rc, wording",
    [
        (["--code", "3"], 3, "exit code 3"),
        (["--signal", str(int(signal.SIGKILL))], 137, "signal 9 (SIGKILL)"),
    ],
)
def test_failing_rank_stops_the_others(
    base_env: Dict[str, str], tmp_path: Path, fail_args, expected_rc, wording
) -> None:
    # The others sleep 300 s unless stopped: a launcher that left them would time out (40 s).
    proc = run(
        base_env,
        "-np",
        "3",
        *script("hang.py", str(tmp_path), "--grandchild", "--fail-rank", "1", *fail_args),
    )
    assert proc.returncode == expected_rc, proc.stderr
    assert re.search(
        rf"rank 1 \(pid \d+ on localhost\) ended with {re.escape(wording)}", proc.stderr
    ), proc.stderr
    assert "the first was rank 1" in proc.stderr
    pids = read_pids(tmp_path, ("pid", "child"), 3)
    # Killed by the launcher before it exited; the kernel may take a moment to tear them down.
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]


def test_worker_ignoring_sigterm_is_killed(base_env: Dict[str, str], tmp_path: Path) -> None:
    # Rank 1 ignores SIGTERM and sleeps 300 s: only the SIGKILL after the grace period ends it
    # before run()'s 40 s.
    proc = run(
        base_env,
        "-np",
        "2",
        *script("hang.py", str(tmp_path), "--ignore-term", "--fail-rank", "0", "--code", "5"),
    )
    assert proc.returncode == 5, proc.stderr
    pids = read_pids(tmp_path, ("pid",), 2)
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]


def _start_hanging_job(base_env: Dict[str, str], tmp_path: Path, n: int) -> subprocess.Popen:
    launcher = subprocess.Popen(
        launcher_argv("-np", str(n), *script("hang.py", str(tmp_path), "--grandchild")),
        env=base_env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if not wait_until(lambda: all_written(tmp_path, ("pid", "child"), n), 20):
        launcher.kill()
        pytest.fail(f"workers did not start: {launcher.communicate(timeout=10)}")
    return launcher


@pytest.mark.parametrize("signum, expected_rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_all(
    base_env: Dict[str, str], tmp_path: Path, signum, expected_rc
) -> None:
    launcher = _start_hanging_job(base_env, tmp_path, 3)
    pids = read_pids(tmp_path, ("pid", "child"), 3)
    assert all(alive(p) for p in pids)
    launcher.send_signal(signum)
    _, err = launcher.communicate(timeout=40)
    assert launcher.returncode == expected_rc, err
    assert f"received {signal.Signals(signum).name}" in err
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]


def test_second_signal_skips_the_grace_period(base_env: Dict[str, str], tmp_path: Path) -> None:
    """The workers ignore SIGTERM, so only SIGKILL ends them: after the grace period, or at
    once on a second Ctrl-C. The launcher runs with a grace period of 10 minutes here, so that
    it exits within the test's wait only if the second signal cut the grace short."""
    log = tmp_path / "launcher.err"
    # Read before it is set: a launcher without GRACE_S fails here instead of testing nothing.
    patched = ("import sys, ferrovod.runner.launch as launch; assert launch.GRACE_S > 0; "
               "launch.GRACE_S = 600.0; launch.main(sys.argv[1:])")
    with open(log, "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-c", patched, "-np", "2",
             *script("hang.py", str(tmp_path), "--ignore-term")],
            env=base_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        assert wait_until(lambda: all_written(tmp_path, ("pid",), 2), 30)
        pids = read_pids(tmp_path, ("pid",), 2)
        launcher.send_signal(signal.SIGINT)
        # The second signal must come while the launcher waits out the grace period, which
        # begins once it has said that it got the first.
        assert wait_until(lambda: "received SIGINT" in log.read_text(), 30), log.read_text()
        assert launcher.poll() is None, log.read_text()
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=40)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 130, log.read_text()
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]


def test_sigkill_of_launcher_leaves_no_worker(base_env: Dict[str, str], tmp_path: Path) -> None:
    launcher = _start_hanging_job(base_env, tmp_path, 2)
    pids = read_pids(tmp_path, ("pid", "child"), 2)
    launcher.kill()
    launcher.communicate(timeout=30)
    # The watchdog kills the workers' groups and every process carrying its mark.
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]


def test_watchdog_kills_what_carries_its_mark(tmp_path: Path) -> None:
    """A launcher killed between spawning a worker and registering its group: the watchdog
    still finds the worker by the mark in its environment (and a process of another session
    that carries it), and leaves alone what does not carry it."""
    watchdog = subprocess.Popen(
        [sys.executable, "-I", str(PYTHON_DIR / "ferrovod" / "runner" / "_watchdog.py"),
         "FV_TEST_MARK"],
        stdin=subprocess.PIPE, start_new_session=True,
    )
    mark = {"FV_TEST_MARK": str(watchdog.pid)}
    marked = [subprocess.Popen(["sleep", "60"], env={**os.environ, **mark},
                               start_new_session=session) for session in (True, False)]
    other = subprocess.Popen(["sleep", "60"], env={**os.environ, "FV_TEST_MARK": "1"},
                             start_new_session=True)
    registered = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert watchdog.stdin is not None
        watchdog.stdin.write(f"+{registered.pid}\n".encode())
        watchdog.stdin.close()  # the launcher died: no "exit"
        assert watchdog.wait(timeout=30) == 0
        for proc in [*marked, registered]:
            assert proc.wait(timeout=30) == -signal.SIGKILL
        assert other.poll() is None
    finally:
        for proc in [*marked, other, registered]:
            proc.kill()
            proc.wait()


def test_command_not_found(base_env: Dict[str, str]) -> None:
    proc = run(base_env, "-np", "2", "ferrovod-no-such-command-xyz")
    assert proc.returncode == 127
    assert "cannot start rank 0: ferrovod-no-such-command-xyz" in proc.stderr


# -- command line ---------------------------------------------------------------------------


def _ssh_client_runs() -> Optional[str]:
    """None where an ssh client runs here, else why not (the host check needs one)."""
    try:
        done = subprocess.run(["ssh", "-V"], capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no ssh client to run: {exc}"
    return None if done.returncode == 0 else f"`ssh -V` failed: {done.stderr.strip()}"


def test_unreachable_host_is_named_before_anything_starts(
    base_env: Dict[str, str], tmp_path: Path
) -> None:
    why = _ssh_client_runs()
    if why is not None:
        pytest.skip(f"the remote host check runs ssh: {why}")
    marker = tmp_path / "started"
    proc = run(
        base_env, "-np", "2", "-H", "localhost:1,node-b.invalid:1",
        "sh", "-c", f"touch {marker}",
    )
    assert proc.returncode == 1, proc.stderr
    assert "cannot start the job on 1 of 1 remote host(s)" in proc.stderr
    assert "node-b.invalid: unreachable over ssh" in proc.stderr
    assert not marker.exists(), "a worker started although a host failed its check"


def test_too_many_processes(base_env: Dict[str, str], tmp_path: Path) -> None:
    proc = run(base_env, "-np", "5", "-H", "localhost:4", "true")
    assert proc.returncode == 2
    assert "requested more processes (5) than there are available slots (4)" in proc.stderr
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=notanumber\n")
    proc = run(base_env, "-np", "1", "--hostfile", str(hostfile), "true")
    assert proc.returncode == 2 and f"{hostfile}:1" in proc.stderr


def test_binary_hostfile_is_named_with_its_line(base_env: Dict[str, str], tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts.bin"
    hostfile.write_bytes(b"localhost slots=1\n\x89PNG\r\n\x1a\n")
    proc = run(base_env, "-np", "1", "--hostfile", str(hostfile), "true")
    assert proc.returncode == 2, proc.stderr
    assert f"{hostfile}:2: not a text hostfile (byte 0x89 is not UTF-8)" in proc.stderr, proc.stderr
    hostfile.write_bytes(b"# hosts\nlocalhost\x00slots=1\n")
    proc = run(base_env, "-np", "1", "--hostfile", str(hostfile), "true")
    assert proc.returncode == 2 and f"{hostfile}:2: not a text hostfile" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--start-timeout", "0"),
        ("--start-timeout", "-5"),
        ("--gloo-timeout-seconds", "0"),
        ("--stall-check-warning-time-seconds", "0"),
    ],
)
def test_timeouts_of_zero_or_less_are_refused(
    base_env: Dict[str, str], flag: str, value: str
) -> None:
    proc = run(base_env, "-np", "1", flag, value, "true")
    assert proc.returncode == 2, proc.stderr
    assert re.search(rf"argument {flag}: must .* got {re.escape(value)}$", proc.stderr, re.M), (
        proc.stderr
    )


def test_start_timeout_of_zero_from_the_environment_is_refused(base_env: Dict[str, str]) -> None:
    proc = run(base_env, "-np", "1", "true", extra_env={"HOROVOD_START_TIMEOUT": "0"})
    assert proc.returncode == 2, proc.stderr
    assert "HOROVOD_START_TIMEOUT must be a whole number of seconds above 0, got '0'" in proc.stderr


def test_stall_shutdown_that_could_never_act_is_refused(base_env: Dict[str, str]) -> None:
    shutdown = "--stall-check-shutdown-time-seconds"
    for flags, env, wording in [
        ([shutdown, "30"], {}, "not above the stall warning time (the default warning time: 60 s)"),
        (
            ["--stall-check-warning-time-seconds", "10", shutdown, "10"],
            {},
            "(--stall-check-warning-time-seconds: 10 s)",
        ),
        (
            [shutdown, "20"],
            {"HOROVOD_STALL_CHECK_TIME_SECONDS": "20"},
            "(HOROVOD_STALL_CHECK_TIME_SECONDS: 20 s)",
        ),
        (["--no-stall-check", shutdown, "120"], {}, "while --no-stall-check turns the stall"),
        ([shutdown, "120"], {"FERROVOD_STALL_CHECK_DISABLE": "1"}, "_STALL_CHECK_DISABLE=1 turns"),
    ]:
        proc = run(base_env, "-np", "1", *flags, "true", extra_env=env)
        assert proc.returncode == 2, (flags, env, proc.stderr)
        assert wording in proc.stderr and f"{shutdown} " in proc.stderr, proc.stderr
    # Above the warning time, or 0 (never): accepted.
    accepted = [
        ([shutdown, "30"], {"HOROVOD_STALL_CHECK_TIME_SECONDS": "5"}),
        ([shutdown, "0"], {}),
    ]
    for flags, env in accepted:
        proc = run(base_env, "-np", "1", *flags, "true", extra_env=env)
        assert proc.returncode == 0, (flags, env, proc.stderr)


def test_fewer_processes_than_slots(base_env: Dict[str, str]) -> None:
    proc = run(base_env, "-np", "2", "-H", "localhost:4", *script("report_env.py"))
    assert proc.returncode == 0, proc.stderr
    assert _topology(reports(proc.stdout)) == [
        ("0", "2", "0", "2", "0", "1", "localhost"),
        ("1", "2", "1", "2", "0", "1", "localhost"),
    ]


def test_horovodrun_flags_are_accepted(base_env: Dict[str, str]) -> None:
    flags = [
        *(
            "--gloo",
            "--tcp",
            "--disable-cache",
            "--mpi-threads-disable",
            "--hierarchical-allreduce",
        ),
        *(
            "--no-hierarchical-allgather",
            "--torus-allreduce",
            "--autotune",
            "--timeline-mark-cycles",
        ),
        *("--log-with-timestamp", "--network-interfaces", "lo,eth0", "--network-interface", "lo"),
        *(
            "-p",
            "2222",
            "-i",
            "/nonexistent/key",
            "--mpi-args=-x FOO",
            "--binding-args=-bind-to none",
        ),
        *("--num-nccl-streams", "2", "--thread-affinity", "1", "--autotune-log-file", "at.csv"),
        *("--autotune-warmup-samples", "3", "--autotune-steps-per-sample", "10"),
        *("--autotune-bayes-opt-max-samples", "20", "--autotune-gaussian-process-noise", "0.8"),
        *("--stall-check-shutdown-time-seconds", "120"),
    ]
    proc = run(base_env, "-np", "2", *flags, "sh", "-c", "echo ok")
    assert proc.returncode == 0, proc.stderr
    assert worker_lines(proc.stdout, "stdout") == {0: ["ok"], 1: ["ok"]}
    for controller in ("--mpi", "--jsrun"):
        assert run(base_env, "-np", "1", controller, "true").returncode == 0
    # Options after the command belong to the command.
    proc = run(base_env, "-np", "1", "sh", "-c", 'echo "$0 $1"', "--verbose", "-np")
    assert worker_lines(proc.stdout, "stdout") == {0: ["--verbose -np"]}
    # A flag horovodrun does not have is a usage error.
    assert run(base_env, "-np", "1", "--no-such-flag", "true").returncode == 2


def test_usage_errors(base_env: Dict[str, str]) -> None:
    proc = run(base_env, "true")
    assert proc.returncode == 2 and "-np/--num-proc is required" in proc.stderr
    proc = run(base_env, "-np", "2")
    assert proc.returncode == 2 and "no command given" in proc.stderr
    proc = run(base_env, "-np", "0", "true")
    assert proc.returncode == 2
    proc = run(base_env, "-np", "1", "-H", "localhost:1", "--hostfile", "x", "true")
    assert proc.returncode == 2  # the host flags exclude each other
    proc = run(base_env, "-np", "1", "-p", "99999", "true")
    assert proc.returncode == 2 and "TCP port" in proc.stderr


def test_version(base_env: Dict[str, str]) -> None:
    proc = run(base_env, "--version")
    assert proc.returncode == 0
    assert re.fullmatch(r"(\d+\.\d+\.\d+\S*|unknown)\n", proc.stdout)


def test_check_build_does_not_import_frameworks(base_env: Dict[str, str], tmp_path: Path) -> None:
    # A fake "torch" that leaves a mark if anything imports it.
    marker = tmp_path / "imported"
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    env = dict(
        base_env, PYTHONPATH=os.pathsep.join([str(tmp_path), base_env.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(launcher_argv("-cb"), env=env, capture_output=True, text=True, timeout=30)
    assert not marker.exists()
    assert proc.stdout.startswith("ferrovod v")
    assert re.search(r"^    \[[X ]\] PyTorch$", proc.stdout, re.M)
    assert re.search(r"^    \[[X ]\] TensorFlow$", proc.stdout, re.M)
    has_adapter = (PYTHON_DIR / "ferrovod" / "torch").exists()
    assert ("    [X] PyTorch" in proc.stdout) == has_adapter  # torch is "installed" (the fake)
    if "Native core: not available" in proc.stdout:
        assert proc.returncode == 1
    else:
        assert proc.returncode == 0, proc.stderr
        assert "Available Tensor Operations:" in proc.stdout


def test_horovod_runner_util_threads_in_thread():
    """Horovod's ``runner.util.threads.in_thread``, which its own test helpers import."""
    from ferrovod.runner.util.threads import in_thread

    got = []
    t = in_thread(got.append, (7,), name="fv-in-thread")
    t.join(5)
    assert got == [7] and t.name == "fv-in-thread" and t.daemon
    quiet = in_thread(lambda: 1 / 0, silent=True, daemon=False)
    quiet.join(5)
    assert not quiet.is_alive() and not quiet.daemon
    with pytest.raises(ValueError):
        in_thread(got.append, 7)


def test_launcher_raises_its_open_file_limit_as_far_as_the_job_needs(base_env: Dict[str, str]) -> None:
    """The launcher holds two pipes per worker, so a common default ``ulimit -n`` of 1024 is
    full at about 300 local workers: it raises its soft limit as far as the job needs, and
    where even the hard limit is too low it says so before starting anything."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def run_with_limit(soft: int, hard_: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            launcher_argv("-np", "24", sys.executable, "-c", "print('up')"),
            env=base_env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard_)),
        )

    res = run_with_limit(40, hard)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("up") == 24, res.stdout
    res = run_with_limit(40, 40)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "24 workers need about" in res.stderr and "hard limit is 40" in res.stderr, res.stderr
    assert "up" not in res.stdout, res.stdout
