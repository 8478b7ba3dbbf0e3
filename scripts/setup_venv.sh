#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment `.venv` and installs ferrovod into it.
#
# Idempotent: the venv is created only when missing, the pip packages are installed only when
# the pinned list below changed since the last run (a stamp file inside the venv remembers it),
# and the extension is rebuilt through cargo's own change detection (a no-op build when nothing
# changed). Output is quiet; on any failure the captured log is printed and the script exits
# non-zero.
#
# Usage: scripts/setup_venv.sh [--no-build]
#   --no-build   only create the venv and install the Python packages
# Environment:
#   VENV      venv directory (default: .venv in the repository root)
#   PYTHON    interpreter used to create the venv (default: python3)
#   FERROVOD_PROFILE   release (default) or debug build of the extension
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
PROFILE="${FERROVOD_PROFILE:-release}"
BUILD=1
for arg in "$@"; do
    case "$arg" in
        --no-build) BUILD=0 ;;
        *) echo "setup_venv.sh: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

# Loose pins: a floor that is known to work, a ceiling at the next major version that could
# break us. ziglang lets maturin link manylinux2014 wheels on any host glibc. torch (from PyPI
# as is; post-accumulate-grad hooks need >= 2.1) and scikit-learn (its bundled digits data)
# are for ferrovod.torch's tests and examples/pytorch_digits.py. mpi4py (a binary wheel that
# loads the system's libmpi at run time) is for the rendezvous over MPI under plain mpirun;
# PyYAML reads the Kubernetes examples in their tests; pytest-xdist runs the suite in two
# processes (most tests wait on the jobs they launch). pytest 9.2 builds a test's id where
# pytest-xdist 3.8 no longer labels it with its xdist_group, so the groups that keep the
# network-namespace, Ray and Spark tests on one worker at a time would split across both. tensorflow-cpu and keras (Keras 3) are for
# ferrovod.tensorflow / ferrovod.keras, their tests and examples; >=2.16 is the first TensorFlow
# that ships Keras 3, the line Horovod 0.28 cannot run on. ray (with Ray Train, whose trainers
# ferrovod runs inside) and pyspark are for ferrovod.ray,
# ferrovod.spark and their tests (a local Ray cluster and a local Spark the tests start; Spark's
# Java comes from scripts/system_deps.sh). deepmd-kit (its TensorFlow backend imports horovod
# itself) is for the test of FERROVOD_AS_HOROVOD on a real library; it pins the tensorflow-cpu
# it was built for, so pip keeps the two in step. ml_dtypes (bfloat16 for the NumPy workers,
# and a TensorFlow dependency) stays below 0.7: 0.7.0 registers its NumPy loops in time that
# grows with the square of their number, and its import took 0.9 s of CPU against 0.12 s for
# 0.6.0, in every worker of the suite (test_ops, test_errors, test_hostile and test_lifecycle:
# 179 s of CPU against 86 s; `import tensorflow` 4.4 s against 3.9 s). ninja is what torch
# builds C++ extensions with: the C++ half of backend="ferrovod" (ferrovod/torch/_front.cpp).
PACKAGES=(
    "pip>=23"
    "maturin>=1.5,<2"
    "numpy>=1.22"
    "cloudpickle>=2"
    "pytest>=7,<9.2"
    "pytest-timeout>=2"
    "pytest-xdist>=3"
    "ml_dtypes>=0.5.1,<0.7"
    "ziglang>=0.11,<1"
    "torch>=2.1"
    "ninja>=1.11"
    "scikit-learn>=1.0"
    "mpi4py>=4,<5"
    "PyYAML>=6"
    "tensorflow-cpu>=2.16,<3"
    "keras>=3,<4"
    "ray[train]>=2.40,<3"
    "pyspark>=3.5,<5"
    "deepmd-kit[cpu]>=3.2,<4"
)

LOG="$(mktemp "${TMPDIR:-/tmp}/ferrovod-setup.XXXXXX")"
trap 'rm -f "$LOG"' EXIT

# Runs a command with its output captured; on failure prints the output and exits.
run_quiet() {
    local what="$1"
    shift
    if ! "$@" >"$LOG" 2>&1; then
        echo "setup_venv.sh: FAILED: $what" >&2
        echo "  command: $*" >&2
        sed 's/^/  | /' "$LOG" >&2
        exit 1
    fi
}

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup: creating $(basename "$VENV") with $("$PYTHON" --version 2>&1)"
    run_quiet "create venv" "$PYTHON" -m venv "$VENV"
