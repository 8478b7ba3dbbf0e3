"""Elastic jobs of ``ferrovodrun`` (``--min-np``, ``--host-discovery-script``): workers leave
and join while training goes on.

:mod:`.driver` decides the memberships (discovery, host order, blacklist, reset limit, the
job's end); this module checks the flags and builds the worker a new slot asks for, local or
over ssh. The worker side is :mod:`ferrovod.elastic.membership`. The layout follows Horovod's
``horovod.runner.elastic`` (``driver``, ``constants``), whose names scripts reach.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from ...elastic import membership as _elastic
from ..cpus import bound_cpus
from ..hosts import HostInfo, SlotInfo, is_local_host
from ..remote import check_hosts, format_host_errors, over_ssh, rendezvous_host
from ..supervisor import SpawnError, Supervisor, WorkerSpec
from ..worker_env import THREAD_VARS, JobInfo, worker_env
from . import driver as _driver
from .driver import Discovery, ElasticDriver, ElasticSettings, Log

if TYPE_CHECKING:
    from ..launch import LaunchPlan

__all__ = ["ElasticSettings", "launch", "settings_from", "worker_extras"]


def launch(plan: "LaunchPlan", settings: ElasticSettings, supervisor: Supervisor, server: object,
           job: JobInfo, base_env: Dict[str, str], log: Log) -> Tuple[int, Optional[str]]:
    """Runs an elastic job from ``ferrovodrun``: the driver decides the memberships and asks
    for the workers of new slots, which this builds (local, or over ssh through the host's
    agent). Returns the launcher's exit status and, when it is not 0, why the job failed."""
    computed = [var for var in THREAD_VARS if var not in base_env]
    store_port = str(job.rendezvous_addr).rsplit(":", 1)[1]
    checked: Dict[str, str] = {}  # remote host -> the store's address as it reaches it
    local: Dict[str, bool] = {}
    store_of: Dict[Tuple[str, int], str] = {}  # slot -> its store address in the membership

    def is_local(host: str) -> bool:
        if host not in local:
            local[host] = is_local_host(host)
        return local[host]

    def prepare(slots: List[SlotInfo]) -> Dict[Tuple[str, int], Dict[str, str]]:
        """Checks the membership's new remote hosts (as every host of a fixed job is before
        anything starts) and gives each slot the store address its worker forms with. A
        worker publishes the address of its route to the store, so this machine's workers
        use the one a remote host of the membership reaches the launcher at, not loopback:
        their peers there must reach them (a fixed job does the same)."""
        remote = list(dict.fromkeys(s.hostname for s in slots if not is_local(s.hostname)))
        for host in remote:
            if host in checked:
                continue
            reports = check_hosts([host], plan.ssh, sys.executable, plan.iface, os.getcwd(),
                                  timeout=plan.ssh.connect_timeout + 30.0)
            message = format_host_errors(reports, [host])
            if message is not None:
                rank = next(s.rank for s in slots if s.hostname == host)
                raise SpawnError(rank, host, OSError(0, message))
            checked[host] = f"{rendezvous_host(reports, host)}:{store_port}"
        here = checked[remote[0]] if remote else str(job.rendezvous_addr)
        store_of.clear()
        for s in slots:
            store_of[(s.hostname, s.local_rank)] = checked.get(s.hostname, here)
        return {key: {"store": addr} for key, addr in store_of.items()}

    def spec_for(slot: SlotInfo, wid: int, epoch: int) -> WorkerSpec:
        remote = not is_local(slot.hostname)
        host_job = replace(job, rendezvous_addr=store_of[(slot.hostname, slot.local_rank)])
        env = worker_env(base_env, slot, host_job)
        env.update(worker_extras(slot, epoch, settings))
        if plan.verbose:
            log(f"elastic: starting worker {wid} for {slot.hostname}[{slot.local_rank}] "
                f"(epoch {epoch}, rank {slot.rank})")
        spec = WorkerSpec(rank=wid, argv=plan.command, env=env, hostname=slot.hostname)
        if remote:
            over_ssh(spec, plan.command, plan.ssh, plan.exports, slot.local_size, env, base_env,
                     computed, os.getcwd())
        else:
            spec.cpus = bound_cpus(env)
        if plan.output_dir is not None:
            # A worker's rank changes with the membership: its files are named by the worker
            # number its output lines carry.
            where = os.path.join(plan.output_dir, f"worker.{wid}")
            try:
                os.makedirs(where, exist_ok=True)
                spec.stdout_copy = open(os.path.join(where, "stdout"), "wb")
                spec.stderr_copy = open(os.path.join(where, "stderr"), "wb")
            except OSError as exc:
                raise SpawnError(wid, where, exc) from None
        return spec

    if plan.verbose:
        for note in plan.notes:
            log(f"note: {note}")
    supervisor.start([])
    from .. import gloo_run

    settings = replace(settings, min_start_hosts=gloo_run._get_min_start_hosts(settings))
    driver = ElasticDriver(settings, Discovery(settings, base_env, supervisor.run_command),
                           server, supervisor, spec_for, log, plan.verbose, prepare)
    code = driver.run()
    return code, (None if code == 0 else driver.error or f"the elastic job failed ({code})")


