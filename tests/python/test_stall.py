"""Stall inspector: a rank that skips a tensor is named in rank 0's warning; with a shutdown
time the op fails on every rank that submitted it."""

import pytest

from conftest import describe, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


# Fanout 1: the chain 0 <- 1 <- 2, rank 2's submissions reach the coordinator through rank 1.
@pytest.mark.parametrize("fanout", ["32", "1"])
def test_rank_that_skips_a_tensor_is_named_in_the_warning(fanout, tmp_path):
    # Rank 1 submits the tensor only once rank 0 has warned: the job ends only if it does.
    res = run_job(3, "stall_worker.py", "warn", tmp_path,
                  env={"FERROVOD_STALL_CHECK_TIME_SECONDS": "1",
                       "FERROVOD_CONTROL_FANOUT": fanout}, timeout=180)
    assert res.returncode == 0, describe(res)
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("[0]<stderr>:")]
    text = "\n".join(warnings)
    assert "ferrovod rank 0: WARNING" in text, describe(res)
    assert "Missing ranks:" in text and "1: [skipped.by.rank1]" in text, describe(res)
    # Only the missing rank is listed.
    assert "0: [skipped" not in text and "2: [skipped" not in text, describe(res)
    assert not any("WARNING" in ln for ln in res.stderr.splitlines()
                   if ln.startswith(("[1]", "[2]"))), "only rank 0 inspects"


@pytest.mark.parametrize("fanout", ["32", "1"])
def test_stall_shutdown_fails_the_op_on_every_rank(fanout, tmp_path):
    # The operation timeout is far beyond the job's: a FerrovodTimeoutError within it can only
    # be the stall shutdown's, which its message names.
    res = run_job(3, "stall_worker.py", "shutdown", tmp_path,
                  env={"FERROVOD_STALL_CHECK_TIME_SECONDS": "1",
                       "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS": "2",
                       "FERROVOD_TIMEOUT_SECONDS": "600",
                       "FERROVOD_CONTROL_FANOUT": fanout}, timeout=180)
    assert res.returncode == 0, describe(res)
    for r in (0, 2):
        line = next((ln for ln in res.ranks[r] if ln.startswith("OK FerrovodTimeoutError")), None)
        assert line is not None, describe(res)
        assert "skipped.by.rank1" in line and "[1]" in line, line
        assert "stalled for more than 2 s" in line, line
        assert "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS" in line, line


def test_disabled_inspector_says_nothing(tmp_path):
    res = run_job(2, "stall_worker.py", "quiet", tmp_path,
                  env={"FERROVOD_STALL_CHECK_TIME_SECONDS": "1", "FERROVOD_STALL_CHECK_DISABLE": "1"},
                  timeout=60)
    assert res.returncode == 0, describe(res)
    assert "Missing ranks" not in res.stderr, describe(res)
