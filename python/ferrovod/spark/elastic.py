"""``ferrovod.spark.run_elastic``: an elastic ferrovod job on Spark tasks (Horovod's
``horovod.spark.run_elastic``).

Spark runs ``max_num_proc`` ordinary tasks (not a barrier stage: they need not start at once,
and one that fails does not fail the others). Each task offers its executor's host to the job
and waits; the driver side runs the elastic driver of ``ferrovodrun``
(:mod:`ferrovod.runner.elastic.driver`), with two parts of this module in its places:

* **Hosts** (:class:`TaskHosts`): a host holds as many slots as it has tasks waiting or
  running a worker. A task Spark starts later (one it could not place before, or one it runs
  again after losing it with its executor) adds a slot; a task that stops beating is lost.
* **Workers** (:class:`TaskPool`): the driver's request for a worker on a host goes to a
  waiting task there, which runs it as a fresh Python (``ferrovod.runner.run_task``, as
  ``ferrovod.run`` does) and reports its exit. Then the task offers its host again, so a
  host whose worker failed can take a new one once its blacklisting ends.

Everything travels through the job's rendezvous store, in the driver: the offers, the
requests, the beats and exits, the function, and the results of the last membership's ranks.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..runner.elastic import worker_extras
from ..runner.elastic.driver import DiscoveryError, ElasticDriver, ElasticSettings
from ..runner.hosts import HostInfo, SlotInfo
from ..runner.supervisor import SpawnError
from ..runner.worker_env import slot_env

__all__ = ["run_elastic", "TaskHosts", "TaskPool"]

WHO = "ferrovod.spark.run_elastic"
_PREFIX = "spark/elastic/"
OFFERS_KEY = _PREFIX + "offers"  # how many offers tasks have made (counter)
EXITS_KEY = _PREFIX + "exits"  # how many workers have ended (counter)
END_KEY = _PREFIX + "end"  # set by the driver when the job is over

#: How often a task beats, and how long the driver waits for a beat before it takes the task
#: (and its worker) for lost: its executor died, or Spark killed it.
BEAT_S = 1.0
SILENT_S = 10.0

# (offer, worker, exit code, captured stdout, captured stderr) of each worker a task ran.
WorkerStatus = Tuple[int, int, int, bytes, bytes]


def offer_key(k: int) -> str:
    return f"{_PREFIX}offer/{k}"


def request_key(k: int) -> str:
    return f"{_PREFIX}request/{k}"


def beat_key(k: int) -> str:
    return f"{_PREFIX}beat/{k}"


def exit_key(k: int) -> str:
    return f"{_PREFIX}exit/{k}"


@dataclass
class _Offer:
    """A task's offer of its host: waiting, then running worker ``wid``, then spent."""

    k: int
    host: str
    wid: Optional[int] = None
    spent: bool = False
    beat: int = -1
    beat_at: float = field(default_factory=time.monotonic)


class TaskHosts:
    """The hosts of the tasks that are waiting or running a worker (a
    :class:`~ferrovod.runner.elastic.driver.HostSource`)."""

    dynamic = True

    def __init__(self, store: Any) -> None:
        self.store = store
        self.offers: Dict[int, _Offer] = {}
        self.lost: Dict[int, str] = {}  # worker -> why, for offers that stopped beating
        self._read_at = -SILENT_S

    def refresh(self, every_s: float = 0.0) -> None:
        """Reads new offers and the beats of the live ones (unless they were read less than
        ``every_s`` seconds ago)."""
        if time.monotonic() - self._read_at < every_s:
            return
        self._read_at = time.monotonic()
        made = self.store.add(OFFERS_KEY, 0)
        for k in range(len(self.offers), made):
            raw = self.store.get(offer_key(k), 5.0)
            info = json.loads(raw) if raw else {"host": "?"}
            self.offers[k] = _Offer(k, info["host"], spent=raw is None)
        now = time.monotonic()
        for offer in self.offers.values():
            if offer.spent:
                continue
            beat = self.store.add(beat_key(offer.k), 0)
            if beat != offer.beat:
                offer.beat, offer.beat_at = beat, now
            elif now - offer.beat_at > SILENT_S:
                offer.spent = True
                if offer.wid is not None:
                    self.lost[offer.wid] = (f"its Spark task on {offer.host} stopped beating "
                                            f"for {SILENT_S:g} s (a lost executor)")

    def find(self) -> List[HostInfo]:
        try:
            # The pool reads the offers too, while it waits for the workers' exits.
            self.refresh(every_s=BEAT_S)
        except Exception as exc:  # noqa: BLE001 - the store in this process: retried
            raise DiscoveryError(f"{WHO}: cannot read the tasks' offers: {exc}") from None
        slots: Dict[str, int] = {}
        for offer in self.offers.values():
            if not offer.spent:
                slots[offer.host] = slots.get(offer.host, 0) + 1
        return [HostInfo(h, n) for h, n in slots.items()]