fi

STAMP="$VENV/.ferrovod-packages"
WANT="$(printf '%s\n' "${PACKAGES[@]}")"
if [[ ! -f "$STAMP" ]] || [[ "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "setup: installing Python packages into $(basename "$VENV")"
    run_quiet "pip install" "$VENV/bin/python" -m pip install --quiet --upgrade "${PACKAGES[@]}"
    printf '%s\n' "$WANT" >"$STAMP"
fi

# tf_keras (Keras 2, for Horovod-era tf.keras code under TF_USE_LEGACY_KERAS=1) is released
# in step with TensorFlow and requires the `tensorflow` package, which would install the full
# TensorFlow beside tensorflow-cpu: install the release matching the TensorFlow here, alone.
TF_MINOR="$("$VENV/bin/python" -c 'import importlib.metadata as m; print(".".join(m.version("tensorflow-cpu").split(".")[:2]))')"
if [[ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(".".join(m.version("tf_keras").split(".")[:2]))' 2>/dev/null)" != "$TF_MINOR" ]]; then
    echo "setup: installing tf_keras $TF_MINOR (Keras 2) into $(basename "$VENV")"
    run_quiet "pip install tf_keras" "$VENV/bin/python" -m pip install --quiet --no-deps "tf_keras==$TF_MINOR.*"
fi

if [[ "$BUILD" == 1 ]]; then
    echo "setup: building the extension ($PROFILE) into $(basename "$VENV")"
    # The development build has the test hooks (Cargo.toml's `testing`), the wheel not; the
    # features are all named, pyproject.toml's as well.
    MATURIN_ARGS=(develop --quiet --features python,pyo3/extension-module,testing)
    [[ "$PROFILE" == release ]] && MATURIN_ARGS+=(--release)
    # `maturin develop` installs into the venv named by VIRTUAL_ENV; setting it (and PATH) is
    # what activating the venv would do.
    run_quiet "maturin develop" env VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" \
        "$VENV/bin/maturin" "${MATURIN_ARGS[@]}"
    # FERROVOD_AS_HOROVOD's start-up hook. The wheel carries python/ferrovod_as_horovod.pth to
    # the root of site-packages (pyproject.toml's include), but `maturin develop` installs an
    # editable package, a ferrovod.pth naming python/, and leaves the wheel's included files
    # out; the module that .pth imports, python/_ferrovod_as_horovod.py, is found through that
    # ferrovod.pth (which sorts before it, and .pth files run in name order).
    SITE="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
    run_quiet "install ferrovod_as_horovod.pth" \
        install -m 644 "$ROOT/python/ferrovod_as_horovod.pth" "$SITE/ferrovod_as_horovod.pth"
    run_quiet "import check" "$VENV/bin/python" -c "import ferrovod._core"
    # The C++ half of backend="ferrovod", built here (23 s, once per change of its source or
    # of torch) into the venv's own cache, where the tests find it (tests/python/conftest.py):
    # no test waits for the compiler, and a fresh clone never finds another clone's build.
    if ! command -v c++ >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing g++ (what torch builds the backend's C++ half with)"
        run_quiet "apt-get install g++" env DEBIAN_FRONTEND=noninteractive \
            bash -c "apt-get update -qq && apt-get install -y -qq --no-install-recommends g++"
    fi
    # It also needs this Python's headers (a Debian Python without its -dev package has none).
    HEADERS="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
    if command -v c++ >/dev/null 2>&1 && [[ -f "$HEADERS/Python.h" ]]; then
        echo "setup: building the torch backend's C++ half into $(basename "$VENV")/torch_extensions"
        run_quiet "build ferrovod/torch/_front.cpp" env TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" \
            "$VENV/bin/python" -c "from ferrovod.torch import _front; _front._build()"
    else
        missing="a C++ compiler"
        command -v c++ >/dev/null 2>&1 && missing="Python's headers ($HEADERS/Python.h)"
        echo "setup: no $missing: backend='ferrovod' runs without its C++ half here, and" \
            "the tests of that half skip" >&2
    fi
fi
