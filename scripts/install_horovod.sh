#!/usr/bin/env bash
# Builds Horovod 0.28.1 (its last release) from its sdist into a separate virtual environment,
# `.venv-horovod` at the repository root, beside ferrovod, so that
# `benchmarks/collectives.py --compare horovod` can time both in one run.
#
# Why a separate venv: Horovod 0.28.1 compiles against PyTorch's C++ headers with C++14, which
# PyTorch >= 2.1 no longer accepts, so it needs torch 2.0.x — and torch 2.0.x needs NumPy 1.x;
# the project's `.venv` has a current torch and NumPy 2.
#
# What goes into the venv: torch 2.0.1 (from PyPI; its CUDA runtime packages come along, the
# build itself is CPU-only because no CUDA toolkit is installed), numpy<2, mpi4py (binary
# wheel, loads the system's libmpi), Horovod with the PyTorch framework only and the gloo
# controller, plus MPI when Open MPI's headers are there, and ferrovod itself (a release wheel
# built by maturin from this checkout).
#
# MPI: Horovod's MPI controller needs `mpicc` and Open MPI's headers (Debian: libopenmpi-dev).
# Run as root with apt-get available, the script installs libopenmpi-dev when the headers are
# missing; otherwise Horovod is built with gloo only, and the benchmark can then time it only
# under ferrovodrun (where it sets Horovod up on gloo), not under mpirun.
#
# Every compile step runs under `nice -n 19` with MAKEFLAGS=-j2 (override with MAKEFLAGS=...):
# Horovod takes 5-15 minutes on 2 cores and must not starve everything else on the machine.
#
# Idempotent: the venv is created only when missing; Horovod is rebuilt only when it does not
# import; ferrovod is rebuilt and reinstalled every run (cargo's change detection, in
# target/horovod-venv, makes that cheap when nothing changed).
#
# Usage: scripts/install_horovod.sh [--no-mpi] [--force]
#   --no-mpi   build Horovod with gloo only, even when MPI's headers are there
#   --force    rebuild Horovod even if it already imports
# Environment:
#   VENV       venv directory (default: .venv-horovod in the repository root)
#   PYTHON     interpreter used to create the venv (default: python3; Horovod 0.28.1 with
#              torch 2.0.1 needs CPython 3.8-3.11)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${VENV:-$ROOT/.venv-horovod}"
PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
WITH_MPI=1
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --no-mpi) WITH_MPI=0 ;;
        --force) FORCE=1 ;;
        *) echo "install_horovod.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

# torch 2.0.1 is the newest torch whose headers build with Horovod 0.28.1's C++14; it was built
# against NumPy 1.x (NumPy 2 breaks torch.from_numpy there). cmake 4 dropped support for the
# cmake_minimum_required(VERSION < 3.5) that Horovod's bundled third-party projects declare.
# torch 2.0's torch.utils.cpp_extension (which Horovod's CMake asks for torch's include and
# library directories) does `from pkg_resources import packaging`, gone from setuptools 70.
PACKAGES=(
    "pip>=23"
    "setuptools<70"
    "wheel"
    "cmake>=3.13,<4"
    "torch==2.0.1"
    "numpy>=1.22,<2"
    "mpi4py>=4,<5"
    "maturin>=1.5,<2"
    "cloudpickle>=2"
    "psutil"
    "pyyaml"
    "packaging"
)

export MAKEFLAGS="${MAKEFLAGS:--j2}"
# Cargo ignores MAKEFLAGS; keep rustc to the same two jobs.
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"

LOG="$(mktemp "${TMPDIR:-/tmp}/ferrovod-horovod.XXXXXX")"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/ferrovod-horovod-build.XXXXXX")"
trap 'rm -rf "$LOG" "$WORK"' EXIT

# Runs a command with its output captured; on failure prints the compiler's error lines and
# the end of the output, keeps the whole log, and exits.
quiet() {
    if ! "$@" >"$LOG" 2>&1; then
        echo "install_horovod.sh: failed: $*" >&2
        grep -E -m 20 -B 2 -A 6 '(error|Error):' "$LOG" >&2 || true
        echo "--- last lines ---" >&2
        tail -n 30 "$LOG" >&2
        cp "$LOG" "${TMPDIR:-/tmp}/install_horovod-failed.log"
        echo "install_horovod.sh: full log: ${TMPDIR:-/tmp}/install_horovod-failed.log" >&2
        exit 1
    fi
}

