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
Elastic jobs (``--min-np``, ``--host-discovery-script``) are run by :mod:`.elastic`.
"""

from __future__ import annotations

import argparse
import os
import socket
import secrets
import shlex
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import Any, BinaryIO, Callable, Dict, List, NoReturn, Optional, Sequence, TextIO, Tuple

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
from .common.util import config_parser
from .cpus import bind_setting, bind_worker, describe as describe_cpus
from .elastic.constants import WORKER_FAILURE_MESSAGE
from .flags import PROG, build_parser
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
from .torch_store import TorchStore
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

__all__ = ["Exchange", "LaunchError", "LaunchPlan", "build_parser", "main", "parse_args",
           "plan_job", "run_commandline", "run_job"]

GRACE_S = 3.0
# After a worker fails, how long the others may take to exit by themselves (and print the error
# their ranks raise about it) before they are terminated.
SETTLE_S = 2.0

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
        else:
            spec.cpus = bind_worker(env)
        specs.append(spec)
    return specs


def _log_plan(
    plan: LaunchPlan, specs: List[WorkerSpec], first_env: Dict[str, str],
    base_env: Dict[str, str], log: Callable[[str], None]
) -> None:
    for note in plan.notes:
        log(f"note: {note}")
    for slot, spec in zip(plan.slots, specs):
        log(
            f"rank {slot.rank}: host {slot.hostname}, "
            f"local rank {slot.local_rank}/{slot.local_size}, "
            f"cross rank {slot.cross_rank}/{slot.cross_size}"
            + (" (over ssh)" if slot.hostname in plan.remote else "")
            + ("" if spec.cpus is None else f", cpus {describe_cpus(spec.cpus)}")
        )
    here = [spec for slot, spec in zip(plan.slots, specs) if slot.hostname not in plan.remote]
    if any(spec.cpus is not None for spec in here):
        log("binding: each worker to its share of its host's cores (by default where each "
            "gets a whole physical core; --no-bind-cores or FERROVOD_BIND_CORES=0 turns it off)")
    elif here:
        off = bind_setting(first_env) == "off"
        log("binding: none " + ("(--no-bind-cores or FERROVOD_BIND_CORES=0)" if off else
                                "(fewer physical cores than workers on this host; --bind-cores "
                                "binds them all the same)"))
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


def _report(outcome: JobOutcome, plan: LaunchPlan, log: Callable[[str], None]) -> Optional[str]:
    """Logs which worker ended the job; returns why it failed (None: it did not)."""
    if outcome.failed_rank is None or outcome.failed_returncode is None:
        return None if outcome.exit_code == 0 else f"the job ended with {outcome.exit_code}"
    slot = plan.slots[outcome.failed_rank]
    name, status = f"rank {slot.rank} (on {slot.hostname})", describe_status(
        outcome.failed_returncode)
    log(
        "one or more processes exited with non-zero status, so the job was stopped; the first was "
        f"{name} with {status}"
    )
    return WORKER_FAILURE_MESSAGE.format(name=name, status=status)


def launch(
    plan: LaunchPlan, stdout: BinaryIO, stderr: BinaryIO, adopt_orphans: bool = False
) -> int:
    """Runs the job described by ``plan``; returns the launcher's exit status.

    ``adopt_orphans`` makes this process a child subreaper that reaps every child: right for
    the ``ferrovodrun`` process, wrong inside a program that has children of its own.
    """
    return run_job(plan, stdout, stderr, adopt_orphans)[0]


@dataclass
class Exchange:
    """What a caller of :func:`run_job` shares with the workers through the job's rendezvous
    store (``ferrovod.run`` hands them its function this way and takes their results back):
    ``put`` is set before any worker starts, and ``collect`` is called with a client of the
    store once the workers have ended."""

    put: Dict[str, bytes] = field(default_factory=dict)
    collect: Optional[Callable[[Any], None]] = None


def run_job(
    plan: LaunchPlan, stdout: BinaryIO, stderr: BinaryIO, adopt_orphans: bool = False,
    exchange: Optional[Exchange] = None,
) -> Tuple[int, Optional[str]]:
    """:func:`launch`, also returning why the job failed (None when it exited 0)."""
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
    # Signal handlers can only be set from the main thread; a job run from another thread
    # (ferrovod.runner.run in a thread of its own) is stopped by its caller.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = _install_signal_handlers(supervisor) if main_thread else {}
    server = None
    torch_store: Optional[TorchStore] = None
    try:
        if plan.elastic is not None:
            # Discovery may bring hosts of other machines at any time: listen on every
            # interface (every connection proves the job secret first).
            server, addr = _start_rendezvous(secret, log, "0.0.0.0")
            if addr is not None:
                addr = "127.0.0.1:" + addr.rsplit(":", 1)[1]
            if server is None:
                raise LaunchError("an elastic job needs the native rendezvous store", exit_code=1)
            _put(server, exchange)
            return launch_elastic(plan, plan.elastic, supervisor, server,
                                  JobInfo(addr, secret.hex(), plan.tunables), base_env, log)
        reports = _check_remote(plan, log) if plan.remote else {}
        _check_local_iface(plan)
        listen = "0.0.0.0" if plan.remote else "127.0.0.1"
        server, addr = _start_rendezvous(secret, log, listen)
        _put(server, exchange)
        # torch's env:// (init_process_group with no arguments) finds a store the launcher
        # holds, unless the user pointed torch elsewhere.
        if "MASTER_ADDR" not in base_env and addr is not None:
            torch_store = TorchStore(listen, float(plan.tunables["FERROVOD_START_TIMEOUT"]), log)
        job = JobInfo(rendezvous_addr=addr, secret_hex=secret.hex(), tunables=plan.tunables,
                      torch_store_port=torch_store.port if torch_store is not None else None)
        jobs = {slot.hostname: job for slot in plan.slots}
        if plan.remote and addr is not None:
            port = addr.rsplit(":", 1)[1]
            for host, host_addr in _rendezvous_by_host(plan, reports, port).items():
                jobs[host] = replace(job, rendezvous_addr=host_addr)
        specs = _worker_specs(plan, jobs, base_env)
        if plan.verbose:
            _log_plan(plan, specs, worker_env(base_env, plan.slots[0],
                                              jobs[plan.slots[0].hostname]), base_env, log)
        try:
            supervisor.start(specs)
        except SpawnError as exc:
            log(str(exc))
            return exc.exit_code, str(exc)
        outcome = supervisor.run()
        return outcome.exit_code, _report(outcome, plan, log)
    except LaunchError as exc:
        log(f"error: {exc}")
        return exc.exit_code, str(exc)
    finally:
        if server is not None:
            if exchange is not None and exchange.collect is not None:
                from ferrovod._core import StoreClient  # type: ignore[import-not-found,unused-ignore]

                exchange.collect(StoreClient(f"127.0.0.1:{server.addr.rsplit(':', 1)[1]}",
                                             secret, 10.0))
            server.close()
        if torch_store is not None:
            torch_store.close()
        _restore_signal_handlers(previous)


def _put(server: Any, exchange: Optional[Exchange]) -> None:
    if exchange is not None:
        if server is None:
            raise LaunchError("sharing values with the workers needs the native rendezvous "
                              "store", exit_code=1)
        for key, value in exchange.put.items():
            server.set(key, value)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """``ferrovodrun``'s flags parsed from ``argv`` (default: ``sys.argv[1:]``), with
    ``--config-file``'s settings under the flags given (Horovod's
    ``horovod.runner.launch.parse_args``). A bad file raises ``ValueError`` naming the key."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config_parser.apply_config_file(args, parser)
    return args


