"""ferrovod.torch and the engine's NCCL path on a machine without a GPU: the path says why it
cannot be used, CUDA submissions fail promptly and alike on every rank, host/CUDA disagreement
is a mismatch, and host ops go on (see torch_device_worker.py). The collectives on a GPU are
tests/nccl_backend.rs's, on a machine that has one."""

from pathlib import Path

import pytest

from conftest import assert_ok, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent


def test_cuda_submissions_without_a_gpu_fail_alike_and_host_ops_go_on():
    res = run_job(3, HERE / "torch_device_worker.py", timeout=120,
                  env={"FERROVOD_TIMEOUT_SECONDS": "20"})
    assert_ok(res, 3, min_checks=12)
