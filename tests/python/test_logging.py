"""FERROVOD_LOG_LEVEL: the engine's records reach Python's logging under `ferrovod`, with the
rank in every line; debug level names the launch environment and each data link as it is made."""

import pytest

from conftest import describe, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


def test_debug_level_names_launch_environment_and_transport_per_rank():
    res = run_job(2, "log_worker.py", env={"FERROVOD_LOG_LEVEL": "debug"}, timeout=60)
    assert res.returncode == 0, describe(res)
    for r in (0, 1):
        lines = [ln for ln in res.stderr.splitlines() if ln.startswith(f"[{r}]<stderr>:[")]
        text = "\n".join(lines)
        assert f"ferrovod rank {r}: DEBUG] rank {r}/2: launch environment: ferrovodrun" in text, \
            describe(res)
        assert f"ferrovod rank {r}: DEBUG] rank {r}: data link to rank {1 - r} made, over shared " \
            "memory" in text, describe(res)
    res = run_job(2, "log_worker.py", env={"FERROVOD_LOG_LEVEL": "debug",
                                          "FERROVOD_SHM_DISABLE": "1"}, timeout=60)
    assert res.returncode == 0, describe(res)
    assert "DEBUG] rank 0: data link to rank 1 made, over TCP" in res.stderr, describe(res)


def test_default_level_is_quiet_and_hide_time_drops_the_timestamp():
    res = run_job(2, "log_worker.py", timeout=60)
    assert res.returncode == 0, describe(res)
    assert "ferrovod rank" not in res.stderr, describe(res)
    res = run_job(2, "log_worker.py", env={"HOROVOD_LOG_LEVEL": "DEBUG",
                                          "FERROVOD_LOG_HIDE_TIME": "1"}, timeout=60)
    assert res.returncode == 0, describe(res)
    assert "[1]<stderr>:[ferrovod rank 1: DEBUG]" in res.stderr, describe(res)
