"""FERROVOD_AUTOTUNE: the tuner walks its candidates, logs them, settles, and results stay
correct throughout."""

import csv

import pytest

from conftest import describe, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")


def test_autotune_settles_and_logs(tmp_path):
    log = tmp_path / "autotune.csv"
    res = run_job(2, "autotune_worker.py", timeout=120,
                  env={"FERROVOD_AUTOTUNE": "1", "FERROVOD_AUTOTUNE_LOG": str(log),
                       "FERROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                       "FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1"})
    assert res.returncode == 0, describe(res)
    rows = list(csv.reader(log.open()))
    assert rows[0] == ["stage", "cycle_time_ms", "fusion_threshold_bytes", "score_bytes_per_s"]
    fusion = {r[2] for r in rows if r[0] == "fusion"}
    cycles = {r[1] for r in rows if r[0] == "cycle"}
    assert len(fusion) == 5 and len(cycles) == 4, rows
    assert sum(1 for r in rows if r[0] == "best") == 1, rows


def test_explicit_settings_are_not_tuned(tmp_path):
    log = tmp_path / "autotune.csv"
    res = run_job(2, "autotune_worker.py", timeout=120,
                  env={"FERROVOD_AUTOTUNE": "1", "FERROVOD_AUTOTUNE_LOG": str(log),
                       "FERROVOD_AUTOTUNE_WARMUP_SAMPLES": "0",
                       "FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "1",
                       "FERROVOD_FUSION_THRESHOLD": "2097152"})
    assert res.returncode == 0, describe(res)
    rows = list(csv.reader(log.open()))
    assert not any(r[0] == "fusion" for r in rows), rows
    assert {r[2] for r in rows[1:]} == {"2097152"}, rows
