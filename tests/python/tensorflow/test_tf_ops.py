"""ferrovod.tensorflow: every op and dtype, every collective's gradient and
DistributedGradientTape against NumPy references, eagerly, inside tf.function and in TF1
sessions, plus Horovod's helper names and hvd.elastic, in real launched jobs (see
tf_ops_worker.py); ranks that disagree get Horovod's TensorFlow error classes with a clear
message, not a hang (tf_mismatch_worker.py).

Each job imports TensorFlow in every rank (several seconds of CPU each), so the checks are
grouped into few jobs."""

from pathlib import Path

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent
SECTIONS = ["allreduce", "grouped", "allgather", "broadcast", "alltoall", "reducescatter",
            "misc", "gradients", "tape", "optimizer", "syncbn", "psets", "tf1", "elastic"]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tf_ops_and_gradients(n):
    res = run_job(n, HERE / "tf_ops_worker.py", 60 + n, timeout=180)
    counts = assert_ok(res, n, min_checks=1900, same_count=False)
    for r in range(n):
        done = [m.group(1) for m in lines_matching(res, r, r"^section (\w+):")]
        assert done == SECTIONS, f"rank {r} ran sections {done}\n{describe(res)}"
    print(f"{n} ranks: {counts} checks per rank in {res.elapsed:.1f} s")


def test_disagreeing_ranks_fail_clearly_everywhere():
    res = run_job(3, HERE / "tf_mismatch_worker.py", timeout=90,
                  env={"FERROVOD_TIMEOUT_SECONDS": "30"})
    assert_ok(res, 3, min_checks=40)
    assert res.elapsed < 45, f"took {res.elapsed:.1f} s: looks like a hang\n{describe(res)}"
    for r in range(3):
        for mode in ("eager", "graph", "tf1"):
            for what in ("shape", "dtype", "broadcast_variables count", "tape count", "refused dtype",
                         "refused scalar", "refused root", "refused reducescatter op",
                         "refused alltoall dtype", "refused unnamed"):
                found = lines_matching(res, r, rf"^error {mode} {what}: (.*)")
                assert found, f"rank {r}: no {mode} {what} error\n{describe(res)}"
    shape = lines_matching(res, 0, r"^error graph shape: (.*)")[0].group(1)
    assert "rank 2 sent [4]" in shape and "mm.shape" in shape, shape
    count = lines_matching(res, 1, r"^error eager broadcast_variables count: (.*)")[0].group(1)
    assert "rank 2 has 3 variables" in count, count
