"""Elastic ferrovod jobs on Ray (Horovod's ``ElasticRayExecutor``, and ``RayExecutor`` given
``min_workers``): ranks come and go with the cluster's nodes while training goes on.

::

    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=8)
    executor = ElasticRayExecutor(settings, cpus_per_slot=2)
    executor.start()
    results = executor.run(train)   # train uses ferrovod.elastic.run / its framework's state

The memberships are decided by the same driver as ``ferrovodrun``'s elastic jobs
(:mod:`ferrovod.runner.elastic.driver`: host order, blacklist and cooldown, reset limit,
``min_np`` and the elastic timeout, the job's end). Two things differ:

* **Hosts** are Ray's alive nodes (:class:`RayHostDiscovery`), each with as many slots as its
  CPUs (and GPUs) hold ranks, read about once a second: a node that joins the cluster is
  found, one that is lost drops out.
* **Workers** are Ray actors (:class:`ActorPool`), one per worker, pinned to its slot's node.
  A worker that raises, or whose actor dies with its node, is a failed worker; its host is
  blacklisted and the survivors go on in a new membership, as with processes.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..runner.elastic import worker_extras
from ..runner.elastic.driver import DiscoveryError, ElasticDriver, ElasticSettings
from ..runner.hosts import HostInfo, SlotInfo
from ..runner.outcome import Outcome, first_failure
from ..runner.worker_env import slot_env
from ._store import start_store

__all__ = ["ElasticRayExecutor", "RayElasticSettings", "RayHostDiscovery", "ActorPool"]

WHO = "ferrovod.ray"


class RayHostDiscovery:
    """Ray's alive nodes as hosts (Horovod's ``RayHostDiscovery``): a node holds
    ``CPU // cpus_per_slot`` slots (and at most ``GPU // gpus_per_slot`` with ``use_gpu``).
    Nodes are named by the address they registered with; two nodes at one address by their
    ids as well."""

    dynamic = True

    def __init__(self, use_gpu: bool = False, cpus_per_slot: int = 1,
                 gpus_per_slot: int = 1) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot
        #: host name -> Ray node id, for the hosts of the last answer.
        self.node_of: Dict[str, str] = {}
        #: host name -> how many GPUs the node has.
        self.gpus_of: Dict[str, int] = {}

    def find_available_hosts_and_slots(self) -> Dict[str, int]:
        """Host name -> slots (Horovod's name for :meth:`find`)."""
        return {h.hostname: h.slots for h in self.find()}

    def find(self) -> List[HostInfo]:
        import ray

        try:
            nodes = [n for n in ray.nodes() if n.get("Alive")]
        except Exception as exc:  # noqa: BLE001 - the GCS is unreachable: retried by the driver
            raise DiscoveryError(f"{WHO}: cannot read the Ray cluster's nodes: {exc}") from None
        addrs = [n["NodeManagerAddress"] for n in nodes]
        hosts: List[HostInfo] = []
        self.node_of, self.gpus_of = {}, {}
        for node, addr in zip(nodes, addrs):
            res = node.get("Resources", {})
            slots = int(res.get("CPU", 0) // self.cpus_per_slot)
            if self.use_gpu:
                slots = min(slots, int(res.get("GPU", 0) // self.gpus_per_slot))
            if slots < 1:
                continue
            name = addr if addrs.count(addr) == 1 else f"{addr}-{node['NodeID'][:12]}"
            self.node_of[name] = node["NodeID"]
            self.gpus_of[name] = int(res.get("GPU", 0))
            hosts.append(HostInfo(name, slots))
        return hosts


class _UserDiscovery:
    """A discovery object of the user's (``override_discovery=False``), Horovod style: its
    ``find_available_hosts_and_slots()`` names Ray nodes by address."""

    dynamic = True

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.node_of: Dict[str, str] = {}
        self.gpus_of: Dict[str, int] = {}

    def find(self) -> List[HostInfo]:
        try:
            found = self.inner.find_available_hosts_and_slots()
        except Exception as exc:  # noqa: BLE001 - the user's code: retried by the driver
            raise DiscoveryError(f"{WHO}: the discovery's find_available_hosts_and_slots() "
                                 f"raised {type(exc).__name__}: {exc}") from None
        return [HostInfo(h, int(n)) for h, n in found.items() if int(n) > 0]


@dataclass
class RayElasticSettings:
    """An elastic Ray job's settings (Horovod's ``ElasticSettings`` as
    :meth:`ElasticRayExecutor.create_settings` makes them)."""

    min_num_proc: int = 1
    max_num_proc: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    ssh_identity_file: Optional[str] = None
    nics: Optional[Set[str]] = None
    cooldown_range: Optional[Tuple[int, int]] = None
    verbose: int = 0
    #: Set by the executor (``override_discovery``), or given: an object with Horovod's
    #: ``find_available_hosts_and_slots()``.
    discovery: Any = None

    @property
    def num_proc(self) -> int:
        """How many ranks the job waits for before it starts (Horovod starts with
        ``min_num_proc``)."""
        return self.min_num_proc

    def checked(self) -> ElasticSettings:
        """The driver's settings; ``ValueError`` naming what is wrong."""
        lo, hi = self.min_num_proc, self.max_num_proc
        if not isinstance(lo, int) or lo < 1:
            raise ValueError(f"{WHO}: min_num_proc (min_workers) must be a positive integer, "
                             f"got {lo!r}")
        if hi is not None and hi < lo:
            raise ValueError(f"{WHO}: max_num_proc (max_workers) {hi} is below min_num_proc "
                             f"{lo}")
        if self.elastic_timeout <= 0:
            raise ValueError(f"{WHO}: elastic_timeout must be above 0, got "
                             f"{self.elastic_timeout}")
        if self.reset_limit is not None and self.reset_limit < 0:
            raise ValueError(f"{WHO}: reset_limit must not be negative, got {self.reset_limit}")
        cooldown = None
        if self.cooldown_range is not None:
            a, b = self.cooldown_range
            if a <= 0 or b < a:
                raise ValueError(f"{WHO}: cooldown_range needs 0 < LO <= HI, got {a} {b}")
            cooldown = (int(a), int(b))
        return ElasticSettings(num_proc=lo, min_np=lo, max_np=hi,
                               timeout_s=float(self.elastic_timeout),
                               reset_limit=self.reset_limit, cooldown=cooldown, script=None,
                               fixed_hosts=None, slots_per_host=None,
                               min_np_name="min_workers (min_num_proc)")


@dataclass
class _ActorSpec:
    """What the pool starts a worker from: its number, host, node and environment."""

    wid: int
    host: str
    node_id: Optional[str]
    env: Dict[str, str]
    gpus_on_node: int


#: ``(outcome, the worker's last rank, the job's last size)``; a removed worker's outcome is
#: ``("removed", None, t)``.
WorkerResult = Tuple[Outcome, int, int]


class ActorPool:
    """The elastic driver's workers as Ray actors (a
    :class:`~ferrovod.runner.elastic.driver.WorkerPool`): each runs ``call`` once, with its
    slot's environment, and is killed when it returns. A worker that raised exits with 1 and
    one whose actor died, or that Ray could not place within ``place_timeout_s``, with
    SIGKILL's status; :attr:`why` says which, and :attr:`results` holds what each returned."""

    def __init__(self, call: Tuple[Callable[..., Any], Sequence[Any], Dict[str, Any]],
                 executable: Optional[Tuple[type, Sequence[Any], Dict[str, Any]]],
                 on_executable: bool, cpus: float, gpus: float, place_timeout_s: float) -> None:
        self.call = call
        self.executable = executable
        self.on_executable = on_executable
        self.cpus, self.gpus = cpus, gpus
        self.place_timeout_s = place_timeout_s
        self.actors: Dict[int, Any] = {}
        self.hosts: Dict[int, str] = {}
        self.results: Dict[int, WorkerResult] = {}
        self.why: Dict[int, str] = {}
        self._running: Dict[Any, int] = {}  # the call's ref -> worker
        self._placing: Dict[Any, Tuple[int, float]] = {}  # ready ref -> (worker, deadline)

    def add(self, specs: Sequence[_ActorSpec]) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from ._worker import Worker

        actor = ray.remote(Worker)
        for spec in specs:
            options: Dict[str, Any] = {"num_cpus": self.cpus, "num_gpus": self.gpus,
                                       "max_restarts": 0}
            if spec.node_id is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                    spec.node_id, soft=False)
            else:
                options["resources"] = {f"node:{spec.host}": 0.001}
            handle = actor.options(**options).remote()
            self.actors[spec.wid], self.hosts[spec.wid] = handle, spec.host
            self._placing[handle.node.remote()] = (
                spec.wid, time.monotonic() + self.place_timeout_s)
            fn, args, kwargs = self.call
            self._running[handle.elastic.remote(
                spec.env, spec.gpus_on_node, self.executable, self.on_executable, fn, list(args),
                dict(kwargs))] = spec.wid

    def next_event(self, timeout: float) -> Optional[Tuple[str, int, int]]:
        import ray

        end = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            for ref, (wid, deadline) in list(self._placing.items()):
                if now > deadline and wid not in self.results and wid not in self.why:
                    del self._placing[ref]
                    self.why[wid] = (f"Ray could not start its actor on {self.hosts[wid]} "
                                     f"within {self.place_timeout_s:g} s")
                    return self._ended(wid, -9)
            refs = list(self._running) + list(self._placing)
            if not refs:
                time.sleep(max(0.0, min(end - now, 0.1)))
                return None
            wait = max(0.0, min(end - now, 0.2))
            done, _ = ray.wait(refs, num_returns=1, timeout=wait)
            for ref in done:
                if ref in self._placing:
                    del self._placing[ref]
                    continue
                wid = self._running.pop(ref)
                try:
                    result: WorkerResult = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - the actor died (its node, a kill)
                    self.why[wid] = f"its actor on {self.hosts[wid]} died: " \
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    return self._ended(wid, -9)
                self.results[wid] = result
                kind = result[0][0]
                if kind == "error":
                    self.why[wid] = f"it raised an exception:\n{result[0][1]}"
                return self._ended(wid, 1 if kind == "error" else 0)
            if time.monotonic() >= end:
                return None

    def _ended(self, wid: int, code: int) -> Tuple[str, int, int]:
        import ray

        for ref in [r for r, (w, _) in self._placing.items() if w == wid]:
            del self._placing[ref]
        for ref in [r for r, w in self._running.items() if w == wid]:
            del self._running[ref]
        handle = self.actors.pop(wid, None)
        if handle is not None:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - an actor already gone is what we want
                pass
        return ("exit", wid, code)

    def keep_reaping(self, on: bool) -> None:
        """Nothing to do: actors are watched through their calls, whether any run or not."""

    def stop(self) -> None:
        for wid in list(self.actors):
            self._ended(wid, 0)


class ElasticRayExecutor:
    """Runs an elastic ferrovod job on Ray actors (Horovod's ``ElasticRayExecutor``).

    Args:
        settings: from :meth:`create_settings`.
        use_gpu: reserve ``gpus_per_slot`` GPUs (default 1) for each rank.
        cpus_per_slot: CPUs Ray reserves for each rank.
        gpus_per_slot: GPUs per rank; needs ``use_gpu``.
        env_vars: more environment variables for every rank.
        override_discovery: find hosts from Ray's alive nodes (the default); False keeps
            ``settings.discovery``, an object whose ``find_available_hosts_and_slots()`` returns
            ``{node address: slots}``.
    """

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: Optional[int] = None,
                        reset_limit: Optional[int] = None, elastic_timeout: int = 600,
                        timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        nics: Optional[Set[str]] = None, min_np: Optional[int] = None,
                        max_np: Optional[int] = None, **kwargs: Any) -> RayElasticSettings:
        """The executor's settings (Horovod's signature; ``min_np``/``max_np`` are its
        deprecated names). ``timeout_s`` bounds how long the ranks of a membership may take to
        form it, and Ray to start a rank's actor. ``verbose`` and ``cooldown_range`` may be
        given as keywords."""
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            max_num_proc = max_np
        return RayElasticSettings(min_num_proc=min_num_proc, max_num_proc=max_num_proc,
                                  reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                                  timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                                  nics=nics, **kwargs)

    def __init__(self, settings: RayElasticSettings, use_gpu: bool = False,
                 cpus_per_slot: int = 1, gpus_per_slot: Optional[int] = None,
                 env_vars: Optional[Dict[str, str]] = None,
                 override_discovery: bool = True) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError(f"{WHO}: gpus_per_slot is set, but use_gpu is False")
        gpus = (gpus_per_slot or 1) if use_gpu else 0
        if use_gpu and gpus < 1:
            raise ValueError(f"{WHO}: gpus_per_slot must be at least 1, got {gpus_per_slot}")
        if not isinstance(cpus_per_slot, (int, float)) or cpus_per_slot <= 0:
            raise ValueError(f"{WHO}: cpus_per_slot must be positive, got {cpus_per_slot!r}")
        self._driver_settings = settings.checked()
        if override_discovery:
            settings.discovery = RayHostDiscovery(use_gpu, cpus_per_slot, max(gpus, 1))
        elif settings.discovery is None:
            raise ValueError(f"{WHO}: override_discovery=False needs settings.discovery")
        self.settings = settings
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus
        self.env_vars = dict(env_vars or {})
        self.executable: Optional[Tuple[type, Sequence[Any], Dict[str, Any]]] = None
        self._started = False

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[Sequence[Any]] = None,
              executable_kwargs: Optional[Dict[str, Any]] = None,
              extra_env_vars: Optional[Dict[str, str]] = None) -> None:
        """Readies the executor: the ranks start with each :meth:`run`, as a job of its own
        with its own rendezvous store in this driver.
        ``executable_cls(*executable_args, **executable_kwargs)`` is made in each rank for
        :meth:`execute`; ``extra_env_vars`` join every rank's environment."""
        import ray

        if ray.util.client.ray.is_connected():
            raise NotImplementedError(f"{WHO}: drivers connected through Ray Client (ray://) "
                                      "are not supported yet; run the driver on a node of the "
                                      "cluster (e.g. with `ray job submit`)")
        if not ray.is_initialized():
            ray.init()
        if self._started:
            raise RuntimeError(f"{WHO}: start() was already called; shutdown() first")
        if executable_cls is not None:
            self.executable = (executable_cls, list(executable_args or []),
                               dict(executable_kwargs or {}))
        self.env_vars.update(extra_env_vars or {})
        self._started = True

    def run(self, worker_fn: Callable[..., Any],
            callbacks: Optional[List[Callable[..., Any]]] = None,
            args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Dict[str, Any]] = None) -> List[Any]:
        """Runs ``worker_fn(*args, **kwargs)`` elastically on the cluster's nodes until it
        returns on the last membership's ranks; returns their results in rank order.

        Raises ``RuntimeError`` when the job cannot go on: every worker failed, fewer than
        ``min_num_proc`` slots for longer than ``elastic_timeout``, the reset limit. The
        message names the first failed worker and, when it raised, its traceback.
        ``callbacks`` is accepted for Horovod's signature; nothing calls it."""
        return self._run((worker_fn, list(args or []), dict(kwargs or {})))

    def execute(self, fn: Callable[[Any], Any]) -> List[Any]:
        """Runs ``fn(executable)`` elastically, as :meth:`run` does, on each rank's
        ``executable_cls`` instance (made when its actor starts)."""
        return self._run((fn, [], {}), on_executable=True)

    def shutdown(self) -> None:
        """Forgets what :meth:`start` was given (each run's actors and store end with it)."""
        self._started = False
        self.executable = None

    def _run(self, call: Tuple[Callable[..., Any], Sequence[Any], Dict[str, Any]],
             on_executable: bool = False) -> List[Any]:
        if not self._started:
            raise RuntimeError(f"{WHO}: call start() first")
        discovery = self.settings.discovery
        source = discovery if isinstance(discovery, RayHostDiscovery) else \
            _UserDiscovery(discovery)
        pool = ActorPool(call, self.executable, on_executable, self.cpus_per_slot,
                         self.gpus_per_slot, float(self.settings.timeout_s))
        # A store of its own for each run: the epochs of an earlier run must not be read as
        # this one's.
        server, common = start_store(self.settings.timeout_s, self.settings.nics)

        def spec_for(slot: SlotInfo, wid: int, epoch: int) -> _ActorSpec:
            env = dict(common, **slot_env(slot))
            env.update(worker_extras(slot, epoch, self._driver_settings))
            env.update(self.env_vars)
            return _ActorSpec(wid, slot.hostname, source.node_of.get(slot.hostname), env,
                              source.gpus_of.get(slot.hostname, 0))

        def log(line: str) -> None:
            if self.settings.verbose or line.startswith("error"):
                print(f"[{WHO}] {line}", file=sys.stderr, flush=True)

        driver = ElasticDriver(self._driver_settings, source, server, pool, spec_for, log,
                               bool(self.settings.verbose))
        try:
            code = driver.run()
        finally:
            server.close()
        if code != 0:
            raise _failure(driver, pool, code)
        return _results(pool)


def _results(pool: ActorPool) -> List[Any]:
    """The results of the workers that finished, in their last ranks' order."""
    done = sorted((rank, wid) for wid, (outcome, rank, _) in pool.results.items()
                  if outcome[0] == "ok")
    return [pool.results[wid][0][1] for _, wid in done]


def _failure(driver: ElasticDriver, pool: ActorPool, code: int) -> RuntimeError:
    """The error of a failed elastic run: why it ended, and what happened to the first
    worker that failed (its traceback when it raised)."""
    why = driver.error or f"the elastic job failed ({code})"
    first = driver.first_failure
    raised = {wid: o for wid, (o, _, _) in pool.results.items() if o[0] == "error"}
    if first is not None and first.wid in pool.why:
        what = pool.why[first.wid]
        return RuntimeError(f"{WHO}: {why}\nworker {first.wid} ({first.host}[{first.local_rank}]"
                            f"): {what}")
    err = first_failure(WHO, raised)
    return RuntimeError(f"{WHO}: {why}" + (f"\n{err}" if err is not None else ""))
