#!/usr/bin/env bash
# Runs Horovod's own test suites against ferrovod; the work is done by horovod_suite.py beside
# this script (see its --help). Horovod's tests are read from a snapshot of its repository at
# run time and never copied into this repository.
#
# Usage: scripts/horovod_suite.sh HOROVOD_REPO [options]
#        HOROVOD_REPO=<clone, bare repository, or directory with test/> \
#            scripts/horovod_suite.sh [options]
#   e.g. scripts/horovod_suite.sh ~/src/horovod --ref v0.28.1 --files test_torch.py --timeout 60
# Environment:
#   VENV     the virtual environment whose python runs the tests (default: .venv in the
#            repository root); missing test dependencies (mock, parameterized, ...) go into it
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "horovod_suite.sh: no python in $VENV (run 'make setup' first, or set VENV)" >&2
    exit 2
fi
# The venv's own interpreter path, not a resolved one: pip and ferrovodrun must be the venv's.
exec "$VENV/bin/python" "$ROOT/scripts/horovod_suite.py" "$@"
