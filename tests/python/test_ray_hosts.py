"""``ferrovod.ray`` on a Ray cluster of two hosts: network namespaces (netns.py), a head node
(``ray start --head``) on one and a worker node (``ray start --address``) on the other, the
driver on the head's host. Ranks are placed per node and numbered by host; a node lost mid-run
becomes an error naming the lost ranks, in bounded time, and in an elastic job a recovery: the
job trains on without the node, and takes it back when it joins the cluster again.

Needs network namespaces and sshd (tried once, capabilities.py); skipped, saying why, without."""

import importlib.util
import json
import os
import secrets
import shutil
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import WORKERS
from netns import Cluster, missing_tools

if importlib.util.find_spec("ray") is None:
    pytest.skip("make test installs ray (scripts/setup_venv.sh)", allow_module_level=True)
sys.path.insert(0, str(WORKERS))
import func_tasks as T  # noqa: E402

pytestmark = [
    pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools())),
    pytest.mark.xdist_group("netns"),  # see test_multihost.py
]

RAY = str(Path(sys.executable).parent / "ray")
PORT = 6379
TOKEN = secrets.token_hex(32)


def env():
    """The test's environment for Ray on the hosts: a real multi-node cluster (not the
    loopback-only mode test_ray.py asks for), the workers module on the path."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("FERROVOD_", "HOROVOD_", "RAY_"))}
    e["PYTHONPATH"] = os.pathsep.join([str(WORKERS), e.get("PYTHONPATH", "")]).strip(os.pathsep)
    e["RAY_USAGE_STATS_ENABLED"] = "0"
    # The cluster's own token: by default each new cluster writes ~/.ray/auth_token, which
    # would lock out other test clusters running at the same time.
    e.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    # A lost node is marked dead within a few seconds (Ray's default waits about 30).
    e.update(RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
             RAY_health_check_failure_threshold="3")
    return e


# Short temporary directories: Ray's Unix sockets live under them (108-byte limit).
TEMP = Path(f"/tmp/fvray-{uuid.uuid4().hex[:6]}")
COMMON = ["--block", "--num-cpus", "2", "--disable-usage-stats"]
PROBE = ("import ray,sys; ray.init(address=sys.argv[1], log_to_driver=False); "
         "print(sum(n['Alive'] for n in ray.nodes()))")


def alive_nodes(c, head):
    """How many nodes the cluster's GCS counts alive (None if it cannot be asked)."""
    res = c.run("r0", [sys.executable, "-c", PROBE, head], timeout=60, env=env())
    last = res.stdout.strip().splitlines()[-1:] if res.returncode == 0 else []
    return int(last[0]) if last and last[0].isdigit() else None


def wait_for(c, head, nodes):
    """Waits until the cluster has ``nodes`` alive nodes."""
    deadline = time.monotonic() + 120
    while True:
        res = c.run("r0", [sys.executable, "-c", PROBE, head], timeout=60, env=env())
        if res.returncode == 0 and res.stdout.strip().endswith(str(nodes)):
            return
        if time.monotonic() > deadline:
            logs = "".join(p.read_text(errors="replace")[-3000:]
                           for p in TEMP.parent.glob(TEMP.name + ".*.log"))
            pytest.fail(f"the Ray cluster did not reach {nodes} node(s): "
                        f"{res.stderr[-3000:]}\n{logs}")
        time.sleep(1)


def start_worker_node(c, head, nodes=2):
    """Starts r1's Ray node and waits for it to join."""
    c.popen("r1", [RAY, "start", "--address", head, "--node-ip-address", c.hosts["r1"].ip,
                   *COMMON], env=env(),
            stdout=open(TEMP.with_suffix(".r1.log"), "ab"), stderr=-2)
    wait_for(c, head, nodes)


def worker_node_running(c):
    """Whether r1's Ray node is running: its raylet is alive in r1's namespace. (The GCS's
    count of alive nodes lags a killed node by its health checks, a few seconds.)"""
    return bool(c.processes("r1", "raylet"))


def restart_worker_node(c, head):
    """Starts r1's Ray node again after a test killed it. First waits until the GCS has marked
    the killed node dead: until then the count of alive nodes would include it, and a new node
    at its address would be told from it by node id only, in the hosts' names."""
    wait_for(c, head, 1)
    start_worker_node(c, head)


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory):
    with Cluster(["r0", "r1"], tmp_path_factory.mktemp("rayhosts")) as c:
        ip = {h: c.hosts[h].ip for h in ("r0", "r1")}
        head = f"{ip['r0']}:{PORT}"
        c.popen("r0", [RAY, "start", "--head", "--port", str(PORT), "--node-ip-address",
                       ip["r0"], "--temp-dir", str(TEMP / "r0"), "--include-dashboard=false",
                       *COMMON], env=env(),
                stdout=open(TEMP.with_suffix(".r0.log"), "wb"), stderr=-2)
        wait_for(c, head, 1)
        start_worker_node(c, head)
        yield c, head
    shutil.rmtree(TEMP, ignore_errors=True)
    for log in TEMP.parent.glob(TEMP.name + ".*.log"):
        log.unlink()


def last_json(out):
    """The driver's one JSON line (Ray may print its own notices after it)."""
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def driver(c, head, *args, timeout=240):
    res = c.run("r0", [sys.executable, str(WORKERS / "ray_hosts_driver.py"), head, *args],
                timeout=timeout, env=env())
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return last_json(res.stdout)


