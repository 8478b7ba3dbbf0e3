"""What this machine can do for the tests that need more than Python: each capability is
tried, not assumed, once per test process (pytest-xdist runs one per worker), and the verdict
kept. Every function returns None when the capability is there, else the reason a test skips
with, naming what failed and what would provide it.

* :func:`netns_missing`: network namespaces as simulated hosts (``netns.py``, the link-cut
  test). Root is not enough: a container may run as root without ``CAP_SYS_ADMIN`` or
  ``CAP_NET_ADMIN``. So two throwaway namespaces are made, joined by a veth into a bridge,
  given an address, entered with ``ip netns exec`` (with an ``/etc/netns`` file bind-mounted)
  under ``unshare --uts --mount`` with a private ``/run``, and removed again.
* :func:`private_run_missing`: a private ``/run`` (``unshare --mount`` and a tmpfs), which
  sshd's privilege separation needs where the machine has no ``/run/sshd``.
* :func:`sshd_missing`: OpenSSH's sshd and client tools; sshd must accept the configuration
  the simulated hosts run it with (``sshd -t``, in a private ``/run``).
* :func:`mpirun_missing`: Open MPI's ``mpirun`` starts a process (``-np 1 true``).
* :func:`mpi4py_missing`: a rank under ``mpirun`` imports this Python's ``mpi4py.MPI`` (the
  wheel loads the system's libmpi at run time).
* :func:`java_missing`: ``java -version`` runs (Spark's JVM).

``make test`` installs the packages as root (``scripts/system_deps.sh``); elsewhere the tests
that need them skip, and ``pytest -rs`` prints these reasons.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import List, Optional, Sequence

SSHD = "/usr/sbin/sshd"
INSTALL = "make test installs it as root with scripts/system_deps.sh"
# A subnet no test uses: the probe's namespaces never meet a test's.
_PROBE_NET = "10.213.250"


def _try(argv: Sequence[str], timeout: float = 60, label: Optional[str] = None) -> Optional[str]:
    """None when ``argv`` exits 0, else what went wrong in a line (naming the command as
    ``label``, or as itself)."""
    label = label or " ".join(argv)
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return f"{argv[0]} is not installed"
    except subprocess.TimeoutExpired:
        return f"`{label}` did not finish in {timeout:.0f} s"
    except OSError as exc:
        return f"`{argv[0]}`: {exc}"
    if res.returncode == 0:
        return None
    said = (res.stderr.strip() or res.stdout.strip()).splitlines()
    return f"`{label}` exited {res.returncode}: {said[-1] if said else 'nothing said'}"


def _no_tool(*tools: str) -> Optional[str]:
    for tool in tools:
        if shutil.which(tool) is None:
            return f"needs {tool}, which is not installed ({INSTALL})"
    return None


def sshd_config_text(workdir: Path, port: int = 2222) -> str:
    """The sshd configuration of a simulated host (netns.py), with its files in ``workdir``."""
    return (
        f"Port {port}\n"
        f"HostKey {workdir / 'host_key'}\n"
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PidFile none\n"
        "PrintMotd no\n"
    )


# What a simulated host's sshd is started under (netns.py): its own hostname and /run.
IN_PRIVATE_RUN = 'hostname "$0" && mount -t tmpfs tmpfs /run && mkdir /run/sshd && exec "$@"'


@functools.lru_cache(maxsize=None)
def netns_missing() -> Optional[str]:
    """Why simulated hosts cannot be made here, or None (see the module's docstring)."""
    if os.geteuid() != 0:
        return (f"needs root for network namespaces (`ip netns`, /etc/netns); running as uid "
                f"{os.geteuid()}")
    missing = _no_tool("ip", "unshare")
    if missing:
        return missing
    tag = uuid.uuid4().hex[:6]
    bridge, host = f"fvpb{tag}", f"fvph{tag}"
    etc = Path("/etc/netns") / host
    made: List[str] = []
    try:
        for ns in (bridge, host):
            err = _try(["ip", "netns", "add", ns], 30, "ip netns add")
            if err:
                return (f"cannot make a network namespace ({err}): needs root with "
                        "CAP_SYS_ADMIN and CAP_NET_ADMIN")
            made.append(ns)
        steps = [
            ["ip", "-n", bridge, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", bridge, "link", "set", "br0", "up"],
            ["ip", "link", "add", "eth0", "netns", host, "type", "veth",
             "peer", "name", f"p{tag}", "netns", bridge],
            ["ip", "-n", bridge, "link", "set", f"p{tag}", "master", "br0", "up"],
            ["ip", "-n", host, "addr", "add", f"{_PROBE_NET}.1/24", "dev", "eth0"],
            ["ip", "-n", host, "link", "set", "eth0", "up"],
        ]
        for step in steps:
            # Named without the probe's own names, so that every process says the same.
            err = _try(step, 30, " ".join(a.replace(tag, "*") for a in step))
            if err:
                return f"cannot link network namespaces ({err}): needs CAP_NET_ADMIN and veth"
        try:
            etc.mkdir(parents=True)
            (etc / "hosts").write_text(f"{_PROBE_NET}.1 fvprobe\n")
        except OSError as exc:
            return f"cannot write a namespace's /etc/netns/<ns>/hosts: {exc}"
        err = _try(["ip", "netns", "exec", host, "unshare", "--uts", "--mount", "--propagation",
                    "private", "sh", "-c", IN_PRIVATE_RUN, "fvprobe", "grep", "-q", "fvprobe",
                    "/etc/hosts"], 30, "ip netns exec <ns> unshare --uts --mount ...")
        if err:
            return (f"cannot run a process as a simulated host ({err}): `ip netns exec` and "
                    "`unshare --uts --mount` need CAP_SYS_ADMIN")
        return None
    finally:
        shutil.rmtree(etc, ignore_errors=True)
        for ns in made:
            _try(["ip", "netns", "del", ns], 30)


@functools.lru_cache(maxsize=None)
def private_run_missing() -> Optional[str]:
    """Why a process cannot be given a private /run here (as sshd's is), or None."""
    if os.geteuid() != 0:
        return f"needs root to mount a private /run for sshd; running as uid {os.geteuid()}"
    missing = _no_tool("unshare")
    if missing:
        return missing
    err = _try(["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                IN_PRIVATE_RUN, "fvprobe", "true"], 30, "unshare --uts --mount ...")
    return f"cannot mount a private /run ({err}): needs CAP_SYS_ADMIN" if err else None


@functools.lru_cache(maxsize=None)
def sshd_missing() -> Optional[str]:
    """Why sshd cannot run a simulated host here, or None. Needs a private /run (root)."""
    missing = _no_tool("ssh", "ssh-keygen")
    if missing:
        return missing
    if not os.access(SSHD, os.X_OK):
        return f"needs openssh-server ({SSHD} is missing; {INSTALL})"
    missing = private_run_missing()
    if missing:
        return missing
    with tempfile.TemporaryDirectory(prefix="fvprobe-") as tmp:
        work = Path(tmp)
        err = _try(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                    str(work / "host_key")], 30)
        if err:
            return f"ssh-keygen cannot make a key ({err})"
        (work / "authorized_keys").write_text("")
        (work / "sshd_config").write_text(sshd_config_text(work))
        err = _try(["unshare", "--uts", "--mount", "--propagation", "private", "sh", "-c",
                    IN_PRIVATE_RUN, "fvprobe", SSHD, "-t", "-f", str(work / "sshd_config")], 30,
                   f"{SSHD} -t")
    return f"sshd rejects the simulated hosts' configuration ({err})" if err else None


def _mpirun() -> List[str]:
    # --allow-run-as-root is what the tests (and the MPI operator's launcher) pass as root;
    # it changes nothing for another user.
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "1"]


@functools.lru_cache(maxsize=None)
def mpirun_missing() -> Optional[str]:
    """Why Open MPI's mpirun cannot start a process here, or None."""
    if shutil.which("mpirun") is None:
        return f"needs Open MPI's mpirun, which is not installed (openmpi-bin; {INSTALL})"
    err = _try([*_mpirun(), "true"])
    return f"Open MPI's mpirun cannot start a process ({err})" if err else None


@functools.lru_cache(maxsize=None)
def mpi4py_missing() -> Optional[str]:
    """Why a rank under mpirun cannot use this Python's mpi4py, or None."""
    missing = mpirun_missing()
    if missing:
        return missing
    err = _try([*_mpirun(), sys.executable, "-c",
                "from mpi4py import MPI; assert MPI.COMM_WORLD.Get_size() == 1"])
    return (f"mpi4py cannot be used under mpirun ({err}); make setup installs it "
            "(scripts/setup_venv.sh)") if err else None


@functools.lru_cache(maxsize=None)
def java_missing() -> Optional[str]:
    """Why no Java runs here for Spark, or None: ``$JAVA_HOME/bin/java`` where JAVA_HOME is
    set (as Spark itself picks it), else ``java`` on the path."""
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if java is None:
        return f"Spark needs Java, and no java is installed ({INSTALL})"
    err = _try([java, "-version"])
    return f"Spark needs Java, and it does not run ({err})" if err else None


@functools.lru_cache(maxsize=None)
def cxx_half_missing() -> Optional[str]:
    """Why torch cannot build the backend's C++ half here (``ferrovod/torch/_front.cpp``), or
    None: it needs a C++ compiler and this Python's headers, as ``make setup`` says when it
    skips the build."""
    if shutil.which("c++") is None:
        return "no C++ compiler to build the backend's C++ half"
    import sysconfig

    headers = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(headers, "Python.h")):
        return f"no Python.h in {headers} to build the backend's C++ half"
    return None
