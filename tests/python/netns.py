"""Simulated hosts for multi-host tests: Linux network namespaces with real sshd in each.

Each host is a network namespace with one veth link (``eth0``) into a bridge that lives in its
own namespace, so nothing touches the machine's own network. Addresses are in 10.213.8.0/24,
used only between these namespaces; there is no default route. Every host:

* resolves every other host by name (``/etc/netns/<ns>/hosts``, which ``ip netns exec``
  bind-mounts over ``/etc/hosts``);
* runs sshd on port 2222 with key-only root login (the MPI operator's image setup), under its
  own hostname (``unshare --uts``) and with a private ``/run`` for sshd's privilege separation;
  its sessions read a plain rc that sets the harness's ``PATH`` in place of the user's
  ``~/.bashrc``;
* optionally has an ``/etc/ssh/ssh_config`` of its own (port 2222, the test key, no host key
  checks), which is how the MPI operator's images make plain ``ssh host`` work.

Nothing is written to the machine's ``~/.ssh``. :meth:`Cluster.close` kills everything running
in the namespaces and removes them. Needs root with ``CAP_SYS_ADMIN`` and ``CAP_NET_ADMIN``,
iproute2, util-linux ``unshare`` and openssh: :func:`missing_tools` tries them once per test
process (capabilities.py) and says why a test module skips.
"""

from __future__ import annotations

import fcntl
import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from capabilities import SSHD, netns_missing, sshd_config_text, sshd_missing

SUBNET = "10.213.8"
SSH_PORT = 2222
# Held by a cluster from its first put_etc until its close: a directory that put_etc adds to
# the machine's /etc is shared by every test run here, so a second run (another checkout's
# suite) must not see it half-made or remove it under a launcher still starting.
ETC_LOCK = "/run/lock/ferrovod-netns-etc.lock"


def missing_tools() -> Optional[str]:
    """Why simulated hosts with sshd cannot run here, or None when they can: a throwaway
    namespace pair and sshd's configuration are tried, once per process (capabilities.py)."""
    return netns_missing() or sshd_missing()


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


class Host:
    """One simulated host: its name (what other hosts resolve; may be a pod's FQDN such as
    ``job-worker-0.job.default.svc``), hostname (the name's first label, as a pod's), namespace
    and address."""

    def __init__(self, name: str, ns: str, ip: str) -> None:
        self.name = name
        self.hostname = name.split(".", 1)[0]
        self.ns = ns
        self.ip = ip

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.ip})"


