#!/usr/bin/env bash
# Creates .venv-mxnet: MXNet 1.9.1 (its last release) needs NumPy < 1.24, which the main
# virtual environment's frameworks do not allow, so its tests run in an interpreter of their
# own. ferrovod comes from this checkout (the package and the native module that
# scripts/setup_venv.sh builds there), through a .pth file: nothing is built twice.
#
# The interpreter is Python 3.11, whatever the main venv's: NumPy 1.23.5 has no wheels for
# 3.12 or later (nor scipy 1.11.4 and scikit-learn 1.3.2 for 3.13), and 3.11 is what these pins
# are tested on. It is MXNET_PYTHON if set, else what scripts/find_python.sh finds (python3.11
# on PATH or under pyenv, else Debian's, installed with apt when missing, as root); without one
# this script fails, saying so.
#
# Usage: scripts/setup_mxnet_venv.sh   (run by `make test`; a no-op once it is up to date)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MXNET_VENV:-$ROOT/.venv-mxnet}"
WANT_PY=3.11

py_version() {  # major.minor of interpreter $1, or nothing if it does not run
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true
}

# A venv left by an earlier version of this script on another interpreter is made anew.
if [[ -x "$VENV/bin/python" && -z "${MXNET_PYTHON:-}" \
    && "$(py_version "$VENV/bin/python")" != "$WANT_PY" ]]; then
    echo "setup_mxnet_venv: $VENV is not Python $WANT_PY; creating it again" >&2
    rm -rf "$VENV"
fi
# scikit-learn for examples/mxnet_digits.py (its digits dataset), at versions built for NumPy 1.23.
PACKAGES=("mxnet==1.9.1" "numpy==1.23.5" "cloudpickle>=2" "pyyaml>=5.1" "ml_dtypes==0.5.4"
          "scikit-learn==1.3.2" "scipy==1.11.4")
STAMP="$VENV/.ferrovod-packages"
WANT="$(printf '%s\n' "${PACKAGES[@]}")"

if [[ ! -x "$VENV/bin/python" ]]; then
    PYTHON="${MXNET_PYTHON:-}"
    if [[ -z "$PYTHON" ]] \
        && ! PYTHON="$(bash "$ROOT/scripts/find_python.sh" --install "$WANT_PY")"; then
        echo "setup_mxnet_venv: MXNet 1.9.1's pins need Python $WANT_PY;" \
            "the MXNet tests cannot run without it" >&2
        exit 1
    fi
    echo "setup_mxnet_venv: creating $(basename "$VENV") with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PACKAGES[@]}"
    printf '%s\n' "${PACKAGES[@]}" > "$STAMP"
fi
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$ROOT/python" > "$site/ferrovod.pth"
"$VENV/bin/python" -c "import mxnet, ferrovod.mxnet" \
    || { echo "setup_mxnet_venv: $VENV cannot import mxnet and ferrovod.mxnet" >&2; exit 1; }
