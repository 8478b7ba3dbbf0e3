"""ferrovod.torch training: DistributedOptimizer (overlap hooks, groups, backward passes,
compression, clipping, sparse gradients), broadcast helpers, SyncBatchNorm and process sets
against single-process torch on the global batch (see torch_train_worker.py); ranks that
wrap different parameters fail with a clear error instead of hanging."""

from pathlib import Path

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("n", [1, 2, 3])
def test_training_matches_single_process(n):
    """Both ways of submitting gradients (during backward, or all at step()), whichever this
    machine's cores would pick by themselves: with more than one rank, every section once
    with FERROVOD_OVERLAP=1 and once with 0, in one job (each rank starts torch once)."""
    sections = ["optimizer", "semantics", "sparse", "syncbn", "state", "sharded"]
    if n == 1:
        env, expect = None, sections
    else:
        env = {"OVERLAP_MODES": "1,0"}
        expect = [f"{s}@{m}" for m in "10" for s in sections] + ["psets@1", "psets@0"]
    res = run_job(n, HERE / "torch_train_worker.py", 40 + n, timeout=180, env=env)
    assert_ok(res, n, min_checks=50, same_count=False)
    for r in range(n):
        done = [m.group(1) for m in lines_matching(res, r, r"^section ([\w@]+):")]
        assert done == expect, f"rank {r} ran sections {done}\n{describe(res)}"


def test_different_parameters_fail_clearly():
    """A ValueError on every rank, not a hang, for an extra layer and then, in the same job, a
    layer of another width: the operation timeout (600 s) lies beyond the job's (120 s), so a
    job that waited for it fails, and its error would be another class."""
    kinds = ["extra", "shape"]
    res = run_job(3, HERE / "torch_mismatch_worker.py", *kinds, timeout=120,
                  env={"FERROVOD_TIMEOUT_SECONDS": "600"})
    assert_ok(res, 3, min_checks=2 * len(kinds))
    for kind in kinds:
        msgs = lines_matching(res, 0, rf"^error {kind}: (.*)")
        assert msgs and "first difference" in msgs[0].group(1), describe(res)


def test_digits_example_reaches_95_percent():
    example = HERE.parent.parent.parent / "examples" / "pytorch_digits.py"
    res = run_job(2, example, "--checkpoint", HERE / "_digits_checkpoint.pt", timeout=120)
    try:
        assert res.returncode == 0, describe(res)
        acc = lines_matching(res, 0, r"^test accuracy: ([\d.]+)%")
        assert acc, f"no accuracy line\n{describe(res)}"
        assert float(acc[-1].group(1)) >= 95.0, describe(res)
        assert not lines_matching(res, 1, r"accuracy"), "only rank 0 prints"
        assert (HERE / "_digits_checkpoint.pt").exists(), "rank 0 wrote no checkpoint"
        # The README's main job: a newcomer sees the training progress and the result only.
        assert "Warning" not in res.stderr, f"warnings in the example's output\n{describe(res)}"
    finally:
        (HERE / "_digits_checkpoint.pt").unlink(missing_ok=True)


@pytest.mark.parametrize("n,sections", [(2, "sharded"), (3, "optimizer,sharded")])
def test_flat_and_sharded_through_rings_without_host_memory(n, sections):
    """With shared memory off the flat gradient buffer is reduced by one in-place allreduce
    through the engine, and the sharded update reduce-scatters and allgathers through it (the
    paths ranks on several hosts take); the default runs above share host memory. Both in one
    job of 3 ranks, with every gradient submitted at step() (FERROVOD_OVERLAP=0), which the
    flat buffer needs and the sharded update always does."""
    res = run_job(n, HERE / "torch_train_worker.py", 60 + n, sections, timeout=180,
                  env={"FERROVOD_SHM_DISABLE": "1", "FERROVOD_OVERLAP": "0"})
    assert_ok(res, n, min_checks=50)
    for r in range(n):
        done = [m.group(1) for m in lines_matching(res, r, r"^section (\w+):")]
        assert done == sections.split(","), f"rank {r} ran sections {done}\n{describe(res)}"


@pytest.mark.parametrize("where", ["before_step", "after_reduce"])
def test_killed_rank_in_a_sharded_step_is_reported(where):
    """A rank SIGKILLed while the others wait in one of the sharded step's meetings: each
    survivor raises RankFailureError naming it, by the failure rather than the operation
    timeout, which (600 s) lies beyond the job's 120 s."""
    res = run_job(3, HERE / "torch_kill_worker.py", where, timeout=120,
                  env={"FERROVOD_TIMEOUT_SECONDS": "600"})
    assert res.returncode != 0, f"the launcher must fail when a rank was killed\n{describe(res)}"
    assert lines_matching(res, 1, r"^killing myself"), describe(res)
    for r in (0, 2):
        got = lines_matching(res, r, r"^RANKFAIL step=3 rank_attr=(\S+) elapsed=([\d.]+)")
        assert got, f"rank {r} did not report RankFailureError\n{describe(res)}"
        assert got[0].group(1) == "1", describe(res)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_adasum_optimizer_combines_every_ranks_delta(n):
    """DistributedOptimizer(op=Adasum), SGD with momentum and Adam: each rank's own step on its
    own batch, then the parameters equal to the start plus NumPy's Adasum of every rank's delta
    (the worker simulates every rank's optimizer as the reference); and in training, the sum
    of orthogonal steps and the average of equal ones."""
    res = run_job(n, HERE / "torch_adasum_worker.py", timeout=180)
    assert_ok(res, n, min_checks=34)


def test_adasum_on_three_ranks_fails_on_every_rank():
    res = run_job(3, HERE / "torch_adasum_worker.py", timeout=120)
    assert res.returncode != 0, describe(res)
    for r in range(3):
        assert lines_matching(res, r, r"Adasum needs a power-of-two number of ranks; the "
                                      r"process set has 3"), describe(res)
