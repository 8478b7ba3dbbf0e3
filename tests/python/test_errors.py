"""Failures surface as the documented exceptions on every rank, and nothing hangs."""

import re
import time

import pytest

from conftest import (assert_ok, describe, lines_matching, live_pids_with_arg, run_job,
                      run_plain, wait_until)

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

MISMATCH_CASES = ["shape mismatch", "dtype mismatch", "op kind mismatch", "reduce op mismatch",
                  "broadcast root mismatch", "allgather trailing-dim mismatch", "prescale mismatch",
                  "unnamed shape mismatch", "async shape mismatch"]


def test_mismatches_raise_on_every_rank_and_the_job_goes_on():
    res = run_job(3, "errors_worker.py", "mismatch", timeout=120)
    assert_ok(res, 3, min_checks=len(MISMATCH_CASES) * 7)
    for r in range(3):
        caught = [m.group(1) for m in lines_matching(res, r, r"^caught (.+?): ")]
        assert caught == MISMATCH_CASES, f"rank {r} caught {caught}\n{describe(res)}"


def test_invalid_arguments_are_value_errors():
    res = run_job(2, "errors_worker.py", "invalid", timeout=60)
    assert_ok(res, 2, min_checks=15)


def test_disagreeing_settings_fail_init_on_every_rank():
    res = run_job(3, "errors_worker.py", "settings", timeout=60)
    assert_ok(res, 3, min_checks=4)


def test_ops_before_init_raise_not_initialized():
    res = run_plain("errors_worker.py", "notinit")
    assert res.returncode == 0 and "OK " in res.stdout, describe(res)


@pytest.mark.parametrize("n,link", [(3, "shm"), (4, "shm"), (3, "tcp"), (5, "relay")])
def test_killed_rank_is_reported_by_every_survivor(n, link):
    """Detected by the failure, not the timeout, over shared memory (ranks on one host) and
    over TCP alike; and when the killed rank relays the others' control messages (a control
    tree of fanout 1 is the chain 0 <- 1 <- 2 <- 3 <- 4, every op through the coordinator):
    the ranks below it, cut off from the coordinator, name it too."""
    marker = f"fvkill-{time.time_ns()}"
    t0 = time.monotonic()
    env = {"FERROVOD_TIMEOUT_SECONDS": 30, "FERROVOD_SHM_DISABLE": "1" if link == "tcp" else "0"}
    if link == "relay":
        env.update({"FERROVOD_CONTROL_FANOUT": "1", "FERROVOD_FAST_PATH_BYTES": "0"})
    res = run_job(n, "errors_worker.py", "kill", marker, 40, env=env, timeout=90)
    total = time.monotonic() - t0
    assert res.returncode != 0, f"the launcher must fail when a rank was killed\n{describe(res)}"
    assert lines_matching(res, 1, r"^killing myself"), describe(res)
    for r in range(n):
        if r == 1:
            continue
        got = lines_matching(res, r, r"^RANKFAIL iteration=(\d+) rank_attr=(\S+) elapsed=([\d.]+) internal=(\w+)")
        assert got, f"rank {r} did not report RankFailureError\n{describe(res)}"
        _, rank_attr, elapsed, internal = got[0].groups()
        assert rank_attr == "1", f"rank {r}: RankFailureError.rank is {rank_attr}, expected 1\n{describe(res)}"
        assert internal == "True", f"rank {r}: RankFailureError is not a HorovodInternalError"
        # Detected by the failure itself, not by the 30 s operation timeout: half of it is a
        # bound a loaded machine does not reach by chance. How fast detection is (the worker
        # prints it; under 2 s on an idle machine) is a benchmark's figure, not a test's bound.
        assert float(elapsed) < 15, f"rank {r} needed {elapsed} s to notice the dead rank"
        msg = [ln for ln in res.ranks[r] if ln.startswith("RANKFAIL")][0]
        assert re.search(r"rank\D{0,20}\b1\b", msg.split(" msg=", 1)[1], re.I), f"message does not name rank 1: {msg}"
        nxt = lines_matching(res, r, r"^NEXT-OP (\S+)")
        assert nxt and nxt[0].group(1) != "succeeded", f"rank {r}: an op after the failure: {nxt}\n{describe(res)}"
    assert total < 60, f"the job took {total:.1f} s to end after a rank died"
    # The launcher has exited; a rank's last process may still be being reaped.
    gone = wait_until(lambda: not live_pids_with_arg(marker), 30)
    assert gone, f"processes left behind: {live_pids_with_arg(marker)}\n{describe(res)}"


