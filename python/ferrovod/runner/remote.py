"""The launcher's side of multi-host jobs: ssh command lines, host checks, forwarded environment.

A remote host's workers are started by one ``ssh <host> <python> -m
ferrovod.runner.remote_agent``; the agent (:mod:`.remote_agent`) reads their command lines,
environments and working directory as one JSON line on stdin, so neither the secret nor
quoting ever meets a remote shell, sends their output and exits back as frames, and stops them
when that stdin closes. ``<python>`` is the launcher's own interpreter path:
hosts are expected to have the same installation at the same path (a shared file system, or one
container image), as horovodrun expects of its task services.

ssh runs with ``BatchMode=yes`` (a missing key fails instead of prompting),
``StrictHostKeyChecking=no`` and ``UserKnownHostsFile=/dev/null`` (cluster hosts and pods are
re-created under the same names with new keys; this is what the MPI operator's images do) and
``LogLevel=ERROR`` (no "Permanently added" line in every job's output).
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .worker_env import SECRET_VAR

if TYPE_CHECKING:
    from .supervisor import WorkerSpec

__all__ = [
    "RemoteStart",
    "over_ssh",
    "session_request",
    "HostReport",
    "Ssh",
    "check_hosts",
    "format_host_errors",
    "forwarded_env",
    "parse_exports",
    "rendezvous_host",
]

AGENT_MODULE = "ferrovod.runner.remote_agent"

# Variables that describe the launcher's own login session or machine: a remote host has its
# own (horovodrun skips the same, and CUDA_VISIBLE_DEVICES, which is per machine).
_NOT_FORWARDED = re.compile(
    r"^(BASH_FUNC_.*|OLDPWD|PWD|HOSTNAME|SHLVL|_|HOME|USER|LOGNAME|MAIL|SHELL|TERM|TMUX.*|"
    r"SSH_.*|DISPLAY|XDG_.*|.*CUDA_VISIBLE_DEVICES|FERROVOD_WATCHDOG)$"
)


@dataclass(frozen=True)
class Ssh:
    """How to reach the hosts: port, identity file, extra options, connect timeout."""

    port: Optional[int] = None
    identity: Optional[str] = None
    extra: Tuple[str, ...] = ()
    connect_timeout: int = 10

    def argv(self, host: str, remote: Sequence[str]) -> List[str]:
        """The ssh command line that runs ``remote`` (quoted for the remote shell) on ``host``."""
        cmd = [
            "ssh",
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR",
            "-o", f"ConnectTimeout={max(1, self.connect_timeout)}",
            # A host that vanishes (power, network) ends its ssh within ~30 s, so the launcher
            # notices even if the engine's own detection did not fire.
            "-o", "ServerAliveInterval=10",
            "-o", "ServerAliveCountMax=3",
        ]  # fmt: skip
        if self.port is not None:
            cmd += ["-p", str(self.port)]
        if self.identity is not None:
            cmd += ["-i", self.identity]
        cmd += list(self.extra)
        cmd += [_ssh_host(host), shlex.join(list(remote))]
        return cmd


def _ssh_host(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


@dataclass
class HostReport:
    """What one host said (or why it said nothing) when the launcher checked it."""

    host: str
    error: Optional[str] = None
    launcher_ip: Optional[str] = None
    info: Dict[str, Any] = field(default_factory=dict)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _check_one(
    host: str, ssh: Ssh, python: str, iface: Optional[str], cwd: str, timeout: float
) -> HostReport:
    remote = [python, "-m", AGENT_MODULE, "--check", "--cwd", cwd]
    if iface is not None:
        remote += ["--iface", iface]
    try:
        done = subprocess.run(
            ssh.argv(host, remote),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return HostReport(host, error=f"no answer over ssh within {timeout:.0f} s")
    except OSError as exc:
        return HostReport(host, error=f"cannot run ssh: {exc.strerror or exc}")
    if done.returncode == 255:
        why = _last_line(done.stderr) or "ssh failed"
        return HostReport(host, error=f"unreachable over ssh: {why}")
    if done.returncode == 127:
        return HostReport(host, error=f"{python} is not installed there")
    try:
        info = json.loads(_last_line(done.stdout))
    except ValueError:
        why = _last_line(done.stderr) or f"exit code {done.returncode}"
        return HostReport(host, error=f"ferrovod's host check failed: {why}")
    report = HostReport(host, error=info.get("error"), info=info)
    fields = str(info.get("ssh_connection", "")).split()
    if fields:
        report.launcher_ip = fields[0]
    return report


def check_hosts(
    hosts: Sequence[str], ssh: Ssh, python: str, iface: Optional[str], cwd: str, timeout: float
) -> Dict[str, HostReport]:
    """Checks every host at once: reachable over ssh, ferrovod importable, ``cwd`` present,
    ``iface`` present (when given). Returns each host's report; nothing is started."""
    reports: Dict[str, HostReport] = {}
    lock = threading.Lock()

    def run(host: str) -> None:
        report = _check_one(host, ssh, python, iface, cwd, timeout)
        with lock:
            reports[host] = report

    threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return reports


