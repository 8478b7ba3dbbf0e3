"""``FERROVOD_AS_HOROVOD=1`` / ``ferrovodrun --as-horovod``: ``import horovod.X`` gives the module
``ferrovod.X`` itself, in real interpreters started the way users start them (the
``ferrovod_as_horovod.pth`` in site-packages does it at start-up; python/_ferrovod_as_horovod.py).
Without the variable nothing changes, a missing ``horovod.X`` says why, a real Horovod installed
beside ferrovod is left alone, and a Horovod training script runs unchanged on 2 ranks with the
result of single-process training. tests/python/test_wheel.py checks the same from the wheel.
"""

from __future__ import annotations

import os
import re
import site
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Optional

import pytest

from conftest import WORKERS, assert_ok, describe, lines_matching, run_job

pytestmark = pytest.mark.usefixtures("ferrovod_importable", "alias_pth_installed")

VAR = "FERROVOD_AS_HOROVOD"
PTH = "ferrovod_as_horovod.pth"
NOTICE = re.compile(r"FERROVOD_AS_HOROVOD is set but Horovod itself is installed at (\S+); "
                    r"leaving `import horovod` to it")


@pytest.fixture(scope="module")
def alias_pth_installed() -> None:
    """Fails (does not skip) when the test interpreter's site-packages lack the .pth: the alias
    would silently be off, and every test below would say so less clearly."""
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    if not any((Path(d) / PTH).is_file() for d in dirs):
        pytest.fail(f"{PTH} is not in {sys.executable}'s site-packages ({', '.join(dirs)}): "
                    "run scripts/setup_venv.sh (it copies it there after `maturin develop`)",
                    pytrace=False)


