"""``ferrovodrun``'s command line: horovodrun's flags, parsed and checked as they are read."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

from .._defaults import default as engine_default
from . import check_build as _check_build

__all__ = ["PROG", "LOG_LEVELS", "build_parser"]

PROG = "ferrovodrun"
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


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
        "--as-horovod",
        action="store_const",
        const=True,
        default=None,
        help="Let the workers' `import horovod...` give ferrovod's modules (horovod.torch is "
        "ferrovod.torch, ...), for scripts that import Horovod and cannot be edited; "
        "FERROVOD_AS_HOROVOD=1 on every worker. A Horovod installed beside ferrovod is left "
        "alone.",
    )
    parser.add_argument(
        "--config-file",
        help="A horovodrun YAML config file (params, autotune, timeline, stall_check, "
        "library_options, logging, elastic); flags given on the command line win over it.",
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
    group.add_argument(
        "--bind-cores",
        action="store_const",
        const=True,
        default=None,
        help="Bind each worker to its share of its host's cores (whole physical cores), even "
        "where some must share one; FERROVOD_BIND_CORES=1. By default workers are bound where "
        "each gets a whole core.",
    )
    group.add_argument(
        "--no-bind-cores",
        dest="bind_cores",
        action="store_const",
        const=False,
        help="Leave workers unbound; FERROVOD_BIND_CORES=0.",
    )
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
                         help="A host may come back LO*2^n s after its n-th failure, at most HI s.")
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
