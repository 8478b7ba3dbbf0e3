"""``ferrovodrun``: launches a ferrovod job on this machine or across hosts (horovodrun's flags).

Usage: ``ferrovodrun -np N [-H host:slots,...|--hostfile FILE] [options] command args...``, or
``python -m ferrovod.runner.launch``.

The launcher checks every remote host first (reachable over ssh, ferrovod installed, the working
directory and network interface present) and names the ones that are not, before anything
starts. Then it creates a random job secret, starts the rendezvous store, starts one worker per
rank with its topology in the environment (over ssh on remote hosts, see :mod:`.remote`),
forwards their output line by line, and ends the job as a whole: the first worker to fail (after
a moment for the others to end by themselves and report it) or a Ctrl-C stops all the others
on every host, and the launcher exits with that worker's status.
Elastic launches are not supported yet.
"""

from __future__ import annotations

import argparse
import os
import socket
import secrets
import shlex
import signal
import sys
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, BinaryIO, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

from .._defaults import default as engine_default
from . import check_build as _check_build
from .hosts import (
    HostInfo,
    HostSpecError,
    SlotInfo,
    get_host_assignments,
    parse_hostfile,
    parse_hosts,
    remote_hosts,
)
from .elastic import ElasticSettings
from .elastic import launch as launch_elastic
from .elastic import settings_from as elastic_settings
from .output import Sink, rank_output_dir
from .remote import (
    HostReport,
    Ssh,
    check_hosts,
    format_host_errors,
    over_ssh,
    parse_exports,
    rendezvous_host,
)
from .supervisor import JobOutcome, SpawnError, Supervisor, WorkerSpec, describe_status
from .worker_env import (
    THREAD_VARS,
    JobInfo,
    slot_env,
    start_timeout,
    tunable_env,
    visible_env,
    worker_env,
)

__all__ = ["LaunchError", "LaunchPlan", "build_parser", "main", "plan_job", "run_commandline"]

PROG = "ferrovodrun"
GRACE_S = 3.0
# After a worker fails, how long the others may take to exit by themselves (and print the error
# their ranks raise about it) before they are terminated.
SETTLE_S = 2.0
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

# Flags accepted for horovodrun compatibility that change nothing here:
# (argparse dest, flag as the user writes it).
_IGNORED_FLAGS: List[Tuple[str, str]] = [
    ("use_gloo", "--gloo"),
    ("use_mpi", "--mpi"),
    ("use_jsrun", "--jsrun"),
    ("tcp_flag", "--tcp"),
    ("disable_cache", "--disable-cache"),
    ("mpi_args", "--mpi-args"),
    ("binding_args", "--binding-args"),
    ("num_nccl_streams", "--num-nccl-streams"),
    ("thread_affinity", "--thread-affinity"),
    ("mpi_threads_disable", "--mpi-threads-disable"),
    ("hierarchical_allgather", "--[no-]hierarchical-allgather"),
    ("torus_allreduce", "--[no-]torus-allreduce"),
    ("autotune_bayes_opt_max_samples", "--autotune-bayes-opt-max-samples"),
    ("autotune_gaussian_process_noise", "--autotune-gaussian-process-noise"),
]

_ELASTIC_FLAGS: List[Tuple[str, str]] = [
    ("min_num_proc", "--min-np"),
    ("max_num_proc", "--max-np"),
    ("slots", "--slots-per-host"),
    ("elastic_timeout", "--elastic-timeout"),
    ("reset_limit", "--reset-limit"),
    ("cooldown_range", "--blacklist-cooldown-range"),
    ("host_discovery_script", "--host-discovery-script"),
]


