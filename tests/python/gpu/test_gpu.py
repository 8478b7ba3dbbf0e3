"""CUDA tensors through ferrovod.torch on a real GPU (scripts/gpu_tests.sh runs this on a GPU
machine; elsewhere every test here is skipped, saying so).

- one rank over NCCL: every op, dtype and shape of torch_ops_worker.py on CUDA tensors, and
  gpu_worker.py's process-set, optimizer and stream-ordering checks, with NCCL asked for;
- two ranks on one GPU over the staged path: the same, NCCL not asked for;
- two ranks on one GPU with NCCL asked for: NCCL cannot take two ranks of one device, so the
  engine says so once and stages those sets' ops; one-rank sets still run on NCCL;
- a rank killed in the middle of CUDA allreduces: the survivor raises within bounded time.
"""

import re
from pathlib import Path

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: scripts/gpu_tests.sh runs these tests on one",
                allow_module_level=True)

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent
OPS_WORKER = HERE.parent / "torch" / "torch_ops_worker.py"


def path_line(res, rank):
    got = lines_matching(res, rank, r"^PATH (.*)")
    assert got, describe(res)
    return got[0].group(1)


def test_one_rank_every_op_over_nccl():
    env = {"FERROVOD_NCCL_DISPATCH": "1", "GPU_EXPECT_NCCL": "1"}
    res = run_job(1, OPS_WORKER, 41, "cuda", env=env, timeout=600)
    assert_ok(res, 1, min_checks=1000)
    res = run_job(1, HERE / "gpu_worker.py", "ops", env=env, timeout=600)
    assert_ok(res, 1, min_checks=300)
    assert "usable=True" in path_line(res, 0), describe(res)


def test_two_ranks_on_one_gpu_staged():
    env = {"FERROVOD_NCCL_DISPATCH": "0"}
    res = run_job(2, OPS_WORKER, 42, "cuda", env=env, timeout=600)
    assert_ok(res, 2, min_checks=1000)
    res = run_job(2, HERE / "gpu_worker.py", "ops", env=env, timeout=600)
    assert_ok(res, 2, min_checks=300)


def test_two_ranks_sharing_a_gpu_with_nccl_asked_for_are_told_and_staged():
    env = {"FERROVOD_NCCL_DISPATCH": "1"}
    res = run_job(2, HERE / "gpu_worker.py", "ops", env=env, timeout=600)
    assert_ok(res, 2, min_checks=300)
    text = res.stdout + res.stderr
    assert re.search(r"share.*GPU|same GPU|one GPU", text), describe(res)


def test_a_killed_peer_on_the_staged_path_is_an_error_in_bounded_time():
    res = run_job(2, HERE / "gpu_worker.py", "kill", env={"FERROVOD_TIMEOUT_SECONDS": "30"},
                  timeout=120)
    assert res.returncode != 0, describe(res)
    got = lines_matching(res, 0, r"^RANKFAIL elapsed=([\d.]+)")
    assert got, f"rank 0 did not raise\n{describe(res)}"
    assert float(got[0].group(1)) < 10.0, describe(res)
