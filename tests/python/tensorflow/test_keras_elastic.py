"""Elastic Keras 3 and TensorFlow training through the real launcher (keras_elastic_worker.py,
tf_elastic_worker.py, tf1_elastic_worker.py): in one job per worker, two workers join (their
Adam has no slots yet and must receive rank 0's) and then one of them is lost mid-epoch, and
every rank ends with identical weights and optimizer state, every committed batch trained
once, equal to a one-process replay where the batches allow one."""

import sys
from pathlib import Path

import pytest

from conftest import _env, _run, describe, lines_matching

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent
# One job per worker: two join (their Adam has no slots and must receive rank 0's), then one of
# them is SIGKILLed and the survivors go back to the last commit, its host leaving: 2, 4, 2.
SCENARIOS = pytest.mark.parametrize("scenario,hosts,np_,final", [
    ("add-kill", "localhost:2\n", 2, 2),
])


def _assert_joined_then_lost(res):
    """Rank 0 trained at 2 workers, at 4 once two joined, and at 2 again once one was killed
    (a restart of its training function for each membership)."""
    sizes = [int(m.group(1)) for m in lines_matching(res, 0, r"^size (\d+) ")]
    assert sizes == [2, 4, 2], f"rank 0's memberships: {sizes}\n{describe(res)}"


def _elastic_job(tmp_path, worker, scenario, hosts, np_, env=None):
    """``worker`` (a file here) as an elastic job of ``np_`` workers on 2 to 4 slots whose
    discovery script lists ``hosts`` (the worker rewrites the file to add a host)."""
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text(hosts)
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(np_), "--min-np", "2",
           "--max-np", "4", "--host-discovery-script", f"cat {hosts_file}", sys.executable,
           str(HERE / worker), scenario, str(hosts_file)]
    return _run(cmd, _env(env), 240)


@SCENARIOS
def test_keras_elastic(tmp_path, scenario, hosts, np_, final):
    res = _elastic_job(tmp_path, "keras_elastic_worker.py", scenario, hosts, np_,
                      {"KERAS_BACKEND": "tensorflow"})
    assert res.returncode == 0, describe(res)
    done = [r for r in res.ranks if lines_matching(res, r, rf"^DONE size {final} ")]
    assert len(done) == final, describe(res)
    _assert_joined_then_lost(res)


def test_keras_elastic_example_trains(tmp_path):
    hosts_file = tmp_path / "hosts"
    hosts_file.write_text("localhost:2\n")
    example = HERE.parent.parent.parent / "examples" / "elastic" / "keras_digits_elastic.py"
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", "2", "--min-np", "2",
           "--host-discovery-script", f"cat {hosts_file}", sys.executable, str(example)]
    res = _run(cmd, _env({"KERAS_BACKEND": "tensorflow"}), 240)
    assert res.returncode == 0, describe(res)
    acc = lines_matching(res, 0, r"^test accuracy: ([\d.]+)%")
    assert acc and float(acc[0].group(1)) >= 90.0, describe(res)


@SCENARIOS
def test_tensorflow_custom_loop_elastic(tmp_path, scenario, hosts, np_, final):
    """tf.function steps through DistributedGradientTape with TensorFlowKerasState: two
    workers join mid-run and receive the model and Adam's slots and step count, then one of
    them is SIGKILLed and the survivors go back to the last commit. Every rank ends equal to
    a one-process replay of the same batches."""
    res = _elastic_job(tmp_path, "tf_elastic_worker.py", scenario, hosts, np_)
    assert res.returncode == 0, describe(res)
    done = [r for r in res.ranks
            if lines_matching(res, r, rf"^DONE size {final} rank \d iterations 24$")]
    assert len(done) == final, describe(res)
    _assert_joined_then_lost(res)
    assert "AutoGraph could not transform" not in res.stdout + res.stderr, describe(res)


@SCENARIOS
def test_tensorflow1_session_elastic(tmp_path, scenario, hosts, np_, final):
    """TF1 graph mode: TensorFlowState over a session, a DistributedOptimizer's allreduce
    inside session.run (a lost peer surfaces there as tf.errors.UnknownError). Every rank
    ends equal to a NumPy replay of the same steps."""
    res = _elastic_job(tmp_path, "tf1_elastic_worker.py", scenario, hosts, np_)
    assert res.returncode == 0, describe(res)
    done = [r for r in res.ranks if lines_matching(res, r, rf"^DONE size {final} rank \d step 24$")]
    assert len(done) == final, describe(res)
    _assert_joined_then_lost(res)