class LaunchError(Exception):
    """A launch that cannot go ahead; ``exit_code`` is 2 for usage errors."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class LaunchPlan:
    """Everything decided before any process starts."""

    command: List[str]
    slots: List[SlotInfo]
    tunables: Dict[str, str]
    output_dir: Optional[str]
    timestamp: bool
    verbose: bool
    notes: List[str]
    remote: List[str] = field(default_factory=list)  # hosts reached over ssh, in order
    ssh: Ssh = field(default_factory=Ssh)
    exports: Dict[str, str] = field(default_factory=dict)  # -x
    iface: Optional[str] = None
    elastic: Optional[ElasticSettings] = None  # an elastic job: its slots come from the driver


# -- argument parsing -----------------------------------------------------------------------


def _non_negative(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = _non_negative(kind)(text)
        if value == 0:
            raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


_positive_int = _positive(int)


def _port(text: str) -> int:
    value = int(_positive_int(text))
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (1-65535), got {text}")
    return value


def _log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid choice {text!r} (choose from {', '.join(LOG_LEVELS)})"
        )
    return level


class _VersionAction(argparse.Action):
    """Prints the version lazily, so the common path never looks it up."""

    def __init__(
        self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any
    ) -> None:
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Optional[str] = None,
    ) -> NoReturn:
        sys.stdout.write(f"{_check_build.ferrovod_version()}\n")
        parser.exit()


class _NicAction(argparse.Action):
    """``--network-interface(s)``: comma-separated, repeatable; kept in order, once each."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: Optional[str] = None,
    ) -> None:
        current = list(getattr(namespace, self.dest, None) or ())
        current += [v for v in str(values).split(",") if v and v not in current]
        setattr(namespace, self.dest, current)


def _bool_pair(
    group: argparse._ActionsContainer, name: str, dest: str, hidden_negative: bool = False
) -> None:
    """``--NAME`` / ``--no-NAME`` storing True/False into ``dest`` (None when neither is given)."""
    pair = group.add_mutually_exclusive_group()
    pair.add_argument(f"--{name}", dest=dest, action="store_const", const=True, default=None)
    pair.add_argument(
        f"--no-{name}",
        dest=dest,
        action="store_const",
        const=False,
        help=argparse.SUPPRESS if hidden_negative else None,
    )


def _add_general(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-v", "--version", action=_VersionAction, help="Print the version and exit."
    )
    parser.add_argument(
        "-np", "--num-proc", dest="num_proc", type=_positive_int, help="Total number of processes."
    )
    parser.add_argument(
        "-cb",
        "--check-build",
        action="store_true",
        help="Show the frameworks and backends available, then exit.",
    )
    parser.add_argument(
        "--disable-cache",
        action="store_true",
        default=None,
        help="Accepted for horovodrun compatibility.",
    )
    parser.add_argument(
        "--start-timeout",
        type=_positive_int,
        help="Seconds the job has to start (default: FERROVOD_START_TIMEOUT or "
        f"HOROVOD_START_TIMEOUT, else {engine_default('FERROVOD_START_TIMEOUT')}).",
    )
    parser.add_argument(
        "--network-interfaces",
        dest="nics",
        action=_NicAction,
        help="Network interface the workers communicate over, e.g. eth0 (the first of a "
        "comma-separated list; all are passed to NCCL). Checked on every host before start.",
    )
    parser.add_argument(
        "--network-interface", dest="nics", action=_NicAction, help=argparse.SUPPRESS
    )
    parser.add_argument(
        "--output-filename",
        help="Also write each rank's output to <DIR>/rank.<rank>/stdout and .../stderr.",
    )
    parser.add_argument("--verbose", action="store_true", help="Print what the launcher does.")
    parser.add_argument(
        "--config-file",
        help="A horovodrun YAML config file (not supported yet: ignored with a warning).",
    )
    parser.add_argument(
        "-p", "--ssh-port", type=_port, help="ssh port of the remote hosts."
    )
    parser.add_argument(
        "-i", "--ssh-identity-file", help="ssh private key for the remote hosts."
    )
    parser.add_argument(
        "-x",
        dest="exports",
        action="append",
        metavar="VAR[=VALUE]",
        help="Set VAR=VALUE on every worker, or forward the launcher's VAR to every host (as "
        "mpirun -x). The launcher's environment is forwarded anyway, except variables of its "
        "own session (HOME, SSH_*, CUDA_VISIBLE_DEVICES...).",
    )


