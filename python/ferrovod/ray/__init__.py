"""``ferrovod.ray``: Horovod's ``horovod.ray`` API — a ferrovod job whose ranks are Ray actors.

::

    import ray
    from ferrovod.ray import RayExecutor

    ray.init(address="auto")
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=4, cpus_per_worker=2)
    executor.start()
    results = executor.run(train, kwargs={"epochs": 3})   # every rank's result, rank 0's first
    executor.shutdown()

The executor reserves the workers' resources with one placement group, starts one actor per
rank, gives each the environment ``ferrovodrun`` gives a worker (its rank, its host's local
ranks from Ray's node ids, the job's rendezvous store, which runs in the driver), and then
calls functions on all of them; the function calls ``ferrovod.init()`` itself. Ray assigns
GPUs; the ranks of one node see all of that node's assigned GPUs, in local-rank order.

Given ``min_workers`` (or as :class:`ElasticRayExecutor`), the job is elastic: ranks are
placed on Ray's alive nodes as they come and go (:mod:`ferrovod.ray.elastic`).

Not yet: drivers connected through Ray Client (``ray://``); they get ``NotImplementedError``
saying so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..runner.hosts import HostInfo, SlotInfo, get_host_assignments
from ..runner.outcome import Outcome, first_failure
from ..runner.worker_env import slot_env
from ._store import start_store
from .elastic import ElasticRayExecutor, RayHostDiscovery

__all__ = ["MiniSettings", "RayExecutor", "ElasticRayExecutor", "RayHostDiscovery"]

WHO = "ferrovod.ray"

# How long the driver waits, once a rank has raised, for the others to finish or fail (they
# usually fail at once, their peer gone) before it stops them all.
_AFTER_FAILURE_S = 5.0


@dataclass
class MiniSettings:
    """The settings :meth:`RayExecutor.create_settings` makes (Horovod's ``MiniSettings``)."""

    timeout_s: int = 30
    ssh_identity_file: Optional[str] = None
    placement_group_timeout_s: int = 100
    nics: Optional[Set[str]] = None
    verbose: int = 1
    elastic: bool = False


class RayExecutor:
    """Runs a ferrovod job on Ray actors (Horovod's ``horovod.ray.RayExecutor``).

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of ranks, placed where Ray finds room (packed onto few nodes).
        num_hosts: instead of ``num_workers``: this many nodes, all different...
        num_workers_per_host: ...with this many ranks on each.
        cpus_per_worker: CPUs Ray reserves for each rank (its thread pools get as many).
        use_gpu: reserve ``gpus_per_worker`` GPUs (default 1) for each rank.
        gpus_per_worker: GPUs per rank when ``use_gpu``.
        use_current_placement_group: when this driver itself runs inside a placement group
            (e.g. a Ray Tune trial), place the ranks in it instead of making a new one.
        min_workers: instead of ``num_workers``: an elastic job of at least this many ranks,
            placed on Ray's alive nodes as they come and go (see :mod:`ferrovod.ray.elastic`);
            its functions use ``ferrovod.elastic.run`` (or their framework's).
        max_workers: at most this many ranks (elastic).
        reset_limit: at most this many new memberships after the first (elastic).
        cooldown_range: ``(LO, HI)``: a failed node comes back after ``LO * 2**n`` seconds,
            at most ``HI`` (elastic; without it, never).
        elastic_timeout: how long an elastic job waits for ``min_workers`` slots.
        override_discovery: accepted for Horovod's signature (hosts are Ray's nodes).
    """

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: Optional[str] = None,
                        ssh_str: Optional[str] = None, placement_group_timeout_s: int = 100,
                        nics: Optional[Set[str]] = None) -> MiniSettings:
        """The executor's settings.

        Args:
            timeout_s: how long the ranks may take to form the job (``FERROVOD_START_TIMEOUT``).
            ssh_identity_file, ssh_str: accepted for Horovod's signature; ranks start as Ray
                actors, not over ssh. ``ssh_str`` is still written to ``ssh_identity_file``
                (mode 0600) when that file does not exist, as Horovod does.
            placement_group_timeout_s: how long to wait for Ray to reserve every rank's
                resources before failing.
            nics: the network interfaces the ranks may use; the first is used
                (``FERROVOD_IFACE``).
        """
        if ssh_str and ssh_identity_file and not os.path.exists(ssh_identity_file):
            fd = os.open(ssh_identity_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(ssh_str)
        return MiniSettings(timeout_s=timeout_s, ssh_identity_file=ssh_identity_file,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings: MiniSettings, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1,
                 cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: Optional[int] = None,
                 use_current_placement_group: bool = True,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None,
                 reset_limit: Optional[int] = None,
                 cooldown_range: Optional[List[int]] = None, elastic_timeout: int = 600,
                 override_discovery: bool = True) -> None:
        if max_workers and not min_workers:
            raise ValueError(f"{WHO}: max_workers needs a positive min_workers (an elastic job)")
        if min_workers is not None and num_workers is not None:
            raise ValueError(f"{WHO}: give num_workers (a fixed job) or min_workers (an "
                             "elastic one), not both")
        self._elastic: Optional[ElasticRayExecutor] = None
        if min_workers is not None:
            if num_hosts is not None:
                raise ValueError(f"{WHO}: num_hosts places a fixed job; an elastic one "
                                 "(min_workers) takes the nodes Ray has")
            elastic = ElasticRayExecutor.create_settings(
                min_num_proc=min_workers, max_num_proc=max_workers, reset_limit=reset_limit,
                elastic_timeout=elastic_timeout, timeout_s=settings.timeout_s,
                nics=settings.nics, verbose=settings.verbose,
                cooldown_range=tuple(cooldown_range) if cooldown_range else None)
            self._elastic = ElasticRayExecutor(elastic, use_gpu=use_gpu,
                                               cpus_per_slot=cpus_per_worker,
                                               gpus_per_slot=gpus_per_worker)
            num_workers = min_workers
        elif (num_workers is None) == (num_hosts is None):
            raise ValueError(f"{WHO}: give num_workers, or num_hosts with "
                             "num_workers_per_host, not both")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host),
                            ("cpus_per_worker", cpus_per_worker)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{WHO}: {name} must be a positive integer, got {value!r}")
        self.settings = settings
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: List[Any] = []  # actor handles in rank order
        self.slots: List[SlotInfo] = []
        self._placement_group: Any = None
        self._own_placement_group = False
        self._server: Any = None
        self._broken: Optional[str] = None

    # -- start ----------------------------------------------------------------------------

    def start(self, executable_cls: Optional[type] = None,
              executable_args: Optional[List[Any]] = None,
              executable_kwargs: Optional[Dict[str, Any]] = None,
              extra_env_vars: Optional[Dict[str, str]] = None) -> None:
        """Reserves the ranks' resources, starts one actor per rank and gives each its
        environment (plus ``extra_env_vars``); then makes ``executable_cls(*executable_args,
        **executable_kwargs)`` in each, which :meth:`execute` hands to its functions.

        Raises ``TimeoutError`` when Ray cannot reserve the resources within the settings'
        ``placement_group_timeout_s`` (naming what was asked and what is free)."""
        import ray

        if ray.util.client.ray.is_connected():
            raise NotImplementedError(f"{WHO}: drivers connected through Ray Client (ray://) "
                                      "are not supported yet; run the driver on a node of the "
                                      "cluster (e.g. with `ray job submit`)")
        if not ray.is_initialized():
            ray.init()
        if self._elastic is not None:
            self._elastic.start(executable_cls, executable_args, executable_kwargs,
                                extra_env_vars)
            return
        if self.workers:
            raise RuntimeError(f"{WHO}: start() was already called; shutdown() first")
        self._broken = None
        try:
            self._start(executable_cls, list(executable_args or []),
                        dict(executable_kwargs or {}), dict(extra_env_vars or {}))
        except BaseException:
            self.shutdown()
            raise

    def _bundles(self) -> Tuple[List[Dict[str, float]], List[int], str]:
        """The placement group's bundles, each rank's bundle and the group's strategy."""
        per_rank = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            per_rank["GPU"] = float(self.gpus_per_worker)
        if self.num_workers is not None:
            return [dict(per_rank) for _ in range(self.num_workers)], \
                list(range(self.num_workers)), "PACK"
        assert self.num_hosts is not None
        per_host = {k: v * self.num_workers_per_host for k, v in per_rank.items()}
        return ([dict(per_host) for _ in range(self.num_hosts)],
                [h for h in range(self.num_hosts) for _ in range(self.num_workers_per_host)],
                "STRICT_SPREAD")

    def _reserve(self) -> Tuple[Any, List[int]]:
        import ray
        from ray.util.placement_group import get_current_placement_group

        bundles, of_rank, strategy = self._bundles()
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            return current, [-1] * len(of_rank)
        pg = ray.util.placement_group(bundles, strategy=strategy)
        self._placement_group, self._own_placement_group = pg, True
        timeout = self.settings.placement_group_timeout_s
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            raise TimeoutError(
                f"{WHO}: Ray could not reserve the job's resources within {timeout} s "
                f"(placement_group_timeout_s): asked for {len(bundles)} bundle(s) of "
                f"{bundles[0]} ({strategy}); the cluster has {ray.available_resources()} free "
                f"of {ray.cluster_resources()}. Use fewer or smaller workers, or add nodes.")
        return pg, of_rank

    def _start(self, executable_cls: Optional[type], executable_args: List[Any],
               executable_kwargs: Dict[str, Any], extra_env: Dict[str, str]) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from ._worker import Worker

        pg, of_rank = self._reserve()
        actor = ray.remote(Worker)
        started = [
            actor.options(
                num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=bundle),
            ).remote()
            for bundle in of_rank
        ]
        self.workers = started  # so that a failure below still stops them
        answers = ray.get([w.node.remote() for w in started], timeout=self.settings.timeout_s)
        # Each node by the address it registered with (an actor's own guess of its address
        # can name another interface).
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        nodes = [(node_id, address.get(node_id, host), gpus) for node_id, host, gpus in answers]
        order, self.slots, gpus_of_node = _assign(nodes)
        self.workers = [started[i] for i in order]

        self._server, common = start_store(self.settings.timeout_s, self.settings.nics)
        envs = []
        for slot, i in zip(self.slots, order):
            env = dict(common, **slot_env(slot))
            if self.gpus_per_worker:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus_of_node[nodes[i][0]])
            env.update(extra_env)
            envs.append(env)
        ray.get([w.setup.remote(env, executable_cls, executable_args, executable_kwargs)
                 for w, env in zip(self.workers, envs)])

    # -- calls ----------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
            kwargs: Optional[Dict[str, Any]] = None,
            callbacks: Optional[List[Callable[..., Any]]] = None) -> List[Any]:
        """Calls ``fn(*args, **kwargs)`` on every rank; returns their results, rank 0's first.

        A rank that raises makes this raise ``RuntimeError`` naming the first such rank, with
        its traceback; its engine stops, so that peers waiting on it fail too. When every rank
        has returned or raised, the executor stays usable; a rank still in the call
        ``_AFTER_FAILURE_S`` later, or an actor that died, stops all the actors (``start``
        again to go on).
        ``callbacks`` is accepted for Horovod's signature; as in Horovod's executor, nothing
        calls it.

        Elastic (``min_workers``): the ranks start for this call and end with it; the results
        are those of the last membership's ranks (see :meth:`ElasticRayExecutor.run`)."""
        if self._elastic is not None:
            return self._elastic.run(fn, args=args, kwargs=kwargs)
        self._check()
        return self._gather([w.run.remote(fn, list(args or []), dict(kwargs or {}))
                             for w in self.workers])

    def execute(self, fn: Callable[[Any], Any],
                callbacks: Optional[List[Callable[..., Any]]] = None) -> List[Any]:
        """Calls ``fn(executable)`` on every rank (the ``executable_cls`` instance made by
        :meth:`start`, or None); returns their results, rank 0's first. Failures as in
        :meth:`run`."""
        if self._elastic is not None:
            return self._elastic.execute(fn)
        self._check()
        return self._gather([w.execute.remote(fn) for w in self.workers])

    def run_remote(self, fn: Callable[..., Any], args: Optional[Sequence[Any]] = None,
                   kwargs: Optional[Dict[str, Any]] = None) -> List[Any]:
        """Starts ``fn(*args, **kwargs)`` on every rank and returns their ``ObjectRef``s at
        once, in rank order (``ray.get`` them; a rank's exception comes out of its ref).
        Not in an elastic job, whose ranks live only inside :meth:`run`."""
        self._not_elastic("run_remote")
        self._check()
        return [w.call.remote(fn, list(args or []), dict(kwargs or {})) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """Calls ``fn(executable)`` on rank 0 only and returns its result. Not in an
        elastic job, whose ranks live only inside :meth:`run`."""
        self._not_elastic("execute_single")
        self._check()
        return self._gather([self.workers[0].execute.remote(fn)])[0]

    def shutdown(self) -> None:
        """Stops the actors, frees the placement group and stops the job's rendezvous store."""
        import ray

        if self._elastic is not None:
            self._elastic.shutdown()
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - an actor already gone is what we want
                pass
        self.workers = []
        if self._placement_group is not None and self._own_placement_group:
            try:
                ray.util.remove_placement_group(self._placement_group)
            except Exception:  # noqa: BLE001 - a cluster already gone frees it itself
                pass
        self._placement_group = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def _not_elastic(self, what: str) -> None:
        if self._elastic is not None:
            raise NotImplementedError(f"{WHO}: {what} needs ranks that outlive a call; an "
                                      "elastic job's (min_workers) start and end with run() "
                                      "and execute()")

    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"{WHO}: the executor was stopped after {self._broken}; call "
                               "start() again")
        if not self.workers:
            raise RuntimeError(f"{WHO}: call start() first")

    def _gather(self, refs: List[Any]) -> List[Any]:
        """Every rank's result, or one error naming the rank that failed first. A rank that
        fails stops the others within ``_AFTER_FAILURE_S``: a peer waiting on it in a
        collective learns of it when its process ends."""
        import ray

        index = {ref: rank for rank, ref in enumerate(refs)}
        outcomes: Dict[int, Outcome] = {}
        lost: Dict[int, str] = {}
        pending = list(refs)
        deadline: Optional[float] = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                break
            for ref in done:
                rank = index[ref]
                try:
                    outcomes[rank] = ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - an actor that died
                    lost[rank] = f"{type(exc).__name__}: {exc}"
                if (rank in lost or outcomes[rank][0] == "error") and deadline is None:
                    deadline = time.monotonic() + _AFTER_FAILURE_S
        if deadline is None:
            return [outcomes[r][1] for r in range(len(refs))]
        raised = first_failure(WHO, outcomes)
        waiting = sorted(index[ref] for ref in pending)
        if lost or waiting:
            # A rank still inside the call, or gone, leaves the job unusable: stop them all.
            self._broken = "a failed call" + (f" (rank(s) {waiting} did not finish)"
                                               if waiting else "")
            self.shutdown()
        if lost:
            first = min(lost)
            more = f"; rank(s) {waiting} did not finish" if waiting else ""
            raise RuntimeError(f"{WHO}: the actor of rank {first} died: {lost[first]}{more}") \
                from raised
        assert raised is not None
        raise raised


