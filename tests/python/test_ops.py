"""Every collective, dtype and shape class against a NumPy reference, in real launched jobs.

The work happens in workers/ops_worker.py: each rank regenerates every rank's input from a
seed and checks its own result, then prints ``OK <n_checks>``. One launch covers all ops; the
jobs differ in size (1, 2, 3, 4 ranks: power of two or not, odd row counts per rank).
"""

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

ALL = "allreduce,grouped,allgather,broadcast,alltoall,reducescatter,misc"

# Lower bounds on the checks one rank runs over all sections; the exact count grows with n
# (broadcast covers every root). They catch a worker that silently skipped a section.
MIN_CHECKS = {1: 1500, 2: 1600, 3: 1700, 4: 1800}


# Ranks of one host talk over shared memory by default; "tcp" runs the same suite with it off.
@pytest.mark.parametrize("n,link", [(1, "shm"), (2, "shm"), (3, "shm"), (4, "shm"),
                                    (2, "tcp"), (3, "tcp")])
def test_every_op_every_dtype(n, link):
    res = run_job(n, "ops_worker.py", 11 + n, ALL, timeout=240,
                  env={"FERROVOD_SHM_DISABLE": "1" if link == "tcp" else "0"})
    counts = assert_ok(res, n, MIN_CHECKS[n], same_count=False)
    for r in range(n):
        done = [m.group(1) for m in lines_matching(res, r, r"^section (\w+):")]
        assert done == ALL.split(","), f"rank {r} ran sections {done}\n{describe(res)}"
    print(f"{n} ranks: {counts[0]} checks per rank in {res.elapsed:.1f} s")


def test_worker_reports_a_wrong_result():
    """The harness itself can fail: a deliberately wrong expectation must make the job fail."""
    res = run_job(2, "selfcheck_worker.py", timeout=60)
    assert res.returncode != 0, f"a failing check did not fail the job\n{describe(res)}"
    fails = [r for r in range(2) if lines_matching(res, r, r"^FAIL rank \d+: CheckFailure: .*allreduce")]
    assert fails, f"no FAIL line naming the op\n{describe(res)}"


def test_a_pending_op_costs_the_garbage_collector_two_objects():
    res = run_job(2, "pending_objects_worker.py", timeout=120)
    assert_ok(res, 2, min_checks=4 * 2 * 300)
    print("\n".join(m.group(0) for m in lines_matching(res, 0, r"^PENDING .*")))
