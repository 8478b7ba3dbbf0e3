"""Real multi-host jobs: hosts are Linux network namespaces with sshd on port 2222 (see
netns.py), launched the ways users launch them: ``ferrovodrun -H``/``--hostfile`` over ssh,
Open MPI's ``mpirun``, and torchrun on each host. Results are checked against NumPy and the
local/cross ranks against the placement (workers/multihost_worker.py).

Needs network namespaces (root with CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2, openssh (and
Open MPI for the mpirun test); ``make test`` installs the packages (scripts/system_deps.sh).
Each is tried once (capabilities.py); the tests skip, saying which is missing, where they
cannot be had.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capabilities import mpirun_missing
from conftest import REPO, WORKERS
from netns import Cluster, missing_tools

pytestmark = [
    pytest.mark.usefixtures("ferrovod_importable"),
    pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools())),
    # One pytest-xdist worker runs every network-namespace test: the operator's /etc/mpi is
    # made and removed per world, and one module's hosts are shared by its tests.
    pytest.mark.xdist_group("netns"),
]

PY = sys.executable
WORKER = str(WORKERS / "multihost_worker.py")
CTL = str(WORKERS / "multihost_ctl_worker.py")
LAUNCH = [PY, "-m", "ferrovod.runner.launch"]


def clean_env(**extra):
    """The test process's environment without any launch variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FERROVOD_", "HOROVOD_", "OMPI_", "PMI", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                         "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKERS), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    env.update(extra)
    return env


def describe(res):
    return f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-6000:]}\n--- stderr ---\n{res.stderr[-6000:]}"


def ok_ranks(stdout):
    """Ranks whose output (as ``[r]<stdout>:OK n`` or a bare ``OK n`` line) says OK."""
    ranks = set()
    for line in stdout.splitlines():
        if "<stdout>:OK " in line:
            ranks.add(int(line[1:line.index("]")]))
    return ranks


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Cluster(["h0", "h1", "h2"], tmp_path_factory.mktemp("hosts")) as c:
        yield c


def ssh_flags(c):
    return ["-p", "2222", "-i", str(c.key)]


# -- ferrovodrun -----------------------------------------------------------------------------


def test_ferrovodrun_over_ssh_from_a_launcher_only_host(cluster):
    """The MPIJob shape: the launcher's host runs no worker; 2 hosts x 2 slots; -x sets a
    variable, the launcher's environment is forwarded, and workers start in its directory."""
    env = clean_env(FV_FORWARDED="from-launcher")
    res = cluster.run("h0", [*LAUNCH, "-np", "4", "-H", "h1:2,h2:2", *ssh_flags(cluster),
                             "-x", "FV_SET=a b", "--network-interface", "eth0",
                             PY, WORKER, "h1:2,h2:2", "FV_SET=a b",
                             "FV_FORWARDED=from-launcher", "FERROVOD_IFACE=eth0",
                             f"cwd={os.getcwd()}"], timeout=120, env=env)
    assert res.returncode == 0, describe(res)
    assert ok_ranks(res.stdout) == {0, 1, 2, 3}, describe(res)
    assert cluster.leftovers(WORKER, within=5) == {}


