"""Hostile input and lifecycle misuse, as outside testing found them: each case is a clear
error on every rank involved, nothing hangs, and the job goes on. The workers no longer time
their errors (a loaded machine's clock says little): an error of the expected class is not the
operation timeout's FerrovodTimeoutError, so it reached every rank without waiting for one."""

import os
import signal

import pytest

from conftest import assert_ok, describe, launcher_cmd, lines_matching, run_job, wait_until

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


@pytest.mark.parametrize("n", [2, 3])
def test_a_second_op_under_a_pending_name_is_refused_at_submission(n):
    assert_ok(run_job(n, "hostile_worker.py", "dupname", timeout=90), n, min_checks=10)


@pytest.mark.parametrize("fast", ["1", "0"])
def test_threads_sharing_a_name_get_errors_not_a_hang(fast):
    env = {} if fast == "1" else {"FERROVOD_FAST_PATH_BYTES": "0"}
    res = run_job(2, "hostile_worker.py", "threads", 4, env=env, timeout=90)
    assert_ok(res, 2, min_checks=6)


@pytest.mark.parametrize("n", [2, 3])
def test_arguments_one_rank_refuses_fail_the_op_on_every_rank(n):
    res = run_job(n, "hostile_worker.py", "reject", timeout=120)
    assert_ok(res, n, min_checks=35, same_count=False)
    for r in range(n):
        assert len(lines_matching(res, r, r"^caught ")) == 18, describe(res)


def test_torch_arguments_one_rank_refuses_fail_the_op_on_every_rank():
    res = run_job(2, "hostile_worker.py", "torch_reject", timeout=120)
    assert_ok(res, 2, min_checks=7)
    for r in range(2):
        assert len(lines_matching(res, r, r"^caught ")) == 8, describe(res)


def test_unpicklable_objects_fail_every_rank():
    assert_ok(run_job(3, "hostile_worker.py", "objects", timeout=90), 3, min_checks=8)


def test_join_fails_when_a_rank_shuts_down_without_joining():
    res = run_job(3, "hostile_worker.py", "join_left", timeout=60)
    assert_ok(res, 3, same_count=False)


def test_different_process_sets_at_init_fail_every_rank():
    assert_ok(run_job(3, "hostile_worker.py", "psets_init", timeout=60), 3, min_checks=4)


def test_a_process_set_with_pending_ops_is_not_removed():
    res = run_job(3, "hostile_worker.py", "pset_busy", timeout=60)
    assert_ok(res, 3, min_checks=3, same_count=False)


def test_ctrl_c_interrupts_a_rank_blocked_in_an_op(tmp_path):
    """SIGINT reaches a rank waiting on a peer that never submits (Python only runs signal
    handlers between bytecodes; a wait in Rust must give it the chance)."""
    import subprocess

    from conftest import _env

    ready = tmp_path / "ready"
    log = tmp_path / "job.out"
    # Rank 0's stall warning names the op once it has waited a second: by then rank 0 is inside
    # the op (it submitted it there), and only a wait in Rust that checks for signals can
    # raise the KeyboardInterrupt.
    env = _env({"FERROVOD_STALL_CHECK_TIME_SECONDS": "1"})
    with open(log, "w") as out_file:
        proc = subprocess.Popen(launcher_cmd(2, "hostile_worker.py", "sigint", ready),
                                stdout=out_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        warned = wait_until(lambda: proc.poll() is not None or (
            ready.exists() and "Missing ranks" in log.read_text()
            and "never.on.rank1" in log.read_text()), 120)
        assert warned and proc.poll() is None, log.read_text()
        os.kill(int(ready.read_text()), signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = log.read_text()
    assert "[0]<stdout>:interrupted after" in out, out
    assert "[0]<stdout>:OK 1" in out, out


@pytest.mark.parametrize("api,n", [("numpy", 2), ("numpy", 3), ("torch", 2), ("torch", 3)])
def test_every_disagreement_fails_every_rank_and_the_job_goes_on(api, n):
    """The probe's matrix: every collective crossed with every way ranks can disagree on it,
    fast-path and large sizes, blocking and async, each rank in turn the odd one out."""
    res = run_job(n, "probe_worker.py", api, timeout=240)
    assert_ok(res, n, min_checks=200 * 4)
    for r in range(n):
        probed = lines_matching(res, r, r"^probed (\d+)")
        assert probed and int(probed[0].group(1)) >= 200, describe(res)


def test_misused_handles_and_lifecycle_calls_are_clear_errors():
    assert_ok(run_job(2, "probe_worker.py", "lifecycle", timeout=60), 2, min_checks=9,
              same_count=False)
