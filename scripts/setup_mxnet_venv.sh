#!/usr/bin/env bash
# Creates .venv-mxnet: MXNet 1.9.1 (its last release) needs NumPy < 1.24, which the main
# virtual environment's frameworks do not allow, so its tests run in an interpreter of their
# own. ferrovod comes from this checkout (the package and the native module that
# scripts/setup_venv.sh builds there), through a .pth file: nothing is built twice.
#
# Usage: scripts/setup_mxnet_venv.sh   (run by `make test`; a no-op once it is up to date)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MXNET_VENV:-$ROOT/.venv-mxnet}"
PYTHON="${PYTHON:-python3}"
# scikit-learn for examples/mxnet_digits.py (its digits dataset), at versions built for NumPy 1.23.
PACKAGES=("mxnet==1.9.1" "numpy==1.23.5" "cloudpickle>=2" "pyyaml>=5.1" "ml_dtypes==0.5.4"
          "scikit-learn==1.3.2" "scipy==1.11.4")
STAMP="$VENV/.ferrovod-packages"
WANT="$(printf '%s\n' "${PACKAGES[@]}")"

if [[ ! -x "$VENV/bin/python" ]]; then
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