def test_hostfile_with_local_and_remote_slots(cluster, tmp_path):
    """Launcher on h1, which also runs rank 0; h2 runs two ranks; both hostfile line forms.
    --bind-cores binds the local worker and, through h2's agent, the remote ones."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two hosts\nh1 slots=1\nh2:2\n")
    allowed = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    res = cluster.run("h1", [*LAUNCH, "--hostfile", str(hostfile), *ssh_flags(cluster),
                             "--bind-cores", PY, WORKER, "h1:1,h2:2", f"bound={allowed}",
                             "FERROVOD_BIND_CORES=1"], timeout=120, env=clean_env())
    assert res.returncode == 0, describe(res)
    assert ok_ranks(res.stdout) == {0, 1, 2}, describe(res)


def test_each_host_starts_its_workers_through_one_ssh_session(cluster, tmp_path):
    """12 ranks on h1 and 4 on h2: one ssh login per host (sshd drops concurrent logins past
    its MaxStartups, 10 by default), and every rank's streams still reach the launcher whole,
    prefixed with the rank, and in its --output-filename files; a command missing on the host
    is named there, with the shell's 127."""
    out_dir = tmp_path / "logs"
    streams = str(REPO / "tests" / "python" / "launcher_scripts" / "echo_streams.py")
    work = ["sh", "-c", f'echo "conn $FERROVOD_RANK $FERROVOD_HOSTNAME $SSH_CONNECTION"; '
                        f'exec "$0" {streams} 3', PY]
    res = cluster.run("h0", [*LAUNCH, "-np", "16", "-H", "h1:12,h2:4", *ssh_flags(cluster),
                             "--output-filename", str(out_dir), *work],
                      timeout=120, env=clean_env())
    assert res.returncode == 0, describe(res)
    sessions = {}
    for line in res.stdout.splitlines():
        if "<stdout>:conn " in line:
            _, rank, host, client, client_port, *_ = line.split("<stdout>:")[1].split()
            sessions.setdefault(host, set()).add((client, client_port))
    assert {h: len(s) for h, s in sessions.items()} == {"h1": 1, "h2": 1}, describe(res)
    for rank in range(16):
        for i in range(3):
            assert f"[{rank}]<stdout>:out rank={rank} i={i} end\n" in res.stdout, describe(res)
            assert f"[{rank}]<stderr>:err rank={rank} i={i}\n" in res.stderr, describe(res)
        assert f"[{rank}]<stdout>:tail rank={rank}\n" in res.stdout, describe(res)
        written = (out_dir / f"rank.{rank:02d}" / "stdout").read_text()
        assert written.endswith("".join(f"out rank={rank} i={i} end\n" for i in range(3))
                                + f"tail rank={rank}"), written
    res = cluster.run("h0", [*LAUNCH, "-np", "3", "-H", "h1:2,h2:1", *ssh_flags(cluster),
                             "ferrovod-no-such-command-xyz"], timeout=60, env=clean_env())
    assert res.returncode == 127, describe(res)
    assert "cannot start ferrovod-no-such-command-xyz on h" in res.stderr, describe(res)


def test_remote_failure_stops_every_host(cluster):
    res = cluster.run("h0", [*LAUNCH, "-np", "4", "-H", "h1:2,h2:2", *ssh_flags(cluster),
                             PY, CTL, "fail", "3"], timeout=120, env=clean_env())
    assert res.returncode == 3, describe(res)
    assert "rank 3 (on h2) with exit code 3" in res.stderr, describe(res)
    assert cluster.leftovers(CTL) == {}


