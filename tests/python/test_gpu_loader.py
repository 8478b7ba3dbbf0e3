"""The run-time search for NCCL and the CUDA driver: real libraries, real failures.

Nothing GPU-related is linked into the build; `ferrovod.gpu_libraries()` (and
`ferrovodrun --check-build`) report what `dlopen` found. These run on a machine without a GPU:
the NCCL that torch's wheels install must be found and its version read, a missing or foreign
or too-old library must be described (never crash the process), and the CUDA driver's absence
must be reported as such. A 3-rank job agrees on a real NCCL unique id through its rendezvous
store.
"""

import importlib.metadata
import json
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import assert_ok, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

PROBE = "import ferrovod, json; print(json.dumps(ferrovod.gpu_libraries()))"


def _probe(env_extra, monkeypatch):
    for k, v in env_extra.items():
        monkeypatch.setenv(k, v)
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _nccl_wheel_version():
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("nvidia-nccl"):
            return dist.version
    return None


def test_nccl_from_torchs_wheel_is_found_with_its_version(monkeypatch):
    monkeypatch.delenv("FERROVOD_NCCL_LIBRARY", raising=False)
    wheel = _nccl_wheel_version()
    assert wheel is not None, "the test set-up installs torch, whose wheels bring nvidia-nccl"
    nccl = _probe({}, monkeypatch)["nccl"]
    assert nccl["found"], nccl
    # The wheel's version (e.g. 2.30.7) is what the library itself reports.
    assert wheel.startswith(nccl["version"]), (wheel, nccl)
    assert nccl["path"].endswith("libnccl.so.2")


def test_missing_explicit_library_is_described(monkeypatch):
    nccl = _probe({"FERROVOD_NCCL_LIBRARY": "/nonexistent/dir/libnccl.so.2"}, monkeypatch)["nccl"]
    assert not nccl["found"]
    assert "FERROVOD_NCCL_LIBRARY" in nccl["reason"] and "No such file" in nccl["reason"], nccl


def test_a_library_that_is_not_nccl_is_refused(monkeypatch):
    nccl = _probe({"FERROVOD_NCCL_LIBRARY": "libm.so.6"}, monkeypatch)["nccl"]
    assert not nccl["found"] and "not an NCCL library" in nccl["reason"], nccl


@pytest.mark.parametrize("code,expect", [(2708, None), (21100, None), (21900, "2.19.0")])
def test_version_gate_on_a_built_stand_in_library(tmp_path, monkeypatch, code, expect):
    """A real shared library exporting ncclGetVersion, built here with the C compiler the
    Rust toolchain links with: the loader reads the version it reports and refuses < 2.12."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler comes with the Rust toolchain's linker"
    src = tmp_path / "nccl.c"
    src.write_text(textwrap.dedent(f"""
        int ncclGetVersion(int *v) {{ *v = {code}; return 0; }}
    """))
    lib = tmp_path / "libnccl.so.2"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    nccl = _probe({"FERROVOD_NCCL_LIBRARY": str(lib)}, monkeypatch)["nccl"]
    if expect is None:
        assert not nccl["found"] and "older than the 2.12.0" in nccl["reason"], nccl
    else:
        assert nccl["found"] and nccl["version"] == expect and nccl["code"] == code, nccl


def test_no_cuda_driver_is_reported_and_check_build_still_works(monkeypatch):
    cuda = _probe({}, monkeypatch)["cuda"]
    has_driver = any((pathlib.Path(d) / "libcuda.so.1").exists()
                     for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"))
    if has_driver:
        assert cuda["found"] or "CUresult" in cuda["reason"], cuda
    else:
        assert not cuda["found"] and "libcuda.so.1" in cuda["reason"], cuda
    out = subprocess.run([sys.executable, "-m", "ferrovod.runner", "--check-build"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "GPU libraries (looked for at run time):" in out.stdout
    assert "CUDA driver" in out.stdout
    if not cuda["found"]:
        assert "CUDA tensors are staged through host memory here" in out.stdout, out.stdout


def test_import_and_init_load_no_gpu_library(monkeypatch):
    """Nothing is loaded unless asked: a CPU job never maps libnccl or libcuda."""
    code = ("import ferrovod; ferrovod.init(); import numpy as np; ferrovod.allreduce(np.ones(3)); "
            "maps = open('/proc/self/maps').read(); "
            "print('libnccl' in maps, 'libcuda' in maps)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout


def test_ranks_agree_on_an_nccl_unique_id_through_the_rendezvous_store():
    """The exchange the engine runs before creating an NCCL communicator, on 3 real ranks: the
    set's first rank generates the id with the wheel's NCCL, the others fetch it from the job's
    store; ferrovod's allgather of the bytes shows every member holds it (see the worker)."""
    res = run_job(3, "nccl_worker.py", timeout=120)
    assert_ok(res, 3, min_checks=8, same_count=False)


def test_nccl_dispatch_is_on_by_default_and_the_machine_is_asked_first(monkeypatch):
    """On by default (the device path ran on GPU hardware: scripts/gpu_tests.sh);
    FERROVOD_NCCL_DISPATCH=0 turns it off, and where CUDA is missing the answer still says what
    the machine lacks. Off, a machine with CUDA still takes CUDA tensors into the engine, which
    stages them."""
    code = ("import ferrovod, json; from ferrovod import _build_info, _core; "
            "i = _core.build_info(); "
            "print(json.dumps([i['device_dispatch'], i['gpu_operations'], ferrovod.nccl_built(), "
            "_core.device_path(_build_info._nccl_wheel_dirs())]))")

    def ask(value):
        if value is None:
            monkeypatch.delenv("FERROVOD_NCCL_DISPATCH", raising=False)
        else:
            monkeypatch.setenv("FERROVOD_NCCL_DISPATCH", value)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    found = _probe({}, monkeypatch)
    nccl, cuda = found["nccl"], found["cuda"]
    off_dispatch, off_ops, off_built, (off_usable, off_why) = ask("0")
    assert (off_dispatch, off_ops, off_built) == (False, [], 0)
    for value in (None, "1"):
        on_dispatch, on_ops, on_built, (on_usable, on_why) = ask(value)
        assert (on_dispatch, on_ops) == (True, ["nccl"]), value
        assert on_built == (nccl["code"] if nccl["found"] else 0)
    if not cuda["found"]:
        # No driver here: both answers name that, not the setting.
        assert not on_usable and not off_usable
        assert "CUDA cannot be used" in on_why and "CUDA cannot be used" in off_why
    else:
        assert on_usable and off_usable, (on_why, off_why)
        assert "FERROVOD_NCCL_DISPATCH is 0" in off_why and "stages" in off_why, off_why