def test_launcher_lets_every_survivor_report_the_killed_rank():
    """A rank SIGKILLed mid-collective: the launcher sees its exit at once, but must leave the
    survivors (default SIGTERM action, error not caught, a short cleanup before Python prints
    it) the moment they need to print their RankFailureError naming it. Several runs: a
    launcher that terminates the survivors as soon as the rank dies loses their lines."""
    n, runs = 3, 3
    for attempt in range(runs):
        res = run_job(n, "survivor_worker.py", 0.3, timeout=60)
        assert res.returncode == 137, f"run {attempt}: the killed rank's status\n{describe(res)}"
        assert "the first was rank 1" in res.stderr, describe(res)
        assert lines_matching(res, 1, r"^killing myself"), describe(res)
        for r in range(n):
            if r == 1:
                continue
            got = lines_matching(res, r, r"RankFailureError: (.*)")
            assert got, f"run {attempt}: rank {r}'s error is not in the output\n{describe(res)}"
            assert re.search(r"\brank 1\b", got[0].group(1)), f"not naming rank 1: {got[0].group(0)}"
        assert res.elapsed < 20, f"run {attempt} took {res.elapsed:.1f} s\n{describe(res)}"


_RANK1_OF_2 = {"FERROVOD_RANK": "1", "FERROVOD_SIZE": "2", "FERROVOD_START_TIMEOUT": "15"}


@pytest.mark.parametrize("env, named", [
    ({"FERROVOD_TIMEOUT_SECONDS": "0"}, 'FERROVOD_TIMEOUT_SECONDS="0"'),
    ({"HOROVOD_GLOO_TIMEOUT_SECONDS": "-1"}, 'HOROVOD_GLOO_TIMEOUT_SECONDS="-1"'),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}, 'HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="30"'),
    ({"FERROVOD_STALL_CHECK_TIME_SECONDS": "10", "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10"},
     'FERROVOD_STALL_SHUTDOWN_TIME_SECONDS="10"'),
    (dict(_RANK1_OF_2, FERROVOD_RENDEZVOUS_ADDR="nohost:notaport"),
     'FERROVOD_RENDEZVOUS_ADDR="nohost:notaport"'),
    (dict(_RANK1_OF_2, FERROVOD_RENDEZVOUS_ADDR="1.2.3.4"), 'FERROVOD_RENDEZVOUS_ADDR="1.2.3.4"'),
    (dict(_RANK1_OF_2, FERROVOD_RENDEZVOUS_ADDR=":99999"), 'FERROVOD_RENDEZVOUS_ADDR=":99999"'),
], ids=["timeout-0", "timeout-negative", "stall-shutdown-below-default-check",
        "stall-shutdown-equal-check", "addr-no-port-number", "addr-no-port", "addr-no-host"])
def test_bad_settings_are_refused_by_init_at_once(env, named):
    """A setting that cannot work is an InvalidArgumentError (a ValueError) naming the variable
    and its value, raised by init() at once: not taken as something else (a 0 timeout as 1 ms),
    not ignored (a stall shutdown that would never act), not retried for the whole start
    timeout (an address that is not host:port)."""
    res = run_plain("init_error_worker.py", env=env, timeout=40)
    got = [m for m in (re.match(r"INIT-ERROR (\S+) ([\d.]+) (.*)", ln) for ln in res.ranks[0]) if m]
    assert got, f"init() accepted {env}\n{describe(res)}"
    cls, elapsed, msg = got[0].group(1), float(got[0].group(2)), got[0].group(3)
    assert cls == "InvalidArgumentError", f"{cls}: {msg}"
    assert named in msg, f"the message does not name {named}: {msg}"
    assert elapsed < 3, f"init() took {elapsed} s to refuse {env}"


def test_forked_child_gets_not_initialized_and_parent_goes_on():
    res = run_job(2, "errors_worker.py", "fork", timeout=60)
    assert_ok(res, 2, min_checks=6)


def test_stopped_rank_times_out_instead_of_hanging():
    """A peer frozen (SIGSTOP) in the middle of a transfer: FerrovodTimeoutError after the timeout."""
    res = run_job(3, "errors_worker.py", "stall", env={"FERROVOD_TIMEOUT_SECONDS": 2}, timeout=45)
    for r in (0, 2):
        got = lines_matching(res, r, r"^STALLED (\w+) elapsed=([\d.]+)")
        assert got, f"rank {r} did not report an error for the stopped rank\n{describe(res)}"
        cls, elapsed = got[0].group(1), float(got[0].group(2))
        # rank 0 kills the stopped rank after its own error, so rank 2 may see that death first
        allowed = ("FerrovodTimeoutError",) if r == 0 else ("FerrovodTimeoutError", "RankFailureError")
        assert cls in allowed, f"rank {r} raised {cls}\n{describe(res)}"
        assert elapsed < 2 + 8, f"rank {r} needed {elapsed} s with FERROVOD_TIMEOUT_SECONDS=2"
