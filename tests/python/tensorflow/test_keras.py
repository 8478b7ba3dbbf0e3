"""ferrovod's Keras adapter (``ferrovod.tensorflow.keras`` / ``ferrovod.keras``) in real
2-rank jobs, on Keras 3's TensorFlow and torch backends and on Keras 2 (``tf_keras`` with
``TF_USE_LEGACY_KERAS=1``) (see keras_train_worker.py): fit with
sharded data == one process on the global batch, metric averaging, the warm-up schedule batch
by batch, backward_passes_per_step, optimizer options, sparse gradients, load_model round
trip, jit_compile=True and mismatched models failing clearly; and the digits example."""

from pathlib import Path

import pytest

from conftest import assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent.parent.parent / "examples" / "keras_digits.py"
SECTIONS = {
    "tensorflow": ["fit", "warmup", "bpps", "options", "sparse", "jit", "ops", "mismatch"],
    "torch": ["fit", "warmup", "bpps", "options", "sparse", "ops", "mismatch"],
    "keras2": ["fit", "warmup", "bpps", "options", "sparse", "jit", "ops", "keras2", "mismatch"],
}
ENV = {
    "tensorflow": {"KERAS_BACKEND": "tensorflow", "TF_USE_LEGACY_KERAS": "0"},
    "torch": {"KERAS_BACKEND": "torch", "TF_USE_LEGACY_KERAS": "0"},
    "keras2": {"TF_USE_LEGACY_KERAS": "1"},
}


@pytest.mark.parametrize("backend", ["tensorflow", "torch", "keras2"])
def test_keras_adapter(backend, tmp_path):
    res = run_job(2, HERE / "keras_train_worker.py", 7, tmp_path, timeout=240,
                  env={**ENV[backend], "FERROVOD_TIMEOUT_SECONDS": "60"})
    counts = assert_ok(res, 2, min_checks=200)
    for r in range(2):
        done = [m.group(1) for m in lines_matching(res, r, r"^section (\w+):")]
        assert done == SECTIONS[backend], f"rank {r} ran sections {done}\n{describe(res)}"
        err = lines_matching(res, r, r"^error: (.*)")
        assert err and "rank 0" in err[0].group(1) and "rank 1" in err[0].group(1), describe(res)
    print(f"{backend}: {counts[0]} checks per rank in {res.elapsed:.1f} s")


def test_keras2_in_a_v1_graph():
    """Keras 2 with eager execution disabled (TF1-style code): see keras2_graph_worker.py."""
    res = run_job(2, HERE / "keras2_graph_worker.py", 11, timeout=180,
                  env={"TF_USE_LEGACY_KERAS": "1", "FERROVOD_TIMEOUT_SECONDS": "60"})
    assert_ok(res, 2, min_checks=5)


def test_keras_digits_example_reaches_95_percent(tmp_path):
    ckpt, log = tmp_path / "digits.keras", tmp_path / "digits.csv"
    res = run_job(2, EXAMPLE, "--checkpoint", ckpt, "--csv", log, timeout=180)
    assert res.returncode == 0, describe(res)
    acc = lines_matching(res, 0, r"^test accuracy: ([\d.]+)%")
    assert acc, f"no accuracy line\n{describe(res)}"
    assert float(acc[-1].group(1)) >= 95.0, describe(res)
    assert not lines_matching(res, 1, r"accuracy"), "only rank 0 prints"
    assert ckpt.exists() and log.exists(), "rank 0 wrote no checkpoint or log"
    rows = log.read_text().strip().splitlines()
    assert len(rows) == 21 and "lr" in rows[0], f"CSV log: {rows[:2]}"
    print(f"example: {acc[-1].group(1)}% in {res.elapsed:.1f} s")
