"""The environment each worker starts with: topology, rendezvous, secret and tunables.

The job secret travels only here, never on a command line (where ``ps`` would show it).
Tunable flags export their variable only when given, as horovodrun does, so values the user set
in the environment stay in force otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple

from .._defaults import default as engine_default
from .._defaults import positive_seconds
from .cpus import BIND_VAR, bound_cpus, usable_cpu_count
from .hosts import SlotInfo
from .torch_store import torch_env

__all__ = [
    "THREAD_VARS",
    "SECRET_VAR",
    "JobInfo",
    "slot_env",
    "start_timeout",
    "tunable_env",
    "visible_env",
    "worker_env",
]

SECRET_VAR = "FERROVOD_SECRET"

_MIB = 1024 * 1024


@dataclass(frozen=True)
class JobInfo:
    """What every worker of one launch shares."""

    rendezvous_addr: Optional[str]
    secret_hex: str
    tunables: Mapping[str, str]
    #: The port of torch.distributed's store for the workers (:mod:`.torch_store`), on the
    #: rendezvous address's host; None: no torch variables.
    torch_store_port: Optional[int] = None


def _flag(value: Any) -> str:
    return "1" if value else "0"


def _mib_to_bytes(value: Any) -> str:
    return str(int(value) * _MIB)


# (argparse dest, variable, formatter). A dest that is None on the namespace was not given.
_TUNABLES: List[Tuple[str, str, Callable[[Any], str]]] = [
    ("fusion_threshold_mb", "FERROVOD_FUSION_THRESHOLD", _mib_to_bytes),
    ("cycle_time_ms", "FERROVOD_CYCLE_TIME", str),
    ("cache_capacity", "FERROVOD_CACHE_CAPACITY", str),
    ("bind_cores", BIND_VAR, _flag),
    ("timeline_filename", "FERROVOD_TIMELINE", str),
    ("timeline_mark_cycles", "FERROVOD_TIMELINE_MARK_CYCLES", _flag),
    ("log_level", "FERROVOD_LOG_LEVEL", lambda v: str(v).upper()),
    # --log-without-timestamp stores False into log_with_timestamp.
    ("log_with_timestamp", "FERROVOD_LOG_HIDE_TIME", lambda v: _flag(not v)),
    ("gloo_timeout_seconds", "FERROVOD_TIMEOUT_SECONDS", str),
    ("stall_check_warning_time_seconds", "FERROVOD_STALL_CHECK_TIME_SECONDS", str),
    ("stall_check_shutdown_time_seconds", "FERROVOD_STALL_SHUTDOWN_TIME_SECONDS", str),
    ("no_stall_check", "FERROVOD_STALL_CHECK_DISABLE", _flag),
    ("autotune", "FERROVOD_AUTOTUNE", _flag),
    ("hierarchical_allreduce", "FERROVOD_HIERARCHICAL_ALLREDUCE", _flag),
    ("autotune_log_file", "FERROVOD_AUTOTUNE_LOG", str),
    ("autotune_warmup_samples", "FERROVOD_AUTOTUNE_WARMUP_SAMPLES", str),
    ("autotune_steps_per_sample", "FERROVOD_AUTOTUNE_STEPS_PER_SAMPLE", str),
    # Read at each worker's start-up by the .pth the wheel installs (_ferrovod_as_horovod.py).
    ("as_horovod", "FERROVOD_AS_HOROVOD", _flag),
]


def start_timeout(flag_value: Optional[int], environ: Mapping[str, str]) -> int:
    """The start timeout in seconds: the flag, else ``FERROVOD_START_TIMEOUT``, else
    ``HOROVOD_START_TIMEOUT``, else the engine's default."""
    if flag_value is not None:
        return flag_value
    return int(positive_seconds(environ, ("FERROVOD_START_TIMEOUT", "HOROVOD_START_TIMEOUT"),
                                float(engine_default("FERROVOD_START_TIMEOUT")), whole=True))


def tunable_env(args: argparse.Namespace, environ: Mapping[str, str]) -> Dict[str, str]:
    """The tunable variables the given flags export (only flags that were given)."""
    env: Dict[str, str] = {}
    for dest, name, fmt in _TUNABLES:
        value = getattr(args, dest, None)
        if value is not None:
            env[name] = fmt(value)
    env["FERROVOD_START_TIMEOUT"] = str(
        start_timeout(getattr(args, "start_timeout", None), environ)
    )
    return env


def slot_env(slot: SlotInfo) -> Dict[str, str]:
    """Topology variables of one slot, under both the FERROVOD_ and HOROVOD_ names."""
    topology = {
        "RANK": slot.rank,
        "SIZE": slot.size,
        "LOCAL_RANK": slot.local_rank,
        "LOCAL_SIZE": slot.local_size,
        "CROSS_RANK": slot.cross_rank,
        "CROSS_SIZE": slot.cross_size,
        "HOSTNAME": slot.hostname,
    }
    env: Dict[str, str] = {}
    for prefix in ("FERROVOD_", "HOROVOD_"):
        for key, value in topology.items():
            env[prefix + key] = str(value)
    return env


def worker_env(base: Mapping[str, str], slot: SlotInfo, job: JobInfo) -> Dict[str, str]:
    """The full environment of the worker for ``slot``: ``base`` plus everything above."""
    env = dict(base)
    env.update(job.tunables)
    env.update(slot_env(slot))
    env.pop("FERROVOD_RENDEZVOUS_ADDR", None)  # a stale address from an outer job must not leak
    if job.rendezvous_addr is not None:
        env["FERROVOD_RENDEZVOUS_ADDR"] = job.rendezvous_addr
    env[SECRET_VAR] = job.secret_hex
    env["FERROVOD_LAUNCHER"] = "ferrovodrun"
    if job.torch_store_port is not None and job.rendezvous_addr is not None:
        host = job.rendezvous_addr.rsplit(":", 1)[0]
        env.update(torch_env(slot, host, job.torch_store_port))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(thread_share(base, slot.local_size, bound_cpus(env)))
    return env


#: Thread-pool variables of OpenMP and the BLAS libraries frameworks load.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def thread_share(base: Mapping[str, str], local_size: int,
                 bound: Optional[FrozenSet[int]] = None) -> Dict[str, str]:
    """Each of ``local_size`` ranks on a host gets a fair share of its cores for its thread
    pools, unless the user set the variable: by default every rank's pool would use every
    core, and ranks would fight over them. A rank ``bound`` to CPUs gets as many threads."""
    if bound:
        share = str(len(bound))
    else:
        share = str(max(1, usable_cpu_count() // max(1, local_size)))
    return {var: share for var in THREAD_VARS if var not in base}


def visible_env(env: Mapping[str, str], base: Mapping[str, str]) -> Dict[str, str]:
    """What ``env`` adds to or changes in ``base``, the secret masked (for ``--verbose``)."""
    shown = {k: v for k, v in env.items() if base.get(k) != v}
    if SECRET_VAR in shown:
        shown[SECRET_VAR] = "<hidden>"
    return shown