def _assign(nodes: Sequence[Tuple[str, str, List[str]]]) \
        -> Tuple[List[int], List[SlotInfo], Dict[str, List[str]]]:
    """Ranks for the actors on ``nodes`` (node id, its address, the actor's GPU ids): each node's actors
    get consecutive ranks (nodes in the order their first actor appears, actors within a node
    by their GPU, then as started), as ``ferrovodrun`` places a host's slots. Returns the
    actors' indices in rank order, the slots, and each node's GPU ids in local-rank order."""
    by_node: Dict[str, List[int]] = {}
    for i, (node_id, _, _) in enumerate(nodes):
        by_node.setdefault(node_id, []).append(i)

    def gpu_key(i: int) -> Tuple[int, ...]:
        return tuple(int(g) if g.isdigit() else -1 for g in nodes[i][2])

    # A node is named by its address; two nodes at one address (several Ray nodes on one
    # machine) by their ids as well, so that ferrovod does not take them for one host.
    addrs = [nodes[ids[0]][1] for ids in by_node.values()]
    hosts, order = [], []
    gpus_of_node: Dict[str, List[str]] = {}
    for (node_id, ids), addr in zip(by_node.items(), addrs):
        ids = sorted(ids, key=lambda i: (gpu_key(i), i))
        order += ids
        name = addr if addrs.count(addr) == 1 else f"{addr}-{node_id[:12]}"
        hosts.append(HostInfo(name, len(ids)))
        gpus_of_node[node_id] = [g for i in ids for g in nodes[i][2]]
    slots = get_host_assignments(hosts, len(nodes))
    return order, slots, gpus_of_node