def _add_tunables(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "tunable parameters (exported to the workers only when given)"
    )
    group.add_argument(
        "--fusion-threshold-mb", type=_non_negative(int), help="Fusion buffer size in MiB."
    )
    group.add_argument(
        "--cycle-time-ms", type=_non_negative(float), help="Cycle time in milliseconds."
    )
    group.add_argument("--cache-capacity", type=_non_negative(int), help="Response cache capacity.")
    _bool_pair(group, "hierarchical-allreduce", "hierarchical_allreduce")
    _bool_pair(group, "hierarchical-allgather", "hierarchical_allgather")
    _bool_pair(group, "torus-allreduce", "torus_allreduce")
    _bool_pair(group, "autotune", "autotune", hidden_negative=True)
    group.add_argument("--autotune-log-file")
    group.add_argument("--autotune-warmup-samples", type=_non_negative(int))
    group.add_argument("--autotune-steps-per-sample", type=_non_negative(int))
    group.add_argument("--autotune-bayes-opt-max-samples", type=_non_negative(int))
    group.add_argument("--autotune-gaussian-process-noise", type=_non_negative(float))
    group.add_argument("--timeline-filename", help="Write a Chrome-trace timeline to this file.")
    _bool_pair(group, "timeline-mark-cycles", "timeline_mark_cycles", hidden_negative=True)
    stall = group.add_mutually_exclusive_group()
    stall.add_argument(
        "--no-stall-check", dest="no_stall_check", action="store_const", const=True, default=None
    )
    stall.add_argument(
        "--stall-check",
        dest="no_stall_check",
        action="store_const",
        const=False,
        help=argparse.SUPPRESS,
    )
    group.add_argument("--stall-check-warning-time-seconds", type=_positive_int)
    group.add_argument(
        "--stall-check-shutdown-time-seconds",
        type=_non_negative(int),
        help="Fail a tensor stalled this long on every rank (0: never); above the warning time.",
    )
    _bool_pair(group, "mpi-threads-disable", "mpi_threads_disable", hidden_negative=True)
    group.add_argument("--mpi-args")
    group.add_argument("--tcp", dest="tcp_flag", action="store_true", default=None)
    group.add_argument("--binding-args")
    group.add_argument("--num-nccl-streams", type=_non_negative(int))
    group.add_argument("--thread-affinity", type=_non_negative(int))
    group.add_argument(
        "--gloo-timeout-seconds",
        type=_positive_int,
        help="Seconds without progress before an op fails.",
    )


def _add_logging(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument("--log-level", type=_log_level, help=f"One of {', '.join(LOG_LEVELS)}.")
    stamp = group.add_mutually_exclusive_group()
    stamp.add_argument(
        "--log-with-timestamp",
        dest="log_with_timestamp",
        action="store_const",
        const=True,
        default=None,
        help=argparse.SUPPRESS,
    )
    stamp.add_argument(
        "--log-without-timestamp",
        dest="log_with_timestamp",
        action="store_const",
        const=False,
        help="Hide the time in ferrovod's log lines.",
    )
    stamp.add_argument(
        "--log-hide-timestamp",
        dest="log_with_timestamp",
        action="store_const",
        const=False,
        help=argparse.SUPPRESS,
    )
    stamp.add_argument(
        "--no-log-hide-timestamp",
        dest="log_with_timestamp",
        action="store_const",
        const=True,
        help=argparse.SUPPRESS,
    )
    stamp.add_argument(
        "-prefix-timestamp",
        "--prefix-output-with-timestamp",
        dest="prefix_output_with_timestamp",
        action="store_true",
        help="Prefix every forwarded output line with the time.",
    )


def _add_elastic_and_hosts(parser: argparse.ArgumentParser) -> None:
    elastic = parser.add_argument_group(
        "elastic (workers may leave and join; given --min-np or --host-discovery-script)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_num_proc", type=_positive_int,
                         help="Fewest workers the job goes on with (default: -np).")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_num_proc", type=_positive_int,
                         help="Most workers the job grows to (default: every slot).")
    elastic.add_argument("--slots-per-host", dest="slots", type=_positive_int,
                         help="Slots of a host the discovery script prints without a count.")
    elastic.add_argument("--elastic-timeout", type=_positive(float),
                         help="Seconds to wait for enough hosts (default: "
                         "HOROVOD_ELASTIC_TIMEOUT, else 600).")
    elastic.add_argument("--reset-limit", type=_non_negative(int),
                         help="Most membership changes before the job fails.")
    elastic.add_argument("--blacklist-cooldown-range", dest="cooldown_range", type=_positive_int,
                         nargs=2, metavar=("LO", "HI"),
                         help="A failed host may come back after LO*2^(n-1) s, at most HI s.")
    hosts = parser.add_argument_group("hosts").add_mutually_exclusive_group()
    hosts.add_argument(
        "-H", "--hosts", help="Hosts and slots, e.g. localhost:4 (default: localhost:<np>)."
    )
    hosts.add_argument(
        "-hostfile",
        "--hostfile",
        help="File of '<host> slots=<n>' (or '<host>:<n>') lines. Default: the MPI operator's "
        "hostfile named by OMPI_MCA_orte_default_hostfile, when set.",
    )
    hosts.add_argument("--host-discovery-script",
                       help="Prints the available hosts, one host[:slots] per line (elastic).")
    controller = parser.add_argument_group(
        "controller (accepted for horovodrun compatibility)"
    ).add_mutually_exclusive_group()
    controller.add_argument("--gloo", dest="use_gloo", action="store_true", default=None)
    controller.add_argument("--mpi", dest="use_mpi", action="store_true", default=None)
    controller.add_argument("--jsrun", dest="use_jsrun", action="store_true", default=None)