def format_host_errors(reports: Mapping[str, HostReport], order: Sequence[str]) -> Optional[str]:
    """One message naming every host that failed its check, or None when all passed."""
    bad = [reports[h] for h in order if reports[h].error is not None]
    if not bad:
        return None
    lines = [f"cannot start the job on {len(bad)} of {len(order)} remote host(s):"]
    lines += [f"  {r.host}: {r.error}" for r in bad]
    return "\n".join(lines)


def rendezvous_host(reports: Mapping[str, HostReport], host: str) -> str:
    """The launcher's address as ``host`` reaches it (from SSH_CONNECTION), in URL form."""
    report = reports[host]
    ip = report.launcher_ip or _route_source(host)
    try:
        if ipaddress.ip_address(ip).version == 6:
            return f"[{ip}]"
    except ValueError:
        pass
    return ip


def _route_source(host: str) -> str:
    """This machine's source address towards ``host`` (no packet is sent)."""
    target = socket.getaddrinfo(_ssh_host(host), 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(target[0], socket.SOCK_DGRAM) as s:
        s.connect(target[4])
        return str(s.getsockname()[0])


def parse_exports(values: Optional[Sequence[str]], environ: Mapping[str, str]) -> Tuple[
    Dict[str, str], List[str]
]:
    """``-x VAR`` / ``-x VAR=value`` flags (as mpirun's) -> (variables, warnings).

    ``VAR=value`` sets the variable on every worker; ``VAR`` forwards the launcher's value,
    even for a name that is not forwarded by default. A ``VAR`` the launcher does not have is
    a warning, as with mpirun.
    """
    exports: Dict[str, str] = {}
    warnings: List[str] = []
    for item in values or ():
        name, sep, value = item.partition("=")
        if not name or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
            raise ValueError(f"-x {item!r}: expected VAR or VAR=value")
        if sep:
            exports[name] = value
        elif name in environ:
            exports[name] = environ[name]
        else:
            warnings.append(f"-x {name}: not set in the launcher's environment; not forwarded")
    return exports, warnings


def forwarded_env(
    env: Mapping[str, str], exports: Mapping[str, str], computed: Sequence[str] = ()
) -> Dict[str, str]:
    """The part of a worker's environment sent to a remote host.

    Everything except what describes the launcher's own session or machine (see
    ``_NOT_FORWARDED``) and the ``computed`` names (per-host values the agent works out
    there); ``exports`` (``-x``) always travel.
    """
    out = {
        k: v for k, v in env.items() if not _NOT_FORWARDED.match(k) and k not in computed
    }
    out.update(exports)
    return out


def agent_argv(python: Optional[str] = None) -> List[str]:
    """The command the ssh session runs on a remote host to start that host's workers."""
    return [python or sys.executable, "-m", AGENT_MODULE]


@dataclass(frozen=True)
class RemoteStart:
    """How a worker starts on another host: the ssh command line that runs the host's agent
    (the same for every worker of the host: they share one session) and this worker's entry
    in the agent's request."""

    ssh_argv: Tuple[str, ...]
    cwd: str
    entry: Dict[str, Any]


def over_ssh(spec: "WorkerSpec", command: Sequence[str], ssh: Ssh, exports: Mapping[str, str],
             local_size: int, env: Dict[str, str], base_env: Mapping[str, str],
             computed: Sequence[str], cwd: str) -> None:
    """Makes ``spec`` start its worker on its host through the host's agent, in the one ssh
    session of that host's workers (the secret travels on the session's stdin, never on a
    command line)."""
    spec.remote = RemoteStart(
        ssh_argv=tuple(ssh.argv(spec.hostname, agent_argv())),
        cwd=cwd,
        entry={
            "rank": spec.rank,
            "argv": list(command),
            "env": forwarded_env(env, exports, computed),
            "local_size": local_size,
        },
    )
    spec.env = {k: v for k, v in base_env.items() if k != SECRET_VAR}
    spec.inherit_stdin = False


def session_request(starts: Sequence[RemoteStart]) -> bytes:
    """The JSON line one host's agent reads: the workers its session starts."""
    request = {"cwd": starts[0].cwd, "workers": [s.entry for s in starts]}
    return (json.dumps(request) + "\n").encode()