class _TextAsBinary:
    """A text stream (one pytest or a notebook put in place of ``sys.stdout``) taking bytes."""

    def __init__(self, text: TextIO) -> None:
        self._text = text

    def write(self, data: bytes) -> int:
        self._text.write(data.decode("utf-8", "replace"))
        return len(data)

    def flush(self) -> None:
        self._text.flush()


def _binary(stream: TextIO) -> BinaryIO:
    buffer = getattr(stream, "buffer", None)
    return buffer if buffer is not None else _TextAsBinary(stream)  # type: ignore[return-value]


def _run(args: argparse.Namespace, elastic: Optional[bool] = None,
         exchange: Optional[Exchange] = None) -> None:
    """Runs the job ``args`` describe from this process, its output on this process's
    ``sys.stdout``/``sys.stderr``, as Horovod's ``horovod.runner.launch._run`` does: returns
    once every worker succeeded; raises ``ValueError`` for flags the launcher refuses (and
    when ``elastic`` is given and the job is not of that kind) and ``RuntimeError`` saying why
    the job failed. ``exchange``: see :func:`run_job`."""
    try:
        plan = plan_job(args)
    except LaunchError as exc:
        raise ValueError(str(exc)) from None
    if elastic is not None and (plan.elastic is not None) != elastic:
        raise ValueError("not an elastic job: give --min-np or --host-discovery-script"
                         if elastic else "an elastic job: drop --min-np and "
                         "--host-discovery-script")
    code, error = run_job(plan, _binary(sys.stdout), _binary(sys.stderr), exchange=exchange)
    if code != 0:
        raise RuntimeError(error or f"the job failed with exit status {code}")


def _run_elastic(args: argparse.Namespace) -> None:
    """:func:`_run` for an elastic job (Horovod's ``_run_elastic``)."""
    _run(args, elastic=True)


def _run_static(args: argparse.Namespace) -> None:
    """:func:`_run` for a job of fixed size (Horovod's ``_run_static``)."""
    _run(args, elastic=False)


def run_commandline(argv: Optional[Sequence[str]] = None, adopt_orphans: bool = False) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs; returns the exit status.

    ``adopt_orphans``: see :func:`launch`; :func:`main` sets it.
    """
    try:
        args = parse_args(argv)
    except config_parser.ConfigError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 2
    if args.check_build:
        return _check_build.check_build(verbose=bool(args.verbose))
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
