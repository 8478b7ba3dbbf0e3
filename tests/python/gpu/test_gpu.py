"""CUDA tensors through ferrovod.torch on a real GPU (scripts/gpu_tests.sh runs this on a GPU
machine; elsewhere every test here is skipped, saying so).

- one rank over NCCL: every op, dtype and shape of torch_ops_worker.py on CUDA tensors, and
  gpu_worker.py's process-set, optimizer and stream-ordering checks, with NCCL asked for;
- two ranks on one GPU over the staged path: the same, NCCL not asked for;
- two ranks on one GPU with NCCL asked for: NCCL cannot take two ranks of one device, so the
  engine says so once and stages those sets' ops; one-rank sets still run on NCCL;
- a rank killed in the middle of CUDA allreduces: the survivor raises within bounded time;
- 2 and 4 ranks sharing the GPU with FERROVOD_NCCL_SHARED_GPU=1: every op over NCCL (each rank
  a host of its own to NCCL, joined through its socket transport on the loopback), a killed
  rank, and an elastic job that loses a rank and rebuilds its communicators;
- FERROVOD_HIERARCHICAL_ALLREDUCE=1 on 2 simulated hosts (2+2 and 2+1 ranks): allreduces
  through NCCL inside each host and the engine's TCP collectives across;
- torch.distributed's backend "ferrovod" on CUDA tensors (pg_cuda_worker.py), staged and on
  NCCL: its collectives against host references, DDP equal to one process on the whole batch.
"""

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import _env, _run, assert_ok, describe, lines_matching, run_job

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU on this machine: scripts/gpu_tests.sh runs these tests on one",
                allow_module_level=True)

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

# Ranks sharing the one GPU on NCCL: NCCL's socket transport joins them over the loopback.
SHARED_NCCL = {"FERROVOD_NCCL_DISPATCH": "1", "FERROVOD_NCCL_SHARED_GPU": "1",
               "NCCL_SOCKET_IFNAME": "lo"}

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


@pytest.mark.parametrize("n", [2, 4])
def test_ranks_sharing_the_gpu_run_every_op_on_nccl_when_they_opt_in(n):
    env = {**SHARED_NCCL, "GPU_EXPECT_NCCL": "1"}
    res = run_job(n, HERE / "gpu_worker.py", "ops", env=env, timeout=600)
    assert_ok(res, n, min_checks=300)
    # Sets are not staged; ops NCCL cannot do alone (an uneven reducescatter) still may be.
    text = res.stdout + res.stderr
    assert "CUDA tensors are staged" not in text and "share one GPU" not in text, describe(res)
    if n == 2:
        res = run_job(n, OPS_WORKER, 43, "cuda", env=env, timeout=600)
        assert_ok(res, n, min_checks=1000)


@pytest.mark.parametrize("hosts,shape", [("localhost:2,127.0.0.1:2", "2-D"),
                                         ("localhost:2,127.0.0.1:1", "through each host's")])
def test_hierarchical_allreduce_nccl_inside_hosts_tcp_across(hosts, shape):
    """FERROVOD_HIERARCHICAL_ALLREDUCE=1 on ranks of 2 simulated hosts (host names the
    launcher tells apart on this one machine): CUDA allreduces reduce inside each host over
    NCCL and across hosts over the engine's TCP connections, every op, dtype, scaling and
    grouping of gpu_worker.py against host references; 2+2 ranks take the 2-D shape, 2+1 the
    one through each host's first rank."""
    n = sum(int(h.split(":")[1]) for h in hosts.split(","))
    env = {**SHARED_NCCL, "GPU_EXPECT_NCCL": "1", "FERROVOD_HIERARCHICAL_ALLREDUCE": "1",
           "FERROVOD_LOG_LEVEL": "info"}
    res = run_job(n, HERE / "gpu_worker.py", "ops", env=env, timeout=600,
                  launcher_args=("-H", hosts))
    assert_ok(res, n, min_checks=300)
    told = re.findall(r"CUDA allreduces are hierarchical: NCCL inside each host .*\(([^)]*)\)$",
                      res.stderr, re.M)
    assert len(told) == n and all(t.startswith(shape) for t in told), describe(res)


def test_a_killed_peer_on_shared_gpu_nccl_is_an_error_in_bounded_time():
    env = {**SHARED_NCCL, "FERROVOD_TIMEOUT_SECONDS": "30"}
    res = run_job(2, HERE / "gpu_worker.py", "kill", env=env, timeout=120)
    assert res.returncode != 0, describe(res)
    got = lines_matching(res, 0, r"^RANKFAIL elapsed=([\d.]+)")
    assert got, f"rank 0 did not raise\n{describe(res)}"
    assert float(got[0].group(1)) < 20.0, describe(res)


def test_an_elastic_job_on_nccl_loses_a_rank_and_rebuilds_its_communicators(tmp_path):
    """torch/elastic_worker.py with its model on the GPU: one of 4 ranks (2 hosts of 2 on this
    machine) SIGKILLs itself mid-epoch; the 2 survivors re-form, create new communicators and
    train on, every sample trained once, weights equal to a one-process replay."""
    worker = HERE.parent / "torch" / "elastic_worker.py"
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("localhost:2\n127.0.0.1:2\n")
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", "4",
           "--host-discovery-script", f"cat {hosts_file}", "--min-np", "2",
           "--elastic-timeout", "30",
           sys.executable, str(worker), "kill", str(hosts_file), str(tmp_path)]
    res = _run(cmd, _env({**SHARED_NCCL, "ELASTIC_DEVICE": "cuda"}), 240)
    assert res.returncode == 0, describe(res)
    got = json.loads((tmp_path / "result.json").read_text())
    assert got["size"] == 2 and got["resets"] == 1, got
    text = res.stdout + res.stderr
    assert "CUDA tensors are staged" not in text and "share one GPU" not in text, describe(res)


PG_WORKER = HERE / "pg_cuda_worker.py"


@pytest.mark.parametrize("nccl", [False, True], ids=["staged", "shared-gpu-nccl"])
def test_the_torch_distributed_backend_runs_cuda_tensors_and_ddp(nccl):
    """torch.distributed's backend "ferrovod" with CUDA tensors, 2 ranks on the one GPU: its
    collectives against host references, and DDP on the GPU equal to one process on the whole
    batch; staged through host memory, or on NCCL when the ranks opt in to sharing the GPU."""
    env = {**SHARED_NCCL} if nccl else {"FERROVOD_NCCL_DISPATCH": "0"}
    res = run_job(2, PG_WORKER, env=env, timeout=600)
    assert_ok(res, 2, min_checks=150)
    if nccl:
        text = res.stdout + res.stderr
        assert "CUDA tensors are staged" not in text and "share one GPU" not in text, describe(res)