def python(code: str, value: Optional[str] = "1", extra: Optional[Dict[str, str]] = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter (the tests' own), with ``FERROVOD_AS_HOROVOD`` set
    to ``value`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != VAR}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if value is not None:
        env[VAR] = value
    env.update(extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=str(WORKERS))


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def real_horovod_on_path() -> Optional[str]:
    """A Horovod of its own that this interpreter would import, if any."""
    return ok(python("""
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec("horovod")
        print(spec.origin if spec is not None and spec.origin else "")
        """, value=None)).strip() or None


def test_frameworks_are_ferrovods_modules() -> None:
    """One interpreter for everything that imports TensorFlow and Keras (seconds each)."""
    out = ok(python("""
        import sys
        import horovod
        import ferrovod
        assert horovod is ferrovod and horovod.run is ferrovod.run
        assert sys.modules["horovod"] is sys.modules["ferrovod"]

        import horovod.torch as hvd
        import ferrovod.torch
        assert hvd is ferrovod.torch and hvd.__name__ == "ferrovod.torch"
        assert hvd.__spec__.name == "ferrovod.torch", hvd.__spec__
        assert sys.modules["horovod.torch"] is sys.modules["ferrovod.torch"]
        from horovod.torch import DistributedOptimizer
        assert DistributedOptimizer is ferrovod.torch.DistributedOptimizer
        import horovod.torch.elastic, ferrovod.torch.elastic
        assert horovod.torch.elastic is ferrovod.torch.elastic

        from horovod.common.util import split_list, env
        import ferrovod.common.util
        assert split_list is ferrovod.common.util.split_list
        assert sys.modules["horovod.common.util"] is ferrovod.common.util

        import horovod.runner, ferrovod.runner
        assert horovod.runner is ferrovod.runner and horovod.runner.run is ferrovod.run

        import horovod.tensorflow as htf
        import ferrovod.tensorflow
        assert htf is ferrovod.tensorflow
        import horovod.tensorflow.keras as htk
        import ferrovod.tensorflow.keras
        assert htk is ferrovod.tensorflow.keras
        import horovod.keras as hk
        import ferrovod.keras
        assert hk is ferrovod.keras
        assert sys.modules["horovod.tensorflow.keras"] is sys.modules["ferrovod.tensorflow.keras"]

        # Found (not imported: MXNet is not in this venv, Ray and Spark take seconds).
        import importlib.util
        for name in ("horovod.mxnet", "horovod.ray", "horovod.spark", "horovod.data"):
            spec = importlib.util.find_spec(name)
            assert spec is not None and spec.name == name, (name, spec)
        print("ALIAS-OK")
        """, timeout=240))
    assert "ALIAS-OK" in out


def test_start_up_imports_nothing_of_ferrovod() -> None:
    """Without the variable the helper module is not even imported; with it, only the helper
    is, and ferrovod waits for an ``import horovod``."""
    code = """
        import sys
        print(sorted(m for m in sys.modules if "ferrovod" in m or "horovod" in m))
        """
    assert ok(python(code, value=None)).strip() == "[]"
    for off in ("", "0", "false", "False"):
        assert ok(python(code, value=off)).strip() == "[]", off
    assert ok(python(code, value="1")).strip() == "['_ferrovod_as_horovod']"
    assert ok(python(code, value="yes")).strip() == "['_ferrovod_as_horovod']"


def test_without_the_variable_horovod_is_not_there() -> None:
    real = real_horovod_on_path()
    if real is not None:
        pytest.skip(f"Horovod itself is installed here ({real})")
    proc = python("""
        try:
            import horovod
        except ModuleNotFoundError as exc:
            print("MISSING", exc.name)
        """, value=None)
    assert ok(proc).strip() == "MISSING horovod"


def test_missing_submodule_says_why() -> None:
    out = ok(python("""
        for name in ("horovod.foo", "horovod.foo.bar", "horovod.common.nothere"):
            try:
                __import__(name)
            except ModuleNotFoundError as exc:
                print(f"{name}|{exc.name}|{exc}")
        try:
            from horovod.common import nothere
        except ImportError as exc:
            print(f"from|{type(exc).__name__}|{exc}")
        try:
            import horovodx
        except ModuleNotFoundError as exc:
            print(f"other|{exc}")
        """))
    lines = dict(line.split("|", 1) for line in out.splitlines())
    why = "FERROVOD_AS_HOROVOD maps horovod.* to ferrovod.*, and ferrovod has no"
    assert lines["horovod.foo"] == (
        f"horovod.foo|No module named 'horovod.foo': {why} 'ferrovod.foo'")
    # The first missing module is named, as Python names it.
    assert lines["horovod.foo.bar"] == lines["horovod.foo"]
    assert lines["horovod.common.nothere"] == (
        f"horovod.common.nothere|No module named 'horovod.common.nothere': {why} "
        "'ferrovod.common.nothere'")
    # `from package import name` still reports the missing name the usual way.
    assert lines["from"].startswith("ImportError|cannot import name 'nothere'"), lines["from"]
    assert lines["other"] == "No module named 'horovodx'"


def test_python_m_runs_ferrovods_module() -> None:
    env = {k: v for k, v in os.environ.items() if k != VAR}
    env[VAR] = "1"
    proc = subprocess.run([sys.executable, "-m", "horovod.runner.launch", "--version"],
                          capture_output=True, text=True, env=env, timeout=60)
    import ferrovod

    assert ok(proc).strip() == ferrovod.__version__


def test_real_horovod_is_left_alone(tmp_path: Path) -> None:
    """A distribution named horovod (a stand-in: its package and its dist-info) on PYTHONPATH
    is what ``import horovod`` gives, with one line on stderr saying why."""
    (tmp_path / "horovod").mkdir()
    (tmp_path / "horovod" / "__init__.py").write_text("FAKE = True\n")
    info = tmp_path / "horovod-0.28.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: horovod\nVersion: 0.28.1\n")
    path = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                        os.environ.get("PYTHONPATH")]))}
    code = """
        import importlib, importlib.metadata, importlib.util, sys
        import horovod
        assert horovod.FAKE and importlib.metadata.version("horovod") == "0.28.1"
        importlib.import_module("horovod")
        assert importlib.util.find_spec("horovod").origin == horovod.__file__
        import ferrovod
        assert sys.modules["horovod"] is not ferrovod
        print("FAKE-OK")
        """
    proc = python(code, extra=path)
    assert "FAKE-OK" in ok(proc)
    notices = NOTICE.findall(proc.stderr)
    assert notices == [str(tmp_path / "horovod")], proc.stderr
    # Without the variable: the same Horovod, and not a word.
    proc = python(code, value=None, extra=path)
    assert "FAKE-OK" in ok(proc) and proc.stderr == "", proc.stderr


def test_flag_reaches_local_and_ssh_workers() -> None:
    """``--as-horovod`` is in every worker's environment: the local ones' and the one the ssh
    session carries to a remote host's agent (nothing is started here)."""
    from ferrovod.runner import launch
    from ferrovod.runner.worker_env import JobInfo

    base = {k: v for k, v in os.environ.items() if k != VAR}
    for flags, expected in (([], None), (["--as-horovod"], "1")):
        args = launch.parse_args([*flags, "-H", "localhost:1,192.0.2.1:1", "true"])
        plan = launch.plan_job(args, dict(base))
        assert plan.remote == ["192.0.2.1"], plan.remote
        job = JobInfo(rendezvous_addr="127.0.0.1:1", secret_hex="00", tunables=plan.tunables)
        specs = launch._worker_specs(plan, {s.hostname: job for s in plan.slots}, base)
        local, remote = specs
        assert remote.remote is not None and local.remote is None
        assert local.env.get(VAR) == expected
        assert remote.remote.entry["env"].get(VAR) == expected


def test_training_job_imports_horovod_torch() -> None:
    """A Horovod script under ``ferrovodrun -np 2 --as-horovod`` (the launcher's own
    environment says 0: the flag is what turns the alias on in the workers)."""
    res = run_job(2, WORKERS / "horovod_alias_worker.py", 77, env={VAR: "0"},
                  launcher_args=("--as-horovod",), timeout=180)
    assert_ok(res, 2, min_checks=6)
    digests = [lines_matching(res, r, r"^weights ([0-9a-f]{64})$") for r in (0, 1)]
    assert all(digests), describe(res)
    assert digests[0][0].group(1) == digests[1][0].group(1), describe(res)