def build_parser() -> argparse.ArgumentParser:
    """The ``ferrovodrun`` argument parser (horovodrun's flags)."""
    # No abbreviations: argparse matches prefixes on every argument before it finds the
    # command, so a worker's own `--log x` would otherwise be refused as ambiguous.
    parser = argparse.ArgumentParser(
        prog=PROG, description="Launch a ferrovod job (horovodrun-compatible).", allow_abbrev=False
    )
    _add_general(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="The command every worker runs.")
    _add_tunables(parser)
    _add_logging(parser)
    _add_elastic_and_hosts(parser)
    return parser


# -- planning -------------------------------------------------------------------------------


# Where MPI launchers are told of a hostfile; the Kubeflow MPI operator sets the first in its
# launcher pod (and HYDRA_HOST_FILE for MPICH).
_HOSTFILE_VARS = ("OMPI_MCA_orte_default_hostfile", "HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE")


def _resolve_hosts(args: argparse.Namespace, environ: Dict[str, str]) -> List[HostInfo]:
    if args.hosts:
        return parse_hosts(args.hosts)
    if args.hostfile:
        return parse_hostfile(args.hostfile)
    for var in _HOSTFILE_VARS:
        path = environ.get(var, "").strip()
        if path:
            hosts = parse_hostfile(path)
            if args.verbose:
                sys.stderr.write(f"{PROG}: hosts from {var}={path}\n")
            return hosts
    if args.num_proc is None:
        raise LaunchError("-np/--num-proc is required (or give the hosts with -H/--hostfile)")
    return [HostInfo("localhost", args.num_proc)]


def _notes(args: argparse.Namespace, remote: List[str]) -> List[str]:
    notes = [
        f"{flag} has no effect in ferrovod; ignored"
        for dest, flag in _IGNORED_FLAGS
        if getattr(args, dest, None) is not None
    ]
    if not remote:
        notes += [
            f"{flag} has no effect without remote hosts; ignored"
            for dest, flag in (("ssh_port", "--ssh-port"), ("ssh_identity_file", "-i"))
            if getattr(args, dest, None) is not None
        ]
    if args.prefix_output_with_timestamp:
        notes.append("prefixing output lines with timestamps")
    return notes


def _check_stall_flags(args: argparse.Namespace, environ: Dict[str, str]) -> None:
    """Refuses a stall shutdown time given on the command line that could never act: the
    workers would refuse it only once started, and ignoring it would leave a stalled job
    hanging."""
    shutdown = getattr(args, "stall_check_shutdown_time_seconds", None)
    if not shutdown:
        return
    flag = f"--stall-check-shutdown-time-seconds {shutdown}"
    disabled, by = args.no_stall_check, "--no-stall-check"
    if disabled is None:
        for name in ("FERROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_DISABLE"):
            text = environ.get(name, "").strip()
            if text:
                # As the engine reads a flag: a positive integer, or true.
                disabled = text in ("true", "True") or (
                    text.lstrip("-").isdigit() and int(text) > 0
                )
                by = f"{name}={text}"
                break
    if disabled:
        raise LaunchError(
            f"{flag} cannot take effect while {by} turns the stall check off; drop one of them"
        )
    check, source = args.stall_check_warning_time_seconds, "--stall-check-warning-time-seconds"
    if check is None:
        check = float(engine_default("FERROVOD_STALL_CHECK_TIME_SECONDS"))
        source = "the default warning time"
        for name in ("FERROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_CHECK_TIME_SECONDS"):
            text = environ.get(name, "").strip()
            if text:
                try:
                    check, source = float(text), name
                except ValueError:
                    return  # the workers refuse it, naming it
                break
    if shutdown <= check:
        raise LaunchError(
            f"{flag} is not above the stall warning time ({source}: {check:g} s): a stalled "
            "tensor would be warned about but never failed; give a longer shutdown time, a "
            "shorter warning time, or 0 to never shut down"
        )


