"""Process sets: per-set results, disjoint sets not waiting on each other, registration."""

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


def test_static_sets_results_and_independence():
    res = run_job(4, "pset_worker.py", "static", timeout=120)
    assert_ok(res, 4, min_checks=60, same_count=False)
    for r in (1, 3):
        # The worker orders it by events: set A's ranks submit only after set B's 100 ops.
        timing = lines_matching(res, r, r"^set B: 100 allreduces in ([\d.]+) s")
        assert timing, describe(res)


@pytest.mark.parametrize("mode", ["dynamic", "dynamic_env"])
def test_dynamic_add_and_remove(mode):
    env = {"FERROVOD_DYNAMIC_PROCESS_SETS": 1} if mode == "dynamic_env" else None
    res = run_job(4, "pset_worker.py", mode, env=env, timeout=120)
    assert_ok(res, 4, min_checks=40, same_count=False)
