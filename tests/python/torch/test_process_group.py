"""torch.distributed's ``backend="ferrovod"`` (ferrovod/torch/process_group.py), in jobs that
torchrun starts as users do (``--standalone``: torchrun binds its own free port): every
collective torch's process group offers, against NumPy references and against a gloo group
over the same ranks in the same processes, over several dtypes, shapes, odd sizes and reduce
ops; DDP (buckets, unused parameters, no_sync, static graph) and its communication hooks
(fp16, bf16, PowerSGD) equal to DDP on gloo; destroy_process_group and a new
init_process_group in the same processes. See pg_worker.py."""

import re
import sys
from pathlib import Path

import pytest

from conftest import _env, _run, describe

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent


def torchrun(n, *args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", str(HERE / "pg_worker.py"), *[str(a) for a in args]]
    return _run(cmd, _env({"OMP_NUM_THREADS": "1"}, plain=True), timeout)


def checks(res, n):
    """``{rank: checks}`` from every rank's ``rank <r> OK <checks>`` line."""
    found = {int(m.group(1)): int(m.group(2))
             for m in re.finditer(r"^rank (\d+) OK (\d+)$", res.stdout, re.M)}
    assert res.returncode == 0 and sorted(found) == list(range(n)), describe(res)
    return found


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_numpy_and_gloo(n):
    found = checks(torchrun(n, "collectives", "objects"), n)
    assert min(found.values()) > 2000, found


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_and_its_hooks_match_gloo_and_a_group_starts_again(n):
    found = checks(torchrun(n, "ddp", "hooks", "lifecycle"), n)
    assert min(found.values()) > 1000, found
