#!/usr/bin/env bash
# Debian packages the test suite uses beyond a bare machine:
#   iproute2        `ip netns`, for the tests that simulate hosts as network namespaces;
#   openssh-server  sshd inside each simulated host (multi-host ferrovodrun, mpirun);
#   openssh-client  ssh, what ferrovodrun and mpirun start remote workers with;
#   openmpi-bin     Open MPI's mpirun (tests of workers started by mpirun, with mpi4py);
#   mpich           MPICH's mpiexec.hydra (workers started by Hydra). Open MPI keeps the
#                   `mpirun` name: Debian ranks its alternative higher.
#   default-jre-headless  Java for Spark (ferrovod.spark's tests on a local Spark).
# Installed only when missing and only as root; otherwise the tests that need them skip and
# say why.
#
# Python 3.10 and 3.13, the abi3 wheel's floor and the newest Python it is tried on, for
# tests/python/test_wheel.py: scripts/find_python.sh looks for each (PATH, pyenv) and installs it
# with apt where apt has it (Debian 12 has only 3.11); where neither has one, the wheel test
# skips that version, saying so.
set -euo pipefail
for version in 3.10 3.13; do
    bash "$(dirname "${BASH_SOURCE[0]}")/find_python.sh" --install "$version" >/dev/null \
        || echo "system_deps: the wheel test will skip Python $version" >&2
done
need=()
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpiexec.hydra >/dev/null 2>&1 || need+=(mpich)
command -v java >/dev/null 2>&1 || need+=(default-jre-headless)
if [ "${#need[@]}" = 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "system_deps: ${need[*]} missing and cannot be installed here; the tests that need them will skip" >&2
    exit 0
fi
echo "system_deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