@dataclass
class _WorkerSpec:
    wid: int
    host: str
    env: Dict[str, str]


class TaskPool:
    """The driver's workers, run by waiting tasks (a
    :class:`~ferrovod.runner.elastic.driver.WorkerPool`)."""

    def __init__(self, hosts: TaskHosts, stage_over: Callable[[], bool]) -> None:
        self.hosts = hosts
        self.store = hosts.store
        self.stage_over = stage_over
        self.running: Dict[int, _Offer] = {}  # worker -> the offer running it
        self._exits_seen = 0

    def add(self, specs: Sequence[_WorkerSpec]) -> None:
        for spec in specs:
            offer = next((o for o in self.hosts.offers.values() if o.host == spec.host
                          and not o.spent and o.wid is None), None)
            if offer is None:
                raise SpawnError(spec.wid, spec.host, OSError(
                    0, "no Spark task is waiting on that host any more"))
            offer.wid = spec.wid
            self.running[spec.wid] = offer
            self.store.set(request_key(offer.k),
                           json.dumps({"wid": spec.wid, "env": spec.env}).encode())

    def next_event(self, timeout: float) -> Optional[Tuple[str, int, int]]:
        end = time.monotonic() + timeout
        while True:
            exits = self.store.add(EXITS_KEY, 0)
            if exits != self._exits_seen:
                for wid, offer in list(self.running.items()):
                    raw = self.store.get(exit_key(offer.k), 0.0)
                    if raw is not None:
                        self._exits_seen += 1
                        offer.spent = True
                        del self.running[wid]
                        return ("exit", wid, int(raw))
            self.hosts.refresh(every_s=BEAT_S)
            for wid, offer in list(self.running.items()):
                if offer.spent:  # stopped beating
                    del self.running[wid]
                    return ("exit", wid, -9)
            if self.stage_over() and not self.running:
                return ("gone", -1, 0)
            left = end - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(left, 0.2))

    def keep_reaping(self, on: bool) -> None:
        """Nothing to do: the tasks report their workers' ends through the store."""

    def stop(self) -> None:
        """Ends the job: waiting tasks return, running ones stop their workers."""
        self.store.set(END_KEY, b"1")


