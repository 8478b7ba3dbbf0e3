"""Shared memory between the ranks of one host: two jobs side by side do not interfere, and a
killed job leaves nothing behind (segments are memfds, which have no name anywhere)."""

import os
import subprocess
import sys
import time

import pytest

from conftest import WORKERS, assert_ok, describe, launcher_cmd, _env

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


def _shm_entries():
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def test_two_jobs_on_one_host_at_once():
    before = _shm_entries()
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
    assert _shm_entries() == before


def test_killed_job_leaves_no_shared_memory_behind():
    before = _shm_entries()
    cmd = launcher_cmd(3, "errors_worker.py", "kill", f"fvshm-{time.time_ns()}", 20)
    res = subprocess.run(cmd, env=_env({"FERROVOD_TIMEOUT_SECONDS": "10"}), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0, res.stdout + res.stderr
    assert "RANKFAIL" in res.stdout, res.stdout + res.stderr
    assert _shm_entries() == before
