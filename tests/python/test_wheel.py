"""The wheel users install: abi3 + manylinux, and it runs a 2-process job from a fresh venv.

Builds the wheel with scripts/build_wheel.sh (or reuses one in dist/ that is newer than every
source file), installs it with its dependencies into a new virtual environment, and from a
working directory outside the source tree runs ``ferrovodrun -np 2`` of that venv on a script
that allreduces and checks the result. This is what `pip install ferrovod` gives a user, so
nothing of the source tree or of the development venv may leak in. The same venv then runs a
script that imports horovod under ``ferrovodrun --as-horovod``: the .pth that turns the alias
on must come with the wheel, into site-packages (tests/python/test_horovod_alias.py checks the
alias itself in the development venv).

The wheel is tagged cp310-abi3: one wheel for every CPython from 3.10 on. So the same two jobs
also run from venvs of Python 3.10 and 3.13, the oldest and the newest Python tested, beside the
3.11 of the development venv. Their interpreters come from scripts/find_python.sh (PATH, pyenv,
or Debian's, which scripts/system_deps.sh installs with apt where apt has them); a version that
cannot be had on the machine is skipped, saying what was looked at.

Slow (a release build, a venv, a pip install): set FERROVOD_SKIP_WHEEL_TEST=1 to skip it in
quick local runs. `make test` and CI run it.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
SOURCES = ("src", "python", "Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md")

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("FERROVOD_SKIP_WHEEL_TEST", "") not in ("", "0"),
        reason="FERROVOD_SKIP_WHEEL_TEST is set",
    ),
    pytest.mark.timeout(1500),
]

# The abi3 floor and the newest CPython tried: the wheel must install and run on both, as on
# the development venv's 3.11.
OTHER_PYTHONS = ("3.10", "3.13")

WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ferrovod as fv

    fv.init()
    rank, size = fv.rank(), fv.size()
    assert size == 2, size
    x = np.arange(1000, dtype=np.float32) * (rank + 1)
    total = fv.allreduce(x, op=fv.Sum, name="wheel.sum")
    mean = fv.allreduce(x, op=fv.Average, name="wheel.avg")
    ref = sum(np.arange(1000, dtype=np.float32) * (r + 1) for r in range(size))
    assert np.array_equal(total, ref), (total[:5], ref[:5])
    assert np.allclose(mean, ref / size), (mean[:5], ref[:5] / size)
    py = "%d.%d" % sys.version_info[:2]
    print(f"WHEEL-OK rank={rank} pkg={fv.__file__} core={fv._core.__file__} py={py}", flush=True)
    fv.shutdown()
    """
)