class Cluster:
    """A set of hosts; use as a context manager."""

    def __init__(self, names: Sequence[str], workdir: Path, operator_ssh_config: bool = False):
        tag = uuid.uuid4().hex[:6]
        self.tag = tag
        self.workdir = workdir
        self.bridge_ns = f"fvbr{tag}"
        self.hosts: Dict[str, Host] = {
            name: Host(name, f"fv{i}h{tag}", f"{SUBNET}.{i + 1}") for i, name in enumerate(names)
        }
        self.key = workdir / "id_key"
        self.operator_ssh_config = operator_ssh_config
        self._sshd: List[subprocess.Popen] = []
        self._etc_dirs: List[Path] = []
        self._created_dirs: List[Path] = []
        self._etc_lock: Optional[int] = None

    # -- setup ------------------------------------------------------------------------------

    def __enter__(self) -> "Cluster":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        _sh("ip", "netns", "add", self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.ip} {h.name}" + (f" {h.hostname}\n" if h.hostname != h.name else "\n")
            for h in self.hosts.values()
        )
        for i, host in enumerate(self.hosts.values()):
            _sh("ip", "netns", "add", host.ns)
            peer = f"p{i}{self.tag}"
            _sh("ip", "link", "add", "eth0", "netns", host.ns, "type", "veth",
                "peer", "name", peer, "netns", self.bridge_ns)  # fmt: skip
            _sh("ip", "-n", self.bridge_ns, "link", "set", peer, "master", "br0", "up")
            _sh("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
            _sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", host.ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / host.ns
            self._etc_dirs.append(etc)
            etc.mkdir(parents=True)
            (etc / "hosts").write_text(hosts_file)
            (etc / "hostname").write_text(host.hostname + "\n")
            if self.operator_ssh_config:
                (etc / "ssh").mkdir()
                (etc / "ssh" / "ssh_config").write_text(self._client_config())
        self._write_keys()
        for host in self.hosts.values():
            self._start_sshd(host)
        for host in self.hosts.values():
            self._wait_for_sshd(host)

    def _client_config(self) -> str:
        # What the MPI operator's base image puts in /etc/ssh/ssh_config, plus the key it
        # mounts at ~/.ssh/id_rsa (here a file of the test's own).
        return (
            "Host *\n"
            f"    Port {SSH_PORT}\n"
            f"    IdentityFile {self.key}\n"
            "    StrictHostKeyChecking no\n"
            "    UserKnownHostsFile /dev/null\n"
            "    BatchMode yes\n"
            "    LogLevel ERROR\n"
        )

    def _write_keys(self) -> None:
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.workdir / "host_key"))
        (self.workdir / "authorized_keys").write_text((self.workdir / "id_key.pub").read_text())
        (self.workdir / "sshd_config").write_text(sshd_config_text(self.workdir, SSH_PORT))

    def _start_sshd(self, host: Host) -> None:
        log = open(self.workdir / f"sshd-{host.name}.log", "wb")
        # Sessions read the harness's own rc, not the user's interactive one: version managers
        # there rehash under a lock on every login, and a dozen hosts' logins at once held it
        # past the launcher's host check (a killed login then left the lock behind, and every
        # later login waited a minute). Cluster images give ssh sessions a plain environment.
        rc = self.workdir / "bashrc"
        rc.write_text(f"export PATH={shlex.quote(os.environ.get('PATH', '/usr/bin:/bin'))}\n")
        script = (
            'hostname "$0" && mount -t tmpfs tmpfs /run && mkdir /run/sshd && '
            'if [ -f "$3" ]; then mount --bind "$2" "$3"; fi && '
            f'exec {SSHD} -D -e -f "$1"'
        )
        self._sshd.append(
            subprocess.Popen(
                ["ip", "netns", "exec", host.ns, "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", script, host.hostname,
                 str(self.workdir / "sshd_config"), str(rc), str(Path.home() / ".bashrc")],  # fmt: skip
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()

    def _wait_for_sshd(self, host: Host, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        probe = (
            "import socket,sys\n"
            "s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)\n"
            "print(s.recv(64).decode().strip())\n"
        )
        while True:
            res = subprocess.run(
                ["ip", "netns", "exec", host.ns, "python3", "-c", probe, host.ip, str(SSH_PORT)],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            if res.returncode == 0 and res.stdout.startswith("SSH-"):
                return
            if time.monotonic() > deadline:
                log = (self.workdir / f"sshd-{host.name}.log").read_text(errors="replace")
                raise RuntimeError(f"sshd on {host.name} did not start: {res.stderr}\n{log}")
            time.sleep(0.1)

    # -- use --------------------------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> List[str]:
        """``argv`` as run on ``host`` (its namespace and its own hostname), not over ssh."""
        return ["ip", "netns", "exec", self.hosts[host].ns, "unshare", "--uts",
                "sh", "-c", 'hostname "$0" && exec "$@"', self.hosts[host].hostname,
                *argv]  # fmt: skip

    def popen(self, host: str, argv: Sequence[str], **kwargs: object) -> subprocess.Popen:
        """Starts ``argv`` on ``host`` (see :meth:`command`)."""
        return subprocess.Popen(self.command(host, argv), **kwargs)  # type: ignore[call-overload]

    def run(self, host: str, argv: Sequence[str], timeout: float, **kwargs: object):
        """Runs ``argv`` on ``host`` to completion; returns the CompletedProcess (text)."""
        return subprocess.run(
            self.command(host, argv), capture_output=True, text=True, timeout=timeout, **kwargs
        )  # type: ignore[call-overload]

    def put_etc(self, host: str, relpath: str, text: str) -> None:
        """Makes ``/etc/<relpath>`` read ``text`` for processes on ``host`` only (e.g. the MPI
        operator's ``/etc/mpi/hostfile`` in its launcher pod).

        ``ip netns exec`` bind-mounts each entry of ``/etc/netns/<ns>/`` over the same name in
        ``/etc``, which must exist: a missing top directory is created empty and removed again
        by :meth:`close`. The cluster holds ``ETC_LOCK`` from here to :meth:`close`, so
        clusters of concurrent test runs on this machine take their turns with such a directory.
        """
        top = relpath.split("/", 1)[0]
        target = Path("/etc") / top
        if "/" in relpath and self._etc_lock is None:
            os.makedirs(os.path.dirname(ETC_LOCK), exist_ok=True)
            self._etc_lock = os.open(ETC_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._etc_lock, fcntl.LOCK_EX)
        if "/" in relpath and not target.exists():
            target.mkdir()
            self._created_dirs.append(target)
        path = Path("/etc/netns") / self.hosts[host].ns / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def shape(self, rate: str, burst: str, latency: str) -> Dict[str, str]:
        """Limits what every host sends on ``eth0`` with a token bucket: ``tc qdisc replace dev
        eth0 root tbf rate <rate> burst <burst> latency <latency>`` in each host's namespace.

        Shaping each host's egress shapes both directions of every host pair. Arguments are in
        tc's syntax (``1gbit``, ``256kb``, ``10ms``); tc names what it rejects. Returns each
        host's ``tc qdisc show dev eth0`` as read back, to show that the limit is in place.
        Undone by :meth:`close` with the namespaces.
        """
        shown = {}
        for name, host in self.hosts.items():
            res = _sh("ip", "netns", "exec", host.ns, "tc", "qdisc", "replace", "dev", "eth0",
                      "root", "tbf", "rate", rate, "burst", burst, "latency", latency,
                      check=False)  # fmt: skip
            if res.returncode != 0:
                raise RuntimeError(f"tc tbf on {name}: {res.stderr.strip() or res.stdout.strip()}")
            res = _sh("ip", "netns", "exec", host.ns, "tc", "qdisc", "show", "dev", "eth0")
            shown[name] = res.stdout.strip()
        return shown

    def mpirun_args(self) -> List[str]:
        """The ``mpirun`` flags with which Open MPI reaches these hosts as its users would run
        it on them: over their sshd, its TCP and out-of-band traffic on ``eth0``, and
        ``mpi_yield_when_idle`` (``-H h:k`` tells Open MPI a host has k cores, so without it
        its ranks busy-poll wherever a host has fewer cores than ranks: 0.2 s per op at 8
        ranks on 2 cores)."""
        return ["--mca", "plm_rsh_args", " ".join(self.ssh_args()),
                "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_tcp_if_include", "eth0",
                "--mca", "oob_tcp_if_include", "eth0"]  # fmt: skip

    def ssh_args(self) -> List[str]:
        """The flags that reach the hosts' sshd (for tools that take ssh options)."""
        return ["-p", str(SSH_PORT), "-i", str(self.key), "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
                "-o", "LogLevel=ERROR"]  # fmt: skip

    def processes(self, host: str, marker: str) -> List[str]:
        """Command lines of the processes in ``host``'s namespace that mention ``marker``."""
        res = _sh("ip", "netns", "pids", self.hosts[host].ns, check=False)
        found = []
        for pid in res.stdout.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            text = cmdline.decode(errors="replace")
            if marker in text:
                found.append(f"{pid}: {text}")
        return found

    def leftovers(self, marker: str, within: float = 10.0) -> Dict[str, List[str]]:
        """Processes mentioning ``marker`` still alive on any host after ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            left = {h: self.processes(h, marker) for h in self.hosts}
            left = {h: p for h, p in left.items() if p}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill_host(self, host: str) -> List[int]:
        """SIGKILLs every process on ``host`` (its sshd too): the host is lost, as to a power
        cut, while its network stays. Returns the pids killed."""
        res = _sh("ip", "netns", "pids", self.hosts[host].ns, check=False)
        killed = []
        for pid in res.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
            except (ProcessLookupError, ValueError):
                pass
        return killed

    # -- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Kills every process in the namespaces and removes them and their /etc files."""
        for ns in [h.ns for h in self.hosts.values()] + [self.bridge_ns]:
            res = _sh("ip", "netns", "pids", ns, check=False)
            for pid in res.stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for proc in self._sshd:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        for ns in [h.ns for h in self.hosts.values()] + [self.bridge_ns]:
            _sh("ip", "netns", "del", ns, check=False)
        for etc in self._etc_dirs:
            shutil.rmtree(etc, ignore_errors=True)
        for made in self._created_dirs:
            try:
                made.rmdir()
            except OSError:
                pass
        if self._etc_lock is not None:
            os.close(self._etc_lock)
            self._etc_lock = None

