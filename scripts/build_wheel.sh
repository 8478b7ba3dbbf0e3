#!/usr/bin/env bash
# Builds ferrovod's abi3 wheel into a folder (default: dist/).
#
# With ziglang installed in the venv (scripts/setup_venv.sh installs it) maturin links against
# glibc 2.17 through zig and the wheel is tagged manylinux2014, so it installs on any x86_64
# Linux of the last decade (the only architecture built and tested). Without a working zig it
# falls back to a plain build, tagged for this host's glibc, and says so.
#
# Usage: scripts/build_wheel.sh [OUT_DIR]
# Prints the path of the wheel it built as the last line of its output.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-$ROOT/.venv}"
OUT="${1:-$ROOT/dist}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

if [[ ! -x "$VENV/bin/maturin" ]]; then
    bash "$ROOT/scripts/setup_venv.sh" --no-build
fi
export PATH="$VENV/bin:$PATH"

LOG="$(mktemp "${TMPDIR:-/tmp}/ferrovod-wheel.XXXXXX")"
# Wheels already in OUT are left alone; the one this run built is the one newer than this
# marker (maturin overwrites a wheel of the same name, so the name alone does not tell).
start_marker="$(mktemp "${TMPDIR:-/tmp}/ferrovod-wheel-start.XXXXXX")"
trap 'rm -f "$LOG" "$start_marker"' EXIT

if "$VENV/bin/python" -m ziglang version >/dev/null 2>&1 \
    && maturin build --release --zig --compatibility manylinux2014 --out "$OUT" >"$LOG" 2>&1; then
    echo "wheel: built with zig for manylinux2014" >&2
else
    if [[ -s "$LOG" ]]; then
        echo "wheel: zig build failed, falling back to a plain build; its log:" >&2
        sed 's/^/  | /' "$LOG" >&2
    else
        echo "wheel: ziglang not usable, falling back to a plain build" >&2
    fi
    if ! maturin build --release --out "$OUT" >"$LOG" 2>&1; then
        echo "wheel: FAILED" >&2
        sed 's/^/  | /' "$LOG" >&2
        exit 1
    fi
fi

wheel="$(find "$OUT" -maxdepth 1 -name 'ferrovod-*.whl' -newer "$start_marker" | head -n 1)"
if [[ -z "$wheel" ]]; then
    echo "wheel: maturin reported success but no new wheel is in $OUT" >&2
    exit 1
fi
echo "$wheel"