def plan_job(args: argparse.Namespace, environ: Optional[Dict[str, str]] = None) -> LaunchPlan:
    """Validates the parsed flags and decides hosts, ranks and tunables; starts nothing.

    Raises :class:`LaunchError` (exit code 2) for anything the launcher cannot do.
    """
    environ = dict(os.environ) if environ is None else environ
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LaunchError("no command given; usage: ferrovodrun -np N command [args...]")
    elastic: Optional[ElasticSettings] = None
    try:
        if args.min_num_proc is not None or args.host_discovery_script is not None:
            fixed = None
            if args.hosts or args.hostfile:
                fixed = _resolve_hosts(args, environ)
            elastic = elastic_settings(args, fixed, environ)
            slots: List[SlotInfo] = []
            remote: List[str] = []
        else:
            given = [flag for dest, flag in _ELASTIC_FLAGS if getattr(args, dest, None) is not None]
            if given:
                raise LaunchError(f"{', '.join(given)} only apply to an elastic job (give "
                                  "--min-np or --host-discovery-script)")
            hosts = _resolve_hosts(args, environ)
            num_proc = args.num_proc if args.num_proc is not None else sum(h.slots for h in hosts)
            slots = get_host_assignments(hosts, num_proc, num_proc)
            used = {slot.hostname for slot in slots}
            remote = [h for h in remote_hosts(hosts) if h in used]
        _check_stall_flags(args, environ)
        tunables = tunable_env(args, environ)
        exports, warnings = parse_exports(args.exports, environ)
    except (HostSpecError, ValueError) as exc:
        raise LaunchError(str(exc)) from None
    nics = list(args.nics or ())
    if nics:
        tunables["FERROVOD_IFACE"] = nics[0]
        tunables["NCCL_SOCKET_IFNAME"] = ",".join(nics)
    ssh = Ssh(
        port=args.ssh_port,
        identity=args.ssh_identity_file,
        # The MPI operator puts its ssh options (-o ConnectionAttempts=10) here for mpirun;
        # ferrovodrun in the same launcher pod honours them too.
        extra=tuple(shlex.split(environ.get("OMPI_MCA_plm_rsh_args", ""))),
        connect_timeout=min(start_timeout(args.start_timeout, environ), 30),
    )
    return LaunchPlan(
        command=command,
        slots=slots,
        tunables=tunables,
        output_dir=args.output_filename,
        timestamp=bool(args.prefix_output_with_timestamp),
        verbose=bool(args.verbose),
        # An elastic job's hosts come later: its ssh flags are not known to be unused.
        notes=_notes(args, remote if elastic is None else ["(discovered)"]) + warnings,
        remote=remote,
        ssh=ssh,
        exports=exports,
        iface=nics[0] if nics else None,
        elastic=elastic,
    )


# -- launching ------------------------------------------------------------------------------


def _start_rendezvous(
    secret: bytes, log: Callable[[str], None], host: str = "127.0.0.1"
) -> Tuple[Any, Optional[str]]:
    """Starts the native rendezvous store on ``host``; returns (server, "HOST:PORT")."""
    try:
        from ferrovod._core import RendezvousServer  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        log(
            f"warning: the native core is not available ({exc}); the workers get no rendezvous "
            "store, so ferrovod.init() will fail in them"
        )
        return None, None
    from ferrovod import _logging

    # The store runs in this process: its warnings (e.g. a dropped unauthenticated
    # connection) go to the launcher's stderr.
    _logging.configure("warning", False, "ferrovodrun")
    try:
        server = RendezvousServer(secret, host)
    except Exception as exc:  # noqa: BLE001 - any failure here ends the launch cleanly
        raise LaunchError(f"cannot start the rendezvous store: {exc}", exit_code=1) from None
    return server, str(server.addr)


