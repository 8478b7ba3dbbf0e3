"""ferrovod.mxnet with the real MXNet 1.9.1, in the interpreter of .venv-mxnet (MXNet needs
NumPy < 1.24; `make test` creates it with scripts/setup_mxnet_venv.sh), through the real
launcher: the ops, optimizer, trainer and KVStore on 1 to 3 ranks (see mxnet_worker.py), and
examples/mxnet_digits.py on 1, 2 and 4 ranks."""

import re
import sys
from pathlib import Path

import pytest

from conftest import _env, _run, assert_ok, describe

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MXPY = REPO / ".venv-mxnet" / "bin" / "python"


def mxnet_job(n, *args, timeout=300):
    if not MXPY.exists():
        pytest.fail(f"{MXPY} is missing: run scripts/setup_mxnet_venv.sh (make test does)",
                    pytrace=False)
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(n), str(MXPY),
           str(HERE / "mxnet_worker.py"), *[str(a) for a in args]]
    return _run(cmd, _env(None), timeout)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mxnet_ops_optimizer_and_trainer(n):
    res = mxnet_job(n, 80 + n)
    # the members of a process set run its checks, the others not
    assert_ok(res, n, min_checks=500, same_count=False)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mxnet_digits_example_reaches_95_percent(n, tmp_path):
    ckpt = tmp_path / "digits.params"
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(n), str(MXPY),
           str(REPO / "examples" / "mxnet_digits.py"), "--checkpoint", str(ckpt)]
    if not MXPY.exists():
        pytest.fail(f"{MXPY} is missing: run scripts/setup_mxnet_venv.sh (make test does)",
                    pytrace=False)
    res = _run(cmd, _env(None), 300)
    assert res.returncode == 0, describe(res)
    got = re.findall(r"test accuracy: ([\d.]+)%", res.stdout)
    assert got, describe(res)
    assert float(got[-1]) >= 95.0, describe(res)
    assert f"ranks: {n} " in res.stdout, describe(res)
    assert ckpt.stat().st_size > 0, "rank 0 wrote no checkpoint"
