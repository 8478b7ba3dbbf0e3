"""Thousands of random ops of every kind in one 3- or 4-rank job, each checked against NumPy."""

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


@pytest.mark.parametrize("n,n_ops,link", [(3, 2500, "shm"), (4, 5000, "shm"), (3, 2500, "tcp")])
def test_random_ops_sync_async_grouped(n, n_ops, link):
    res = run_job(n, "stress_worker.py", 2024 + n, n_ops, timeout=300,
                  env={"FERROVOD_SHM_DISABLE": "1" if link == "tcp" else "0"})
    counts = assert_ok(res, n, min_checks=n_ops)
    stats = lines_matching(res, 0, r"^STRESS ops=(\d+) sync=(\d+) async=(\d+) step=(\d+) grouped=(\d+) elapsed=(\S+)")
    assert stats, describe(res)
    ops, sync, asyn, step, grouped = (int(v) for v in stats[0].groups()[:5])
    assert ops >= n_ops and min(sync, asyn, step, grouped) > 100, stats[0].group(0)
    print(f"{stats[0].group(0)}; {counts[0]} checks per rank; job {res.elapsed:.1f} s")