# Whether Open MPI's mpicc can compile a program that includes mpi.h.
mpi_headers_ok() {
    command -v mpicc >/dev/null 2>&1 || return 1
    printf '#include <mpi.h>\nint main(void) { return MPI_VERSION > 0 ? 0 : 1; }\n' >"$WORK/mpi_probe.c"
    mpicc "$WORK/mpi_probe.c" -o "$WORK/mpi_probe" >/dev/null 2>&1
}

if [ "$WITH_MPI" = 1 ] && ! mpi_headers_ok; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "install_horovod: installing libopenmpi-dev (Open MPI's headers, for Horovod's MPI controller)"
        export DEBIAN_FRONTEND=noninteractive
        quiet apt-get update -qq
        quiet apt-get install -y -qq --no-install-recommends libopenmpi-dev openmpi-bin
    fi
    if ! mpi_headers_ok; then
        echo "install_horovod: no usable mpicc with Open MPI's headers; building Horovod with gloo only" >&2
        WITH_MPI=0
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "install_horovod: creating $VENV"
    quiet "$PYTHON" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
echo "install_horovod: installing torch 2.0.1, numpy<2, mpi4py, build tools (first run downloads ~2.5 GB)"
quiet "$VPY" -m pip install --upgrade "${PACKAGES[@]}"

if [ "$FORCE" = 1 ] || ! "$VPY" -c "import horovod.torch" >/dev/null 2>&1; then
    mode="gloo"
    [ "$WITH_MPI" = 1 ] && mode="gloo and MPI"
    echo "install_horovod: building Horovod $HOROVOD_VERSION (PyTorch, CPU, $mode)" \
        "under nice -n 19 with MAKEFLAGS=$MAKEFLAGS; 5-15 minutes on 2 cores"
    hvd_env=(
        HOROVOD_WITH_PYTORCH=1
        HOROVOD_WITHOUT_TENSORFLOW=1
        HOROVOD_WITHOUT_MXNET=1
        HOROVOD_WITH_GLOO=1
        # The venv's cmake (setup.py looks for `cmake` on PATH, else pip-installs 3.13).
        HOROVOD_CMAKE="$VENV/bin/cmake"
        PATH="$VENV/bin:$PATH"
    )
    if [ "$WITH_MPI" = 1 ]; then
        hvd_env+=(HOROVOD_WITH_MPI=1)
    else
        hvd_env+=(HOROVOD_WITHOUT_MPI=1)
    fi
    # --no-build-isolation: Horovod's setup.py imports the torch it builds against, the one in
    # this venv. --no-cache-dir: a wheel cached from another build (other torch, no MPI) would
    # be reused silently otherwise.
    quiet env "${hvd_env[@]}" nice -n 19 "$VPY" -m pip install --no-cache-dir \
        --no-build-isolation --no-binary horovod --force-reinstall --no-deps \
        "horovod==$HOROVOD_VERSION"
fi

# A target directory of its own: building for this venv's interpreter in the shared target/
# would change pyo3's build fingerprint (PYO3_PYTHON) and make the next build for .venv
# recompile everything, and back.
echo "install_horovod: building ferrovod (maturin build --release) under nice -n 19"
quiet env CARGO_TARGET_DIR="$ROOT/target/horovod-venv" nice -n 19 \
    "$VENV/bin/maturin" build --release --out "$WORK/wheels" --interpreter "$VPY"
quiet "$VPY" -m pip install --force-reinstall --no-deps "$WORK"/wheels/ferrovod-*.whl

"$VPY" - <<'EOF'
import horovod
import horovod.torch as hvd
import torch

import ferrovod

print(f"install_horovod: OK: horovod {horovod.__version__} (gloo {hvd.gloo_built()}, "
      f"MPI {hvd.mpi_built()}), torch {torch.__version__}, ferrovod {ferrovod.__version__}")
EOF
echo "install_horovod: run e.g. mpirun -np 2 --bind-to none $(basename "$VENV")/bin/python" \
    "benchmarks/collectives.py --compare torch,mpi4py,horovod"