def _start_loop(cluster):
    proc = cluster.popen("h0", [*LAUNCH, "-np", "4", "-H", "h1:2,h2:2", *ssh_flags(cluster),
                                PY, CTL, "loop"], env=clean_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    ready = set()
    deadline = time.monotonic() + 60
    while len(ready) < 4 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if "READY" in line:
            ready.add(line.split()[-1])
    assert len(ready) == 4, f"ranks ready: {ready}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc


def test_ctrl_c_leaves_nothing_on_any_host(cluster):
    proc = _start_loop(cluster)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    left = cluster.leftovers(CTL, within=5)
    assert left == {}, f"still running after Ctrl-C: {left}"


def test_killed_launcher_leaves_nothing_on_any_host(cluster):
    """SIGKILL gives the launcher no chance to clean up: its ssh sessions die with it, and each
    host's agent stops its workers when its session ends."""
    proc = _start_loop(cluster)
    proc.kill()
    proc.communicate(timeout=30)
    left = cluster.leftovers(CTL, within=15)
    assert left == {}, f"still running after the launcher was killed: {left}"


def test_bad_hosts_are_named_before_any_worker_starts(cluster, tmp_path):
    marker = tmp_path / "started"
    work = ["sh", "-c", f"touch {marker}"]
    # h9 resolves nowhere; the interface exists on no host.
    res = cluster.run("h0", [*LAUNCH, "-np", "2", "-H", "h1:1,h9:1", *ssh_flags(cluster),
                             "--start-timeout", "5", *work], timeout=60, env=clean_env())
    assert res.returncode == 1, describe(res)
    assert "1 of 2 remote host(s)" in res.stderr and "h9: unreachable over ssh" in res.stderr, describe(res)
    res = cluster.run("h0", [*LAUNCH, "-np", "2", "-H", "h1:1,h2:1", *ssh_flags(cluster),
                             "--network-interface", "ib7", *work], timeout=60, env=clean_env())
    assert res.returncode == 1, describe(res)
    for host in ("h1", "h2"):
        assert f"{host}: no network interface 'ib7' here (interfaces: eth0, lo)" in res.stderr, describe(res)
    # -np larger than the slots, and a wrong key: refused before anything runs.
    res = cluster.run("h0", [*LAUNCH, "-np", "5", "-H", "h1:2,h2:2", *ssh_flags(cluster), *work],
                      timeout=60, env=clean_env())
    assert res.returncode == 2 and "more processes (5) than there are available slots (4)" in res.stderr
    other_key = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
    res = cluster.run("h0", [*LAUNCH, "-np", "2", "-H", "h1:1,h2:1", "-p", "2222", "-i",
                             str(other_key), *work], timeout=60, env=clean_env())
    assert res.returncode == 1 and "h1: unreachable over ssh: " in res.stderr, describe(res)
    assert "Permission denied" in res.stderr, describe(res)
    assert not marker.exists()


HIER = str(WORKERS / "hierarchical_worker.py")


ELASTIC = str(REPO / "tests" / "python" / "torch" / "elastic_worker.py")


@pytest.mark.parametrize("scenario,hosts,np_,final,launcher", [
    ("kill", "h1:2\nh2:2\n", 4, 2, "h0"),
    ("add", "h1:2\n", 2, 4, "h0"),
    ("kill", "h1:2\nh2:2\n", 4, 2, "h1"),
    ("add", "h1:2\n", 2, 4, "h1"),
])
def test_elastic_job_over_ssh(cluster, tmp_path, scenario, hosts, np_, final, launcher):
    """Elastic across hosts. With the launcher on h0, the MPIJob shape: the launcher's host
    runs no worker; with it on h1, its own host's workers are local and h2's are over ssh.
    A worker of h2 is SIGKILLed (h2 is blacklisted and its other worker leaves), or h2 is
    added while the job runs (its workers start over ssh and join at the next commit; h1's
    local workers must then be reachable from h2). The worker checks samples, weights and a
    one-process replay."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    env = clean_env(ELASTIC_VICTIM_HOST="h2", ELASTIC_FIRST_HOST="h1")
    res = cluster.run(launcher, [*LAUNCH, "-np", str(np_), "--min-np", "2", "--max-np", "4",
                             "--host-discovery-script", f"cat {hosts_file}", *ssh_flags(cluster),
                             PY, ELASTIC, scenario, str(hosts_file), str(tmp_path)],
                      timeout=180, env=env)
    assert res.returncode == 0, describe(res)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["size"] == final and got["resets"] == 1, got


def test_hierarchical_allreduce_across_hosts(cluster):
    """2 hosts x 2 ranks, hierarchical allreduce forced on, automatic, and off (through the
    Horovod name): results against NumPy and bitwise equal on every rank (the worker checks),
    and what each host's eth0 sent during 2 x 16 MiB allreduces tells which algorithm ran:
    1.0x the payload per host hierarchically, 1.5x for the flat ring (ranks 0-1 on h1, 2-3
    on h2: the ring crosses hosts twice, each time with 2(n-1)/n = 1.5x)."""
    payload = 2 * 16 << 20
    ratios = {}
    for label, extra in (("on", {"FERROVOD_HIERARCHICAL_ALLREDUCE": "1"}), ("auto", {}),
                         ("off", {"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"})):
        res = cluster.run("h0", [*LAUNCH, "-np", "4", "-H", "h1:2,h2:2", *ssh_flags(cluster),
                                 PY, HIER], timeout=60, env=clean_env(**extra))
        assert res.returncode == 0, f"{label}: {describe(res)}"
        assert ok_ranks(res.stdout) == {0, 1, 2, 3}, f"{label}: {describe(res)}"
        sent = [int(line.split("TX ")[1]) for line in res.stdout.splitlines()
                if "<stdout>:TX " in line]
        assert len(sent) == 2, f"{label}: {describe(res)}"
        ratios[label] = [s / payload for s in sent]
    # Headers and control messages add a few per cent at most (measured: +0.1 to +2 %).
    for label in ("on", "auto"):
        assert all(0.98 < x < 1.1 for x in ratios[label]), ratios
    assert all(1.47 < x < 1.6 for x in ratios["off"]), ratios


def test_blocking_allreduces_agree_across_hosts_without_the_coordinator(cluster):
    """One rank on each of 3 hosts: blocking allreduces of five dtypes, four lengths and four
    reductions, named and in place, against NumPy on every rank, bitwise equal across ranks,
    taken by the fast path across hosts (the worker reads its testing counter). With the
    fast path off, the same job goes through the engine and agrees just as well."""
    for label, extra in (("on", {}), ("off", {"FERROVOD_FAST_PATH_BYTES": "0"})):
        res = cluster.run("h0", [*LAUNCH, "-np", "3", "-H", "h0:1,h1:1,h2:1",
                                 *ssh_flags(cluster), PY, str(WORKERS / "across_worker.py")],
                          timeout=120, env=clean_env(**extra))
        assert res.returncode == 0, f"{label}: {describe(res)}"
        assert ok_ranks(res.stdout) == {0, 1, 2}, f"{label}: {describe(res)}"
        if label == "off":
            continue
        taken = [line for line in res.stdout.splitlines() if "<stdout>:FAST " in line]
        assert len(taken) == 3, describe(res)


def test_a_rank_killed_during_blocking_allreduces_across_hosts_is_named(cluster):
    """One rank on each of 3 hosts in a loop of blocking allreduces (the fast path across
    hosts): rank 1 SIGKILLs itself, and every survivor's allreduce raises RankFailureError
    naming rank 1, found by the failure, not a timeout (errors_worker.py's kill case)."""
    marker = f"fvkill-{time.time_ns()}"
    res = cluster.run("h0", [*LAUNCH, "-np", "3", "-H", "h0:1,h1:1,h2:1", *ssh_flags(cluster),
                             PY, str(WORKERS / "errors_worker.py"), "kill", marker, "40"],
                      timeout=120, env=clean_env(FERROVOD_TIMEOUT_SECONDS="30"))
    assert res.returncode != 0, f"the launcher must fail when a rank was killed\n{describe(res)}"
    for r in (0, 2):
        got = [line for line in res.stdout.splitlines()
               if line.startswith(f"[{r}]<stdout>:RANKFAIL ")]
        assert got, f"rank {r} did not report RankFailureError\n{describe(res)}"
        fields = dict(kv.split("=", 1) for kv in got[0].split(" msg=")[0].split()[1:])
        assert fields["rank_attr"] == "1", got[0]
        # Half of the 30 s op timeout: a loaded machine does not reach it by chance.
        assert float(fields["elapsed"]) < 15, got[0]
        print(got[0])
    assert cluster.leftovers(marker, within=15) == {}


# -- other launchers -------------------------------------------------------------------------


@pytest.mark.skipif(mpirun_missing() is not None, reason=str(mpirun_missing()))
def test_open_mpi_mpirun_across_hosts(cluster):
    """Open MPI starts the ranks over ssh (port 2222 through plm_rsh_args, as in the docs);
    ferrovod's store address comes with -x. init() gives each of a host's two ranks half of
    its cores for OpenMP/BLAS, as mpirun does not."""
    env = clean_env()
    res = cluster.run("h0", [
        "mpirun", "--allow-run-as-root", "-np", "4", "-H", "h1:2,h2:2",
        "-mca", "plm_rsh_args", " ".join(cluster.ssh_args()),
        "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib",
        "-x", "PATH", "-x", "PYTHONPATH", "-x", "FERROVOD_RENDEZVOUS_ADDR=h1:29500",
        PY, WORKER, "h1:2,h2:2", f"OMP_NUM_THREADS={max(1, len(os.sched_getaffinity(0)) // 2)}"],
        timeout=120, env=env)
    assert res.returncode == 0, describe(res)
    assert res.stdout.count("OK ") == 4, describe(res)


def test_torchrun_on_each_host(cluster):
    """Real torchrun on two hosts (static rendezvous, node ranks 0 and 1), 2 processes each."""
    procs = []
    for node, host in enumerate(("h1", "h2")):
        procs.append(cluster.popen(host, [
            PY, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
            f"--node-rank={node}", "--master-addr=h1", "--master-port=29400",
            WORKER, "h1:2,h2:2"], env=clean_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{out}\n{err[-6000:]}"
    assert sum(out.count("OK ") for out, _ in outs) == 4, outs
