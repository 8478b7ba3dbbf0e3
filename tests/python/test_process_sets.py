"""Process sets: per-set results, disjoint sets not waiting on each other, registration."""

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


def test_static_sets_results_and_independence():
    res = run_job(4, "pset_worker.py", "static", timeout=120)
    assert_ok(res, 4, min_checks=60, same_count=False)
    for r in (1, 3):
        timing = lines_matching(res, r, r"^set B: 100 allreduces in ([\d.]+) s")
        assert timing, describe(res)
        assert float(timing[0].group(1)) < 3.0, f"set B took {timing[0].group(1)} s: it waited for set A"


@pytest.mark.parametrize("mode", ["dynamic", "dynamic_env"])
def test_dynamic_add_and_remove(mode):
    env = {"FERROVOD_DYNAMIC_PROCESS_SETS": 1} if mode == "dynamic_env" else None
    res = run_job(4, "pset_worker.py", mode, env=env, timeout=120)
    assert_ok(res, 4, min_checks=40, same_count=False)
