"""ferrovod.torch: every op and dtype, and every collective's gradient, against NumPy
references, in real launched jobs (see torch_ops_worker.py)."""

from pathlib import Path

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent
SECTIONS = ["allreduce", "grouped", "allgather", "broadcast", "alltoall", "reducescatter",
            "inplace", "misc", "autograd"]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_torch_ops_and_gradients(n):
    res = run_job(n, HERE / "torch_ops_worker.py", 20 + n, timeout=180)
    counts = assert_ok(res, n, min_checks=2800)
    for r in range(n):
        done = [m.group(1) for m in lines_matching(res, r, r"^section (\w+):")]
        assert done == SECTIONS, f"rank {r} ran sections {done}\n{describe(res)}"
    print(f"{n} ranks: {counts[0]} checks per rank in {res.elapsed:.1f} s")
