"""The fast path of small blocking allreduces, broadcasts, allgathers, reducescatters and alltoalls (ranks on one host agree through shared memory,
without the coordinator): results against NumPy, the engine's own count of the ops that took
it, offers that meet declines, mismatches, threads, join, and a peer that dies mid-wait."""

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

ALL = "reduce,broadcast,allgather,scatter,orders,torch,mismatch,threads,join"


@pytest.mark.parametrize("n", [1, 2, 3])
def test_fast_path_against_numpy_and_its_fallbacks(n):
    sections = "reduce,broadcast,allgather,scatter,torch,join" if n == 1 else ALL
    res = run_job(n, "fast_path_worker.py", 40 + n, sections, timeout=240)
    assert_ok(res, n, min_checks=500, same_count=False)
    for r in range(n):
        done = [m.group(1) for m in lines_matching(res, r, r"^section (\w+):")]
        assert done == sections.split(","), f"rank {r} ran sections {done}\n{describe(res)}"


def test_fast_path_off_takes_nothing():
    """FERROVOD_FAST_PATH_BYTES=0: every op goes through the engine (the worker's counts
    then fail its checks, which is what this test expects of the counting)."""
    res = run_job(2, "fast_path_worker.py", 50, "reduce", timeout=240,
                  env={"FERROVOD_FAST_PATH_BYTES": "0"})
    assert res.returncode != 0, describe(res)
    fails = [r for r in range(2) if lines_matching(res, r, r"^FAIL rank \d+: .*ops reduced on the fast path: got 0")]
    assert fails, describe(res)