def _open_copies(
    output_dir: Optional[str], slot: SlotInfo
) -> Tuple[Optional[BinaryIO], Optional[BinaryIO]]:
    if output_dir is None:
        return None, None
    rank_dir = rank_output_dir(output_dir, slot.rank, slot.size)
    try:
        os.makedirs(rank_dir, exist_ok=True)
        return open(os.path.join(rank_dir, "stdout"), "wb"), open(
            os.path.join(rank_dir, "stderr"), "wb"
        )
    except OSError as exc:
        raise LaunchError(
            f"cannot write output files under {rank_dir!r}: {exc.strerror or exc}", exit_code=1
        ) from None


def _check_remote(plan: LaunchPlan, log: Callable[[str], None]) -> Dict[str, HostReport]:
    """Checks every remote host before anything starts; raises naming each host that fails."""
    if plan.verbose:
        log(f"checking {len(plan.remote)} remote host(s) over ssh: {', '.join(plan.remote)}")
    reports = check_hosts(
        plan.remote,
        plan.ssh,
        sys.executable,
        plan.iface,
        os.getcwd(),
        timeout=plan.ssh.connect_timeout + 30.0,
    )
    message = format_host_errors(reports, plan.remote)
    if message is not None:
        raise LaunchError(message, exit_code=1)
    return reports


def _check_local_iface(plan: LaunchPlan) -> None:
    if plan.iface is None or all(s.hostname in plan.remote for s in plan.slots):
        return
    names = sorted(name for _, name in socket.if_nameindex())
    if plan.iface not in names:
        raise LaunchError(
            f"no network interface {plan.iface!r} on this host (interfaces: {', '.join(names)})"
        )


def _rendezvous_by_host(
    plan: LaunchPlan, reports: Dict[str, HostReport], port: str
) -> Dict[str, str]:
    """Each host's address of the store: as the host reaches the launcher over ssh. Local
    workers of a multi-host job use the same address (not loopback: their peers on other
    hosts connect to the address they publish, which follows the store's)."""
    by_host = {h: f"{rendezvous_host(reports, h)}:{port}" for h in plan.remote}
    first = by_host[plan.remote[0]]
    for slot in plan.slots:
        by_host.setdefault(slot.hostname, first)
    return by_host


def _worker_specs(
    plan: LaunchPlan, jobs: Dict[str, JobInfo], base_env: Dict[str, str]
) -> List[WorkerSpec]:
    specs = []
    computed = [var for var in THREAD_VARS if var not in base_env]
    cwd = os.getcwd()
    for slot in plan.slots:
        stdout_copy, stderr_copy = _open_copies(plan.output_dir, slot)
        env = worker_env(base_env, slot, jobs[slot.hostname])
        spec = WorkerSpec(
            rank=slot.rank,
            argv=plan.command,
            env=env,
            hostname=slot.hostname,
            stdout_copy=stdout_copy,
            stderr_copy=stderr_copy,
            inherit_stdin=slot.rank == 0,  # as mpirun: only rank 0 reads the launcher's stdin
        )
        if slot.hostname in plan.remote:
            over_ssh(spec, plan.command, plan.ssh, plan.exports, slot.local_size, env, base_env,
                     computed, cwd)
        specs.append(spec)
    return specs


def _log_plan(
    plan: LaunchPlan, first_env: Dict[str, str], base_env: Dict[str, str], log: Callable[[str], None]
) -> None:
    for note in plan.notes:
        log(f"note: {note}")
    for slot in plan.slots:
        log(
            f"rank {slot.rank}: host {slot.hostname}, "
            f"local rank {slot.local_rank}/{slot.local_size}, "
            f"cross rank {slot.cross_rank}/{slot.cross_size}"
            + (" (over ssh)" if slot.hostname in plan.remote else "")
        )
    per_rank = slot_env(plan.slots[0]).keys()
    shared = visible_env(first_env, base_env)
    for key in sorted(set(shared) - set(per_rank)):
        log(f"env {key}={shared[key]}")
    log(f"command: {shlex.join(plan.command)}")


def _install_signal_handlers(supervisor: Supervisor) -> Dict[int, Any]:
    def handler(signum: int, frame: Optional[FrameType]) -> None:
        supervisor.notify_signal(signum)

    previous: Dict[int, Any] = {}
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, handler)
    return previous