# A Horovod script: under --as-horovod its `import horovod` gives ferrovod, from the wheel.
HOROVOD_WORKER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import horovod as hvd
    import ferrovod

    assert hvd is ferrovod and sys.modules["horovod"] is ferrovod, hvd
    hvd.init()
    total = hvd.allreduce(np.full(4, hvd.rank() + 1.0), op=hvd.Sum, name="alias.sum")
    assert np.array_equal(total, np.full(4, 3.0)), total
    helper = sys.modules["_ferrovod_as_horovod"].__file__
    print(f"ALIAS-OK rank={hvd.rank()} pkg={hvd.__file__} helper={helper}", flush=True)
    hvd.shutdown()
    """
)


def newest_source_mtime() -> float:
    """Latest modification time of anything the wheel is built from."""
    newest = 0.0
    for entry in SOURCES:
        path = ROOT / entry
        files = [path] if path.is_file() else path.rglob("*")
        for file in files:
            if file.is_file() and file.suffix not in (".so", ".pyc"):
                newest = max(newest, file.stat().st_mtime)
    return newest


def find_or_build_wheel() -> Path:
    """A wheel in dist/ newer than the sources, or a freshly built one.

    One build at a time: a test on another xdist worker waits for it, then takes its wheel."""
    DIST.mkdir(exist_ok=True)
    with open(DIST / ".wheel-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _find_or_build_wheel()


def _find_or_build_wheel() -> Path:
    fresh = [
        whl
        for whl in DIST.glob("ferrovod-*.whl")
        if whl.stat().st_mtime > newest_source_mtime()
    ]
    if fresh:
        return max(fresh, key=lambda whl: whl.stat().st_mtime)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(DIST)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout}\n{proc.stderr}"
    return Path(proc.stdout.strip().splitlines()[-1])


def clean_env(venv: Path) -> dict[str, str]:
    """The environment of a user's shell with only `venv` on PATH: nothing of this run."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("FERROVOD_", "HOROVOD_", "PYTHON", "PYTEST"))
        and key not in ("VIRTUAL_ENV", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", "WORLD_SIZE")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def test_wheel_is_abi3_manylinux_and_runs_two_processes(tmp_path: Path) -> None:
    wheel = find_or_build_wheel()
    assert wheel.is_file(), wheel

    # name-version-python-abi-platform.whl
    _, _, python_tag, abi_tag, platform_tag = wheel.name[: -len(".whl")].split("-")
    assert (python_tag, abi_tag) == ("cp310", "abi3"), wheel.name
    assert "manylinux" in platform_tag, f"not a manylinux wheel: {wheel.name}"

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = next(name for name in names if name.endswith(".dist-info/WHEEL"))
        tags = re.findall(r"^Tag: (\S+)$", archive.read(meta).decode(), flags=re.M)
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = archive.read(entry_points).decode()
    assert tags and all(tag.startswith("cp310-abi3-manylinux") for tag in tags), tags
    assert "ferrovod/_core.abi3.so" in names, [n for n in names if n.endswith(".so")]
    assert "ferrovod/__init__.py" in names
    # The torch backend's C++ half, which torch builds where the wheel is installed.
    assert "ferrovod/torch/_front.cpp" in names, [n for n in names if "/torch/" in n]
    # At the root, so that pip puts them at the root of site-packages, where .pth files run.
    assert {"ferrovod_as_horovod.pth", "_ferrovod_as_horovod.py"} <= set(names), names
    assert re.search(r"^ferrovodrun\s*=", scripts, flags=re.M), scripts

    exercise_in_venv(sys.executable, wheel, tmp_path, "%d.%d" % sys.version_info[:2])

    # The tests' hooks (the `testing` cargo feature) are not in what users install.
    py = tmp_path / "venv" / "bin" / "python"
    hooks = subprocess.run(
        [str(py), "-c", "from ferrovod import _core; print([h for h in ('fast_path_stats', "
                        "'nccl_unique_id') if hasattr(_core, h)])"],
        capture_output=True, text=True, env=clean_env(tmp_path / "venv"), timeout=60)
    assert hooks.returncode == 0 and hooks.stdout.strip() == "[]", hooks.stdout + hooks.stderr


@pytest.mark.parametrize("version", OTHER_PYTHONS)
def test_wheel_runs_two_processes_on_python(version: str, tmp_path: Path) -> None:
    found = subprocess.run(["bash", str(ROOT / "scripts" / "find_python.sh"), version],
                           capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        pytest.skip(f"no Python {version} here, so the abi3 wheel is not tried on it: "
                    f"{found.stderr.strip()}")
    python = found.stdout.strip().splitlines()[-1]
    exercise_in_venv(python, find_or_build_wheel(), tmp_path, version)


def exercise_in_venv(python: str, wheel: Path, tmp_path: Path, version: str) -> None:
    """Installs `wheel` into a new venv of `python` (Python `version`) and runs the two jobs
    from it: an allreduce checked against NumPy, and a Horovod script under --as-horovod."""
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    install = subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
        env=clean_env(venv),
        timeout=600,
    )
    assert install.returncode == 0, f"pip install failed:\n{install.stdout}\n{install.stderr}"

    work = tmp_path / "work"
    work.mkdir()
    (work / "job.py").write_text(WORKER)

    def two_ranks(*args: str) -> str:
        """Output of ``ferrovodrun -np 2 ARGS`` of the venv, asserted to succeed."""
        cmd = [str(venv / "bin" / "ferrovodrun"), "-np", "2", *args]
        job = subprocess.run(cmd, cwd=work, capture_output=True, text=True,
                             env=clean_env(venv), timeout=180)
        output = job.stdout + job.stderr
        assert job.returncode == 0, f"{' '.join(cmd)} exited {job.returncode}:\n{output}"
        return output

    output = two_ranks(str(py), "job.py")

    site = venv / "lib"
    oks = re.findall(r"WHEEL-OK rank=(\d) pkg=(\S+) core=(\S+) py=(\S+)", output)
    assert sorted(rank for rank, _, _, _ in oks) == ["0", "1"], output
    for _, pkg, core, ran_on in oks:
        # The installed copy, not the source tree's python/ferrovod.
        assert Path(pkg).is_relative_to(site), pkg
        assert Path(core).is_relative_to(site) and core.endswith("_core.abi3.so"), core
        # The ranks ran on the venv's interpreter, of the version asked for.
        assert ran_on == version, (ran_on, version)

    # FERROVOD_AS_HOROVOD from the installed wheel: off without the variable, on for every
    # worker with --as-horovod.
    plain = subprocess.run([str(py), "-c", "import horovod"], cwd=work, capture_output=True,
                           text=True, env=clean_env(venv), timeout=60)
    assert plain.returncode != 0 and "No module named 'horovod'" in plain.stderr, plain.stderr
    (work / "hvd_job.py").write_text(HOROVOD_WORKER)
    output = two_ranks("--as-horovod", str(py), "hvd_job.py")
    oks = re.findall(r"ALIAS-OK rank=(\d) pkg=(\S+) helper=(\S+)", output)
    assert sorted(rank for rank, _, _ in oks) == ["0", "1"], output
    for _, pkg, helper in oks:
        assert Path(pkg).is_relative_to(site) and Path(helper).is_relative_to(site), (pkg, helper)
