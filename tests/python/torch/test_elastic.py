"""Elastic training through the real launcher: ``localhost`` and ``127.0.0.1`` are two hosts
of 2 slots each, listed by a discovery script that reads a file the test (or the job) edits.
Each run that recovers or resizes trains with ``ferrovod.torch.elastic`` and checks, in
elastic_worker.py, that every sample of every epoch was trained exactly once, that every rank
holds the same weights, and that they equal a one-process replay of the same global batches.
The runs that hold the launcher's driver to its limits (a reset limit, too few hosts, every
worker failing, fixed hosts without a script) run the framework-free worker
(workers/elastic_numpy_worker.py): they go through the same ``ferrovod.elastic.run`` that
``ferrovod.torch.elastic`` re-exports, without starting torch in each of their workers (about 3
core-seconds each on the 2-core VM, most of such a job's CPU)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import _env, _run, describe, lines_matching

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent
WORKER = HERE / "elastic_worker.py"
EXAMPLE = HERE.parent.parent.parent / "examples" / "elastic" / "pytorch_digits_elastic.py"
BOTH = "localhost:2\n127.0.0.1:2\n"
NUMPY_WORKER = HERE.parent / "workers" / "elastic_numpy_worker.py"


def numpy_worker(scenario):
    """The framework-free elastic worker: ``kill`` (127.0.0.1's second worker SIGKILLs
    itself at step 5) or ``all`` (every worker raises there)."""
    return [sys.executable, str(NUMPY_WORKER), scenario]


def done_sizes(res):
    """The job size each rank that finished reports (``DONE size S ...``)."""
    return sorted(int(m.group(1)) for r in res.ranks
                  for m in lines_matching(res, r, r"^DONE size (\d+) counted 20 "))


def elastic_job(tmp_path, hosts, np_, scenario="none", flags=(), timeout=120, env=None,
                worker=None):
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(np_),
           # Each run of discovery appends a byte to `discoveries`: a worker can wait for runs.
           "--host-discovery-script", f"cat {hosts_file}; printf . >> {tmp_path}/discoveries",
           *flags,
           *(worker or [sys.executable, str(WORKER), scenario, str(hosts_file), str(tmp_path)])]
    return _run(cmd, _env(env), timeout)


def result(tmp_path):
    got = json.loads((tmp_path / "result.json").read_text())
    commits = [int(x) for x in (tmp_path / "commits").read_text().split()]
    assert commits == sorted(commits), f"committed steps went back: {commits}"
    return got


def sizes_seen(res):
    return sorted({int(m.group(1)) for r in res.ranks for m in lines_matching(res, r, r"^size (\d+) ")})


@pytest.mark.parametrize("scenario", ["kill", "raise"])
def test_a_lost_worker_is_recovered_in_place(tmp_path, scenario):
    """One worker of host 127.0.0.1 dies (SIGKILL) or raises mid-epoch: the host is
    blacklisted, its other worker leaves, and the two survivors go on from the last commit."""
    t0 = time.monotonic()
    res = elastic_job(tmp_path, BOTH, 4, scenario, ["--min-np", "2", "--elastic-timeout", "30"])
    assert res.returncode == 0, describe(res)
    assert "blacklisting 127.0.0.1" in res.stderr, describe(res)
    assert "127.0.0.1[0] has been removed from the elastic job" in res.stdout + res.stderr
    got = result(tmp_path)
    assert got["size"] == 2 and got["resets"] == 1, got
    assert sizes_seen(res) == [2, 4], describe(res)
    assert time.monotonic() - t0 < 90


def test_a_worker_failing_during_the_reset_is_just_another_failure(tmp_path):
    """Horovod hangs here (#3014): after one host's worker died, another host's worker dies
    while the survivors re-form and sync. They reset again and go on."""
    res = elastic_job(tmp_path, "localhost:2\n127.0.0.1:1\n127.0.0.2:1\n", 4, "twice",
                      ["--min-np", "2", "--elastic-timeout", "30"])
    assert res.returncode == 0, describe(res)
    assert "blacklisting 127.0.0.1" in res.stderr and "blacklisting 127.0.0.2" in res.stderr
    got = result(tmp_path)
    assert got["size"] == 2 and got["resets"] == 2, got


def test_a_host_added_by_discovery_joins_at_the_next_commit(tmp_path):
    res = elastic_job(tmp_path, "localhost:2\n", 2, "add", ["--min-np", "2", "--max-np", "4"])
    assert res.returncode == 0, describe(res)
    got = result(tmp_path)
    assert got["size"] == 4 and got["resets"] == 1, got
    assert sizes_seen(res) == [2, 4], describe(res)
    # The new workers started from the survivors' state, not from the beginning.
    joined = [int(m.group(1)) for r in (2, 3) for m in lines_matching(res, r, r"^size 4 rank \d epoch \d step (\d+)")]
    assert joined and all(s > 0 for s in joined), describe(res)


def test_a_host_removed_by_discovery_leaves_at_the_next_commit(tmp_path):
    res = elastic_job(tmp_path, BOTH, 4, "remove", ["--min-np", "2"])
    assert res.returncode == 0, describe(res)
    got = result(tmp_path)
    assert got["size"] == 2 and got["resets"] == 1, got
    assert "blacklisting" not in res.stderr, describe(res)


def test_below_min_np_every_process_fails_within_the_elastic_timeout(tmp_path):
    t0 = time.monotonic()
    res = elastic_job(tmp_path, BOTH, 4, flags=["--min-np", "3", "--elastic-timeout", "4"],
                      worker=numpy_worker("kill"))
    took = time.monotonic() - t0
    assert res.returncode != 0, describe(res)
    assert "for at least 3 slots (--min-np); 2 available" in res.stderr, describe(res)
    for r in (0, 1):
        assert lines_matching(res, r, r"the elastic job was stopped: waited"), describe(res)
    assert took < 60, f"took {took:.0f} s"


def test_every_worker_failing_ends_the_job_at_once(tmp_path):
    """No survivor holds the committed state, so there is nothing to recover: the job ends
    with the first failure instead of waiting the elastic timeout for hosts (Horovod too)."""
    t0 = time.monotonic()
    res = elastic_job(tmp_path, BOTH, 4, flags=["--min-np", "2", "--elastic-timeout", "120"],
                      worker=numpy_worker("all"))
    took = time.monotonic() - t0
    assert res.returncode != 0, describe(res)
    assert "every worker has failed; no survivor holds the committed state" in res.stderr, \
        describe(res)
    assert "the first failure was" in res.stderr, describe(res)
    # While the last worker still runs, the driver may say it waits for hosts (that worker
    # could hold the state); its failure ends the wait at once, long before the timeout.
    assert took < 60, f"took {took:.0f} s\n{describe(res)}"


def test_the_reset_limit_stops_the_job(tmp_path):
    res = elastic_job(tmp_path, BOTH, 4, flags=["--min-np", "2", "--reset-limit", "0"],
                      worker=numpy_worker("kill"))
    assert res.returncode != 0, describe(res)
    assert "exceeded limit: 0" in res.stderr, describe(res)
    for r in (0, 1):
        assert lines_matching(res, r, r"exceeded limit: 0"), describe(res)


def test_without_a_script_the_fixed_hosts_give_fault_tolerance(tmp_path):
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", "4", "--min-np", "2",
           "-H", "localhost:2,127.0.0.1:2", *numpy_worker("kill")]
    res = _run(cmd, _env(None), 120)
    assert res.returncode == 0, describe(res)
    assert done_sizes(res) == [2, 2], describe(res)


def test_a_blacklisted_host_comes_back_after_its_cooldown(tmp_path):
    """With a 2 s cooldown (LO 1 × 2^1, Horovod's rule) the killed worker's host is let back
    in: the job shrinks to 2 and grows to 4 again, and the result still matches the replay."""
    res = elastic_job(tmp_path, BOTH, 4, "kill", ["--min-np", "2",
                                                  "--blacklist-cooldown-range", "1", "2"],
                      env={"ELASTIC_STEP_SLEEP": "0.4"})
    assert res.returncode == 0, describe(res)
    assert "blacklisting 127.0.0.1 for 2 s" in res.stderr, describe(res)
    epochs = [ln for ln in res.stderr.splitlines() if "elastic: epoch" in ln]
    assert len(epochs) >= 3 and "4 worker(s)" in epochs[-1], describe(res)
    assert result(tmp_path)["size"] == 4


def test_a_host_back_from_its_cooldown_never_takes_rank_0_from_the_survivors(tmp_path):
    """The first host (rank 0's) loses a worker and is blacklisted for 2 s: the survivors on
    127.0.0.1 hold the committed state, and when localhost comes back its fresh workers must
    come after them, or the new rank 0 would hand every rank its empty state (the committed
    steps, which result() checks, would go back)."""
    res = elastic_job(tmp_path, BOTH, 4, "first", ["--min-np", "2",
                                                   "--blacklist-cooldown-range", "1", "2"],
                      env={"ELASTIC_STEP_SLEEP": "0.4"})
    assert res.returncode == 0, describe(res)
    assert "blacklisting localhost for 2 s" in res.stderr, describe(res)
    epochs = [ln for ln in res.stderr.splitlines() if "elastic: epoch" in ln]
    assert "4 worker(s)" in epochs[-1] and "127.0.0.1[0]=0" in epochs[-1], describe(res)
    assert result(tmp_path)["size"] == 4


def test_hosts_that_would_leave_no_survivor_never_restart_training(tmp_path):
    """Discovery replaces the only host with a new one: a membership of new workers alone
    would start training over from their empty state. The driver makes none and says so;
    the current workers train on to the end."""
    res = elastic_job(tmp_path, "localhost:2\n", 2, "replace", ["--min-np", "2"], timeout=90)
    assert res.returncode == 0, describe(res)
    assert "keep no worker of the current membership" in res.stderr, describe(res)
    got = result(tmp_path)
    assert got["size"] == 2 and got["resets"] == 0, got


@pytest.mark.parametrize("hosts,flags,env,message", [
    ("localhost\n", [], {}, "without a slot count"),
    ("localhost\n", ["--slots-per-host", "2"], {}, None),
    ("localhost\n", [], {"OMPI_MCA_orte_set_default_slots": "2"}, None),
])
def test_bare_host_names_take_the_slots_per_host(tmp_path, hosts, flags, env, message):
    """The MPI Operator's discover_hosts.sh prints bare pod names."""
    res = elastic_job(tmp_path, hosts, 2, flags=["--min-np", "2", *flags], env=env,
                      worker=[sys.executable, "-c", "import ferrovod as fv; fv.init(); "
                              "print('size', fv.size())"], timeout=60)
    if message:
        assert res.returncode != 0 and message in res.stderr, describe(res)
    else:
        assert res.returncode == 0, describe(res)
        assert lines_matching(res, 0, r"^size 2"), describe(res)


def test_bind_cores_binds_the_workers_of_an_elastic_job(tmp_path):
    from ferrovod.runner.cpus import physical_cores, share_of

    cores = physical_cores(sorted(os.sched_getaffinity(0)))
    res = elastic_job(tmp_path, "localhost:2\n", 2, flags=["--min-np", "2", "--bind-cores"],
                      worker=[sys.executable, "-c", "import os, ferrovod as fv; fv.init(); "
                              "print('cpus', fv.local_rank(), sorted(os.sched_getaffinity(0)))"],
                      timeout=60)
    assert res.returncode == 0, describe(res)
    got = {}
    for r in (0, 1):
        (m,) = lines_matching(res, r, r"^cpus (\d) (.*)$")
        got[int(m.group(1))] = json.loads(m.group(2))
    assert got == {lr: sorted(share_of(cores, lr, 2)) for lr in (0, 1)}, describe(res)


def test_a_failing_first_discovery_is_fatal(tmp_path):
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", "2", "--host-discovery-script",
           "echo no hosts for you >&2; exit 3", sys.executable, "-c", "pass"]
    res = _run(cmd, _env(None), 30)
    assert res.returncode != 0, describe(res)
    assert "exited with exit code 3: no hosts for you" in res.stderr, describe(res)


@pytest.mark.parametrize("flags,message", [
    (["-np", "2", "--min-np", "3"], "-np 2 is below --min-np 3"),
    (["-np", "4", "--min-np", "2", "--max-np", "3"], "--max-np 3 is below -np 4"),
    (["-np", "2", "--min-np", "2"], "needs --host-discovery-script, or -H/--hostfile"),
    (["-np", "2", "--reset-limit", "1", "-H", "localhost:2"], "only apply to an elastic job"),
    (["-np", "2", "--min-np", "2", "-H", "localhost:2", "--blacklist-cooldown-range", "5", "1"],
     "0 < LO <= HI"),
])
def test_elastic_usage_errors(flags, message):
    res = _run([sys.executable, "-m", "ferrovod.runner.launch", *flags, "true"], _env(None), 30)
    assert res.returncode == 2 and message in res.stderr, describe(res)


def _workers_on(host, marker):
    """Pids of this job's elastic workers of ``host`` (found by their environment)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (f"FERROVOD_TEST_JOB={marker}".encode() in env and b"FERROVOD_ELASTIC=1" in env
                and f"FERROVOD_HOSTNAME={host}".encode() in env):
            pids.append(int(entry))
    return pids


def test_the_example_survives_a_worker_killed_from_outside(tmp_path):
    """examples/elastic/pytorch_digits_elastic.py as the README runs it; once an epoch is done,
    one of host 127.0.0.1's workers is SIGKILLed from outside the job."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(BOTH)
    marker = uuid.uuid4().hex
    env = _env({"FERROVOD_TEST_JOB": marker})
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", "4", "--min-np", "2",
           "--host-discovery-script", f"cat {hosts_file}", sys.executable,
           str(EXAMPLE), "--epochs", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    lines, killed = [], False
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            lines.append(line)
            if not killed and "epoch 1: test accuracy" in line:
                victims = _workers_on("127.0.0.1", marker)
                assert victims, "".join(lines)
                os.kill(victims[0], signal.SIGKILL)
                killed = True
            assert time.monotonic() < deadline, "".join(lines)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = "".join(lines)
    assert proc.returncode == 0 and killed, out
    assert "training on 2 workers from epoch" in out, out
    acc = [float(m) for m in re.findall(r"test accuracy: ([\d.]+)%", out)]
    assert acc and acc[-1] >= 80.0, out


def test_output_files_are_named_by_worker(tmp_path):
    out = tmp_path / "out"
    res = elastic_job(tmp_path, "localhost:2\n", 2, flags=["--min-np", "2", "--output-filename", str(out)],
                      worker=[sys.executable, "-c", "import ferrovod as fv; fv.init(); "
                              "print('rank', fv.rank())"], timeout=60)
    assert res.returncode == 0, describe(res)
    got = sorted((out / f"worker.{w}" / "stdout").read_text() for w in (0, 1))
    assert got == ["rank 0\n", "rank 1\n"], got


def test_framework_free_object_state_recovers(tmp_path):
    """``ferrovod.elastic.run`` and ``ObjectState`` over ferrovod's own collectives."""
    res = elastic_job(tmp_path, BOTH, 4, flags=["--min-np", "2"], worker=numpy_worker("kill"),
                      timeout=90)
    assert res.returncode == 0, describe(res)
    done = [m for r in res.ranks for m in lines_matching(res, r, r"^DONE size 2 counted 20 sizes (.*)")]
    assert len(done) == 2, describe(res)
    sizes = json.loads(done[0].group(1))
    assert sizes[:4] == [4] * 4 and sizes[4:] == [2] * 16, sizes