def settings_from(args: object, fixed_hosts: Optional[List[HostInfo]],
                  environ: Dict[str, str]) -> ElasticSettings:
    """Checks the elastic flags (``ValueError`` naming the flag)."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    num_proc, min_np, max_np = get("num_proc"), get("min_num_proc"), get("max_num_proc")
    if num_proc is None:
        num_proc = min_np
    if num_proc is None:
        raise ValueError("-np/--num-proc (or --min-np) is required in elastic mode")
    min_np = num_proc if min_np is None else min_np
    if min_np < 1:
        raise ValueError(f"--min-np must be at least 1, got {min_np}")
    if num_proc < min_np:
        raise ValueError(f"-np {num_proc} is below --min-np {min_np}")
    if max_np is not None and max_np < num_proc:
        raise ValueError(f"--max-np {max_np} is below -np {num_proc}")
    if get("host_discovery_script") is None and not fixed_hosts:
        raise ValueError("elastic mode needs --host-discovery-script, or -H/--hostfile")
    timeout = get("elastic_timeout")
    if timeout is None:
        timeout = _elastic.timeout_s(environ, _driver.ELASTIC_TIMEOUT_SECS)
    if timeout <= 0:
        raise ValueError(f"--elastic-timeout must be above 0, got {timeout}")
    reset_limit = get("reset_limit")
    if reset_limit is not None and reset_limit < 0:
        raise ValueError(f"--reset-limit must not be negative, got {reset_limit}")
    cooldown = get("cooldown_range")
    if cooldown is not None:
        lo, hi = cooldown
        if lo <= 0 or hi < lo:
            raise ValueError(f"--blacklist-cooldown-range needs 0 < LO <= HI, got {lo} {hi}")
        cooldown = (int(lo), int(hi))
    slots = get("slots")
    if slots is not None and slots < 1:
        raise ValueError(f"--slots-per-host must be at least 1, got {slots}")
    return ElasticSettings(num_proc=num_proc, min_np=min_np, max_np=max_np,
                           timeout_s=float(timeout), reset_limit=reset_limit, cooldown=cooldown,
                           script=get("host_discovery_script"), fixed_hosts=fixed_hosts,
                           slots_per_host=slots)


def worker_extras(slot: SlotInfo, epoch: int, settings: ElasticSettings) -> Dict[str, str]:
    """What an elastic worker's environment adds: its slot's identity and the epoch it was
    started for (see :mod:`ferrovod.elastic.membership`)."""
    return {
        _elastic.ENABLED_VAR: "1",
        "HOROVOD_ELASTIC": "1",
        _elastic.EPOCH_VAR: str(epoch),
        "FERROVOD_ELASTIC_LOCAL_RANK": str(slot.local_rank),
        _elastic.TIMEOUT_VAR: f"{settings.timeout_s:g}",
    }
