#!/usr/bin/env bash
# Debian packages the test suite uses beyond a bare machine: iproute2 (`ip netns`, for the
# tests that simulate hosts as network namespaces). Installed only when missing and only as
# root; otherwise those tests skip and say why.
set -euo pipefail
if command -v ip >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps: iproute2 missing and cannot be installed here; network-namespace tests will skip" >&2
    exit 0
fi
echo "system_deps: installing iproute2"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq iproute2 >/dev/null