def _restore_signal_handlers(previous: Dict[int, Any]) -> None:
    for signum, old in previous.items():
        signal.signal(signum, old)


def _report(outcome: JobOutcome, plan: LaunchPlan, log: Callable[[str], None]) -> None:
    if outcome.failed_rank is None or outcome.failed_returncode is None:
        return
    slot = plan.slots[outcome.failed_rank]
    log(
        "one or more processes exited with non-zero status, so the job was stopped; the first was "
        f"rank {slot.rank} (on {slot.hostname}) with {describe_status(outcome.failed_returncode)}"
    )


def launch(
    plan: LaunchPlan, stdout: BinaryIO, stderr: BinaryIO, adopt_orphans: bool = False
) -> int:
    """Runs the job described by ``plan``; returns the launcher's exit status.

    ``adopt_orphans`` makes this process a child subreaper that reaps every child: right for
    the ``ferrovodrun`` process, wrong inside a program that has children of its own.
    """
    out_sink, err_sink = Sink(stdout), Sink(stderr)

    def log(message: str) -> None:
        err_sink.write(f"{PROG}: {message}\n".encode("utf-8", "replace"))

    base_env = dict(os.environ)
    base_env.update(plan.exports)
    secret = secrets.token_bytes(32)
    supervisor = Supervisor(
        out_sink,
        err_sink,
        log,
        GRACE_S,
        plan.timestamp,
        plan.verbose,
        adopt_orphans,
        settle_s=SETTLE_S,
    )
    previous = _install_signal_handlers(supervisor)
    server = None
    try:
        if plan.elastic is not None:
            # Discovery may bring hosts of other machines at any time: listen on every
            # interface (every connection proves the job secret first).
            server, addr = _start_rendezvous(secret, log, "0.0.0.0")
            if addr is not None:
                addr = "127.0.0.1:" + addr.rsplit(":", 1)[1]
            if server is None:
                raise LaunchError("an elastic job needs the native rendezvous store", exit_code=1)
            return launch_elastic(plan, plan.elastic, supervisor, server,
                                  JobInfo(addr, secret.hex(), plan.tunables), base_env, log)
        reports = _check_remote(plan, log) if plan.remote else {}
        _check_local_iface(plan)
        server, addr = _start_rendezvous(secret, log, "0.0.0.0" if plan.remote else "127.0.0.1")
        job = JobInfo(rendezvous_addr=addr, secret_hex=secret.hex(), tunables=plan.tunables)
        jobs = {slot.hostname: job for slot in plan.slots}
        if plan.remote and addr is not None:
            port = addr.rsplit(":", 1)[1]
            for host, host_addr in _rendezvous_by_host(plan, reports, port).items():
                jobs[host] = replace(job, rendezvous_addr=host_addr)
        specs = _worker_specs(plan, jobs, base_env)
        if plan.verbose:
            _log_plan(plan, worker_env(base_env, plan.slots[0], jobs[plan.slots[0].hostname]),
                      base_env, log)
        try:
            supervisor.start(specs)
        except SpawnError as exc:
            log(str(exc))
            return exc.exit_code
        outcome = supervisor.run()
        _report(outcome, plan, log)
        return outcome.exit_code
    except LaunchError as exc:
        log(f"error: {exc}")
        return exc.exit_code
    finally:
        if server is not None:
            server.close()
        _restore_signal_handlers(previous)


def run_commandline(argv: Optional[Sequence[str]] = None, adopt_orphans: bool = False) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs; returns the exit status.

    ``adopt_orphans``: see :func:`launch`; :func:`main` sets it.
    """
    args = build_parser().parse_args(argv)
    if args.check_build:
        return _check_build.check_build(verbose=bool(args.verbose))
    if args.config_file:
        sys.stderr.write(
            f"{PROG}: warning: --config-file is not supported yet; {args.config_file} is ignored\n"
        )
    try:
        plan = plan_job(args)
    except LaunchError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return exc.exit_code
    return launch(plan, sys.stdout.buffer, sys.stderr.buffer, adopt_orphans=adopt_orphans)


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Console-script entry point of ``ferrovodrun``."""
    sys.exit(run_commandline(argv, adopt_orphans=True))


if __name__ == "__main__":
    main()
