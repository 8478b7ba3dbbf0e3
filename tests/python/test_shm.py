"""Shared memory between the ranks of one host: two jobs side by side do not interfere, and a
killed job leaves nothing behind (segments are memfds, which have no name anywhere)."""

import subprocess
import sys
import time

import pytest

from conftest import WORKERS, _env, assert_ok, describe, launcher_cmd, live_pids_with_arg

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


def test_two_jobs_on_one_host_at_once():
    """Two 3-rank jobs at once on one host, each linked over shared memory only; every rank
    sees its segments while it runs and none after shutdown() (stress_worker.py counts its
    ferrovod memfds, which never appear in /dev/shm)."""
    procs = []
    for seed in (1, 2):
        cmd = launcher_cmd(3, "stress_worker.py", 3000 + seed, 1500)
        procs.append(subprocess.Popen(cmd, env=_env({"FERROVOD_LOG_LEVEL": "debug"}),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
        assert out.count("OK ") >= 3, out[-3000:]
        # Every pair of ranks of each job linked over shared memory, and over nothing else.
        for r in range(3):
            for q in range(3):
                if q != r:
                    assert f"rank {r}: data link to rank {q} made, over shared memory" in err, \
                        err[-3000:]
        assert "made, over TCP" not in err, err[-3000:]


def test_killed_job_leaves_no_shared_memory_behind():
    """A rank killed mid-job: the others fail and exit, and no process of the job is left.
    Its segments are memfds, which the kernel frees with the last process that maps them, so
    a job with no process left holds no shared memory (there is no name to leak)."""
    marker = f"fvshm-{time.time_ns()}"
    cmd = launcher_cmd(3, "errors_worker.py", "kill", marker, 20)
    res = subprocess.run(cmd, env=_env({"FERROVOD_TIMEOUT_SECONDS": "10"}), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "RANKFAIL" in res.stdout, res.stdout + res.stderr
    assert live_pids_with_arg(marker) == [], "processes of the killed job are still alive"
