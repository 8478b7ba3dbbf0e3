"""ferrovod.mxnet with the real MXNet 1.9.1, in the interpreter of .venv-mxnet (MXNet needs
NumPy < 1.24; `make test` creates it with scripts/setup_mxnet_venv.sh), through the real
launcher: the ops, optimizer, trainer and KVStore on 1 to 3 ranks (see mxnet_worker.py),
examples/mxnet_digits.py on 1, 2 and 4 ranks, and the same example started the way MXNet's
tools/launch.py starts a job (DMLC_* variables, a scheduler and a server besides the workers)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, _env, _run, assert_ok, describe, mxnet_python, reserved_port

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent


def mxnet_job(n, script, *args, timeout=300):
    """``script`` run on ``n`` ranks by ferrovodrun in MXNet's interpreter."""
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(n), mxnet_python(),
           str(script), *[str(a) for a in args]]
    return _run(cmd, _env(None), timeout)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_mxnet_ops_optimizer_and_trainer(n):
    res = mxnet_job(n, HERE / "mxnet_worker.py", 80 + n)
    # the members of a process set run its checks, the others not
    assert_ok(res, n, min_checks=500, same_count=False)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_mxnet_digits_example_reaches_95_percent(n, tmp_path):
    ckpt = tmp_path / "digits.params"
    res = mxnet_job(n, REPO / "examples" / "mxnet_digits.py", "--checkpoint", ckpt)
    assert res.returncode == 0, describe(res)
    got = re.findall(r"test accuracy: ([\d.]+)%", res.stdout)
    assert got, describe(res)
    assert float(got[-1]) >= 95.0, describe(res)
    assert f"ranks: {n} " in res.stdout, describe(res)
    assert ckpt.stat().st_size > 0, "rank 0 wrote no checkpoint"


def test_dmlc_workers_find_each_other_and_server_and_scheduler_exit():
    """What MXNet's tools/launch.py starts: a scheduler, a server and two workers, each with
    the DMLC_* variables only (tasks numbered by DMLC_TASK_ID), all running the same
    command and no ferrovod launcher: the workers train together, the others end at once,
    successfully, saying why."""
    port = reserved_port()
    common = {"DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
              "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "DMLC_JOB_CLUSTER": "local",
              "PYTHONUNBUFFERED": "1"}
    # tools/launch.py's local launcher numbers workers and then servers in DMLC_TASK_ID
    roles = [("scheduler", {}), ("server", {"DMLC_TASK_ID": "2"}),
             ("worker", {"DMLC_TASK_ID": "1"}), ("worker", {"DMLC_TASK_ID": "0"})]
    cmd = [mxnet_python(), str(REPO / "examples" / "mxnet_digits.py"), "--epochs", "3",
           "--checkpoint", "/dev/null"]
    procs = []
    for role, extra in roles:
        env = _env({**common, "DMLC_ROLE": role, **extra}, plain=True)
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for (role, _), p, (out, err) in zip(roles, procs, outs):
        assert p.returncode == 0, f"{role}: exit {p.returncode}\n{out[-3000:]}\n{err[-3000:]}"
        if role != "worker":
            assert f"is an MXNet {role}" in err and "need no" in err, err
            assert out == "", out
    assert "ranks: 2 " in outs[3][0], outs[3]


def test_a_half_set_dmlc_environment_is_a_clear_error():
    env = _env({"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_NUM_WORKER": "2"}, plain=True)
    res = subprocess.run([sys.executable, "-c", "import ferrovod; ferrovod.init()"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0, res
    assert "DMLC_PS_ROOT_PORT is missing" in res.stderr, res.stderr
