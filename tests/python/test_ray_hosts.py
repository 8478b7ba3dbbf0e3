"""``ferrovod.ray`` on a Ray cluster of two hosts: network namespaces (netns.py), a head node
(``ray start --head``) on one and a worker node (``ray start --address``) on the other, the
driver on the head's host. Ranks are placed per node and numbered by host; a node lost mid-run
becomes an error naming the lost ranks, in bounded time."""

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
    return e


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory):
    # Short temporary directories: Ray's Unix sockets live under them (108-byte limit).
    temp = Path(f"/tmp/fvray-{uuid.uuid4().hex[:6]}")
    with Cluster(["r0", "r1"], tmp_path_factory.mktemp("rayhosts")) as c:
        ip = {h: c.hosts[h].ip for h in ("r0", "r1")}
        head = f"{ip['r0']}:{PORT}"
        common = ["--block", "--num-cpus", "2", "--disable-usage-stats"]
        c.popen("r0", [RAY, "start", "--head", "--port", str(PORT), "--node-ip-address",
                       ip["r0"], "--temp-dir", str(temp / "r0"), "--include-dashboard=false",
                       *common], env=env(),
                stdout=open(temp.with_suffix(".r0.log"), "wb"), stderr=-2)
        probe = ("import ray,sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                 "print(sum(n['Alive'] for n in ray.nodes()))")

        def wait_for(nodes):
            deadline = time.monotonic() + 120
            while True:
                res = c.run("r0", [sys.executable, "-c", probe, head], timeout=60, env=env())
                if res.returncode == 0 and res.stdout.strip().endswith(str(nodes)):
                    return
                if time.monotonic() > deadline:
                    logs = "".join(p.read_text(errors="replace")[-3000:]
                                   for p in temp.parent.glob(temp.name + ".*.log"))
                    pytest.fail(f"the Ray cluster did not reach {nodes} node(s): "
                                f"{res.stderr[-3000:]}\n{logs}")
                time.sleep(1)

        wait_for(1)
        c.popen("r1", [RAY, "start", "--address", head, "--node-ip-address", ip["r1"],
                       *common], env=env(),
                stdout=open(temp.with_suffix(".r1.log"), "wb"), stderr=-2)
        wait_for(2)
        yield c, head
    shutil.rmtree(temp, ignore_errors=True)
    for log in temp.parent.glob(temp.name + ".*.log"):
        log.unlink()


def driver(c, head, *args, timeout=240):
    res = c.run("r0", [sys.executable, str(WORKERS / "ray_hosts_driver.py"), head, *args],
                timeout=timeout, env=env())
    assert res.returncode == 0, f"{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


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
    got = json.loads(out.strip().splitlines()[-1])
    assert got["error"] is not None
    assert any(f"rank {r}" in got["error"] for r in lost), (lost, got["error"])
    assert time.monotonic() - lost_at < 90