def run_elastic(fn: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
                num_proc: Optional[int] = None, min_num_proc: Optional[int] = None,
                max_num_proc: Optional[int] = None, start_timeout: Optional[int] = None,
                elastic_timeout: Optional[int] = None, reset_limit: Optional[int] = None,
                env: Optional[Dict[str, str]] = None, stdout: Optional[IO[str]] = None,
                stderr: Optional[IO[str]] = None, verbose: int = 1,
                nics: Optional[Iterable[str]] = None, prefix_output_with_timestamp: bool = False,
                min_np: Optional[int] = None, max_np: Optional[int] = None,
                cooldown_range: Optional[Tuple[int, int]] = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` as an elastic job on Spark tasks; returns the results of
    the last membership's ranks, rank 0's first. ``fn`` uses ``ferrovod.elastic.run`` (or its
    framework's).

    Args:
        num_proc: ranks to start with (default ``spark.default.parallelism``).
        min_num_proc: the fewest ranks training goes on with (default ``num_proc``).
        max_num_proc: the most ranks (default ``num_proc``); Spark runs this many tasks.
        start_timeout: seconds for Spark to start ``num_proc`` tasks (default
            ``FERROVOD_SPARK_START_TIMEOUT``, ``HOROVOD_SPARK_START_TIMEOUT``, else 600).
        elastic_timeout: seconds to wait for ``min_num_proc`` slots after a change (default
            ``FERROVOD_ELASTIC_TIMEOUT``, ``HOROVOD_ELASTIC_TIMEOUT``, else 600).
        reset_limit: at most this many new memberships after the first.
        cooldown_range: ``(LO, HI)``: a host whose worker failed comes back after
            ``LO * 2**n`` seconds, at most ``HI`` (``ferrovodrun``'s
            ``--blacklist-cooldown-range``); without it, never.
        env, stdout, stderr, verbose, nics, prefix_output_with_timestamp: as for
            :func:`ferrovod.spark.run`; captured lines are prefixed by worker number.
        min_np, max_np: Horovod's deprecated names of ``min_num_proc``, ``max_num_proc``.

    Raises ``RuntimeError`` when the job cannot go on (every worker failed, too few slots for
    longer than the elastic timeout, the reset limit), naming the first worker that failed.
    """
    import cloudpickle
    import pyspark

    from ..elastic import membership as _elastic
    from .._core import RendezvousServer, StoreClient  # type: ignore[import-not-found,unused-ignore]
    from ..runner.outcome import first_failure
    from ..runner.run_func import FUNC_KEY, SIZE_KEY, result_key
    from . import _deliver, _driver_address, _start_timeout

    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(f"{WHO}: no active SparkContext; create a SparkSession first")
    if num_proc is None:
        num_proc = sc.defaultParallelism
    min_num_proc = num_proc if min_num_proc is None else min_num_proc
    max_num_proc = num_proc if max_num_proc is None else max_num_proc
    if not (isinstance(min_num_proc, int) and 1 <= min_num_proc <= num_proc <= max_num_proc):
        raise ValueError(f"{WHO}: needs 1 <= min_num_proc <= num_proc <= max_num_proc, got "
                         f"{min_num_proc}, {num_proc}, {max_num_proc}")
    timeout = _start_timeout(start_timeout)
    elastic_s = float(elastic_timeout) if elastic_timeout is not None else _elastic.timeout_s()
    settings = ElasticSettings(num_proc=num_proc, min_np=min_num_proc, max_np=max_num_proc,
                               timeout_s=elastic_s, reset_limit=reset_limit,
                               cooldown=tuple(cooldown_range) if cooldown_range else None,
                               script=None, fixed_hosts=None, slots_per_host=None,
                               start_timeout_s=float(timeout), min_np_name="min_num_proc")
    secret = os.urandom(32)
    server = RendezvousServer(secret, _driver_address(sc))
    client = StoreClient(str(server.addr), secret, 30.0)
    job = {
        "addr": str(server.addr), "secret": secret.hex(), "timeout": timeout,
        "env": dict(env or {}), "iface": sorted(nics)[0] if nics else None,
        "capture": stdout is not None or stderr is not None,
    }
    group = f"ferrovod.spark.run_elastic.{uuid.uuid4().hex[:12]}"
    done: Dict[str, Any] = {}

    def stage() -> None:
        try:
            sc.setJobGroup(group, f"{WHO} ({num_proc} ranks)", interruptOnCancel=True)
            rdd = sc.parallelize(range(max_num_proc), max_num_proc)
            done["statuses"] = rdd.mapPartitions(lambda it: _task(job, it)).collect()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = exc

    def log(line: str) -> None:
        if verbose or line.startswith("error"):
            sys.stderr.write(f"{WHO}: {line}\n")

    hosts = TaskHosts(client)
    thread = threading.Thread(target=stage, name=group, daemon=True)
    pool = TaskPool(hosts, lambda: not thread.is_alive() and "error" in done)

    def spec_for(slot: SlotInfo, wid: int, epoch: int) -> _WorkerSpec:
        extra = dict(slot_env(slot), **worker_extras(slot, epoch, settings))
        return _WorkerSpec(wid, slot.hostname, extra)

    driver = ElasticDriver(settings, hosts, server, pool, spec_for, log, verbose >= 2)
    statuses: List[WorkerStatus] = []
    try:
        server.set(FUNC_KEY, cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
        if verbose:
            log(f"{num_proc} rank(s) ({min_num_proc} to {max_num_proc}) on Spark tasks, "
                f"rendezvous at {job['addr']}")
        thread.start()
        code = driver.run()
        thread.join(SILENT_S + 15)
        if thread.is_alive():
            sc.cancelJobGroup(group)
            thread.join(30)
        statuses = list(done.get("statuses", []))
        _deliver([(wid, code_, out, err) for _, wid, code_, out, err in statuses],
                 stdout, stderr, prefix_output_with_timestamp)
        # The last membership's size, which its rank 0 leaves with its result; a job that
        # failed may have left results (tracebacks) under any rank.
        size_raw = client.get(SIZE_KEY, 0.0) if code == 0 else None
        outcomes = {}
        for rank in range(int(size_raw) if size_raw else max_num_proc):
            raw = client.get(result_key(rank), 0.0)
            if raw is not None:
                outcomes[rank] = cloudpickle.loads(raw)
    finally:
        server.close()
    if code != 0:
        why = driver.error or f"the elastic job failed ({code})"
        first = driver.first_failure
        lost = hosts.lost.get(first.wid) if first is not None else None
        if "error" in done:
            from . import _essence

            why, lost = f"the Spark job failed: {_essence(done['error'])}", None
        raised = first_failure(WHO, outcomes)
        raise RuntimeError(f"{WHO}: {why}" + (f" ({lost})" if lost else "")
                           + (f"\n{raised}" if raised is not None else ""))
    raised = first_failure(WHO, outcomes)
    if raised is not None:
        raise raised
    return [outcomes[r][1] for r in sorted(outcomes)]


def _address_towards(addr: str) -> str:
    """This executor's address on the route to the driver's store (what its peers reach it
    at, as a ``ferrovodrun`` host is named)."""
    host, port = addr.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, int(port)))
        return str(s.getsockname()[0])


def _task(job: Dict[str, Any], _: Iterator[int]) -> Iterator[WorkerStatus]:
    """One Spark task: offers its host, runs the workers the driver asks of it one after the
    other (a new offer after each), until the driver ends the job."""
    from .._core import StoreClient  # type: ignore[import-not-found,unused-ignore]
    from . import _die_with_parent as die_with_parent
    from . import _rank_env

    store = StoreClient(job["addr"], bytes.fromhex(job["secret"]), 30.0)
    host = _address_towards(job["addr"])
    ran: List[WorkerStatus] = []
    while store.get(END_KEY, 0.0) is None:
        k = store.add(OFFERS_KEY, 1) - 1
        store.set(offer_key(k), json.dumps({"host": host}).encode())
        request = None
        while request is None:
            store.add(beat_key(k), 1)
            if store.get(END_KEY, 0.0) is not None:
                return iter(ran)
            raw = store.get(request_key(k), BEAT_S)
            request = json.loads(raw) if raw is not None else None
        env = _rank_env(job, request["env"])
        pipe = subprocess.PIPE if job["capture"] else None
        proc = subprocess.Popen([sys.executable, "-m", "ferrovod.runner.run_task"], env=env,
                                stdout=pipe, stderr=pipe, preexec_fn=die_with_parent)
        out, err = _wait_beating(proc, store, k)
        store.set(exit_key(k), str(proc.returncode).encode())
        store.add(EXITS_KEY, 1)
        ran.append((k, request["wid"], proc.returncode, out, err))
    return iter(ran)


def _wait_beating(proc: "subprocess.Popen[bytes]", store: Any, k: int) -> Tuple[bytes, bytes]:
    """Waits for the worker, beating for its offer; stops it once the driver ends the job."""
    chunks: Dict[str, List[bytes]] = {"out": [], "err": []}
    readers = [threading.Thread(target=lambda s=s, n=n: chunks[n].append(s.read()), daemon=True)
               for s, n in ((proc.stdout, "out"), (proc.stderr, "err")) if s is not None]
    for r in readers:
        r.start()
    ended_at: Optional[float] = None
    while True:
        try:
            proc.wait(BEAT_S)
            break
        except subprocess.TimeoutExpired:
            pass
        store.add(beat_key(k), 1)
        if ended_at is None and store.get(END_KEY, 0.0) is not None:
            ended_at = time.monotonic()
            proc.terminate()
        elif ended_at is not None and time.monotonic() - ended_at > 10:
            proc.kill()
    for r in readers:
        r.join()
    return b"".join(chunks["out"]), b"".join(chunks["err"])
