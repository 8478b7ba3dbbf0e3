#!/usr/bin/env bash
# Prints the path of a CPython of one minor version that can create virtual environments:
# python<V> on PATH, else pyenv's, else Debian's /usr/bin/python<V>. With --install, as root on
# a Debian-like machine, one that is missing is installed with apt (python<V>, python<V>-venv)
# where apt has it; nothing else is downloaded. Exits 1 saying what it looked at when none is.
#
# Usage: scripts/find_python.sh [--install] 3.11
# Used by scripts/setup_mxnet_venv.sh (3.11), scripts/system_deps.sh and
# tests/python/test_wheel.py (3.10 and 3.13, the abi3 wheel's floor and the newest Python it
# is tried on).
set -euo pipefail

install=0
if [[ "${1:-}" == "--install" ]]; then
    install=1
    shift
fi
want="${1:?usage: find_python.sh [--install] MAJOR.MINOR}"

usable() {  # $1 runs, is Python $want, and has venv with ensurepip (Debian splits them off)
    [[ -n "$1" && -x "$1" ]] || return 1
    local got
    got="$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" || return 1
    [[ "$got" == "$want" ]] && "$1" -c 'import ensurepip, venv' 2>/dev/null
}

look() {
    local candidate
    # A pyenv shim on PATH answers only for the versions pyenv has selected, so pyenv's
    # versions are looked at directly as well.
    for candidate in "$(command -v "python$want" || true)" \
        "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$want".*/bin/python"$want" \
        "/usr/bin/python$want"; do
        if usable "$candidate"; then
            "$candidate" -c 'import sys; print(sys.executable)'  # the interpreter, not a shim
            return 0
        fi
    done
    return 1
}

look && exit 0
if [[ "$install" == 1 && "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    if apt-cache show "python$want-venv" >/dev/null 2>&1; then
        echo "find_python: installing python$want and python$want-venv with apt" >&2
        apt-get install -y -qq --no-install-recommends "python$want" "python$want-venv" >/dev/null
        look && exit 0
    fi
fi
echo "find_python: no Python $want that can create a venv (looked for python$want on PATH, in" \
    "pyenv's versions and /usr/bin$([[ "$install" == 1 ]] && echo ", and in apt's packages"))" >&2
exit 1