def test_ranks_are_numbered_by_node(ray_hosts):
    c, head = ray_hosts
    got = driver(c, head, "place")
    tops = got["tops"]
    assert [t["rank"] for t in tops] == [0, 1, 2, 3]
    hosts = [t["hostname"] for t in tops]
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[0] != hosts[2]
    assert set(hosts) == {c.hosts["r0"].ip, c.hosts["r1"].ip}
    assert [(t["local_rank"], t["local_size"], t["cross_rank"], t["cross_size"])
            for t in tops] == [(0, 2, 0, 2), (1, 2, 0, 2), (0, 2, 1, 2), (1, 2, 1, 2)]
    assert got["ok"]
    want = np.sum([T.rank_input(r, "float64", (7,)) for r in range(4)], axis=0)
    for s in got["sums"]:
        np.testing.assert_allclose(s, want)


def test_a_lost_node_is_an_error_naming_its_ranks(ray_hosts, tmp_path):
    c, head = ray_hosts
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = c.popen("r0", [sys.executable, str(WORKERS / "ray_hosts_driver.py"), head, "lose",
                          str(marks)], env=env(), stdout=-1, stderr=-1, text=True)
    deadline = time.monotonic() + 120
    while len(list(marks.glob("started-*"))) < 4:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    # Which node holds rank 0 is Ray's choice; the ranks on r1 are the lost ones.
    lost = sorted(int(m.name.split("-")[1]) for m in marks.glob("started-*")
                  if m.read_text() == c.hosts["r1"].ip)
    assert len(lost) == 2, [(m.name, m.read_text()) for m in marks.glob("started-*")]
    lost_at = time.monotonic()
    c.kill_host("r1")
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, f"{out[-4000:]}\n{err[-6000:]}"
    got = last_json(out)
    assert got["error"] is not None
    assert any(f"rank {r}" in got["error"] for r in lost), (lost, got["error"])
    assert time.monotonic() - lost_at < 90


def _marks(marks, host_ip):
    """{local rank: (count, size)} of the workers on ``host_ip``, as they last wrote."""
    got = {}
    for m in marks.glob(f"at-{host_ip}-*"):
        text = m.read_text().split()
        if len(text) == 2:
            got[int(m.name.rsplit("-", 1)[1])] = (int(text[0]), int(text[1]))
    return got


def _wait(c, head, proc, marks, what, cond, timeout=120):
    """Waits until ``cond()``; fails when the driver ends first or after ``timeout`` seconds,
    then with what each worker last wrote, Ray's count of alive nodes and the driver's output
    (its elastic driver's log: memberships, failures, blacklisted hosts)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            continue
        ended = proc.poll() is not None
        if not ended:
            proc.kill()
        out, err = proc.communicate()
        seen = {m.name: m.read_text() for m in sorted(marks.glob("at-*"))}
        pytest.fail(f"{'the driver ended' if ended else f'timed out after {timeout} s'} "
                    f"waiting until {what}; workers at {seen}; Ray counts "
                    f"{alive_nodes(c, head)} alive node(s)\n--- driver stdout ---\n"
                    f"{out[-3000:]}\n--- driver stderr ---\n{err[-6000:]}")


def test_an_elastic_job_loses_a_node_trains_on_and_takes_it_back(ray_hosts, tmp_path):
    c, head = ray_hosts
    # An earlier test killed r1's node. Whether it runs is asked of r1, not of the GCS: the
    # GCS counts a killed node alive until its health checks fail, 3-4 s after the kill, and
    # the previous test ends 2.5 s after it (measured). Asked here about 1.3 s later, the GCS
    # could still count 2 nodes; r1 was left dead and the job trained on r0's 2 ranks alone,
    # never 4, until the wait timed out (reproduced by starting the job at that moment).
    if not worker_node_running(c):
        restart_worker_node(c, head)
    marks = tmp_path / "marks"
    marks.mkdir()
    r0, r1 = c.hosts["r0"].ip, c.hosts["r1"].ip
    proc = c.popen("r0", [sys.executable, str(WORKERS / "ray_hosts_driver.py"), head, "elastic",
                          str(marks)], env=env(), stdout=-1, stderr=-1, text=True)

    def wait(what, cond, timeout=120):
        _wait(c, head, proc, marks, what, cond, timeout)

    try:
        # Ray starts four actors, each a new Python that imports ferrovod, on a machine whose
        # cores another test may be using: a generous wait for the job's first 4-rank steps.
        wait("4 ranks train on both nodes", lambda: len(_marks(marks, r1)) == 2 and len(
            _marks(marks, r0)) == 2 and all(n == 4 and k >= 3 for k, n in _marks(marks, r0).values()),
            timeout=180)
        c.kill_host("r1")
        lost_at = time.monotonic()
        at = _marks(marks, r0)[0][0]
        wait("the 2 ranks left train on", lambda: _marks(marks, r0)[0][1] == 2
             and _marks(marks, r0)[0][0] >= at + 3)
        assert time.monotonic() - lost_at < 60
        restart_worker_node(c, head)
        at = _marks(marks, r0)[0][0]
        wait("the node's new workers join", lambda: _marks(marks, r0)[0][1] == 4
             and _marks(marks, r0)[0][0] >= at + 3 and len(_marks(marks, r1)) == 2)
        (marks / "stop").touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"{out[-4000:]}\n{err[-6000:]}"
    results = last_json(out)["results"]
    # Every rank counted every step once, and saw the job shrink to 2 and grow back to 4.
    T.check_elastic(results, 4)
    assert [r["host"] for r in results] == [r0, r0, r1, r1]
    sizes = [n for i, n in enumerate(results[0]["sizes"]) if i == 0 or results[0]["sizes"][i - 1] != n]
    assert sizes == [4, 2, 4], sizes
    assert "epoch" in err and "blacklisting" in err
