"""ferrovod.tensorflow training: examples/tensorflow2_digits.py (a custom TF2 loop with
DistributedGradientTape inside tf.function and broadcast_variables after the first step)
reaches >= 95 % test accuracy on 2 ranks, and every rank ends with the same weights."""

from pathlib import Path

import pytest

from conftest import describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tensorflow2_digits.py"


def test_digits_example_trains_and_ranks_agree():
    n = 2
    res = run_job(n, EXAMPLE, "--print-digest", timeout=150)
    assert res.returncode == 0, describe(res)
    acc = lines_matching(res, 0, r"^test accuracy: ([\d.]+)%")
    assert acc, f"no accuracy line\n{describe(res)}"
    assert float(acc[-1].group(1)) >= 95.0, describe(res)
    assert not lines_matching(res, 1, r"accuracy"), "only rank 0 prints the accuracy"
    digests = {r: [m.group(1) for m in lines_matching(res, r, r"^weights digest: (\w+)")]
               for r in range(n)}
    assert all(len(d) == 1 for d in digests.values()), f"digests: {digests}\n{describe(res)}"
    assert len({d[0] for d in digests.values()}) == 1, f"ranks' weights differ: {digests}"
    print(f"{n} ranks: test accuracy {acc[-1].group(1)}% in {res.elapsed:.1f} s")
