"""The elastic driver: owns an elastic job's membership while workers come and go.

* **Hosts.** A discovery script is run about once a second; it prints ``host[:slots]`` per
  line (bare names take ``--slots-per-host``, else the MPI Operator's
  ``OMPI_MCA_orte_set_default_slots``). A failure of its first run ends the launch; later
  failures are retried until the elastic timeout. Without a script the hosts are ``-H`` /
  ``--hostfile``'s, fixed (fault tolerance only).
* **Order.** Hosts keep the order they joined in, oldest first, and ranks are dealt in that
  order: the new rank 0 is always a survivor, which holds the committed state. A blacklisted
  host goes to the end: when it comes back, its workers are new. A membership whose rank 0
  would still be a new worker (discovery removed every survivor's host) is not made: the
  current workers train on, or, when one of them failed, the job ends saying why.
* **Failures.** A worker that exits non-zero puts its host on the blacklist: for good, or with
  ``--blacklist-cooldown-range LO HI`` for ``LO * 2**n`` seconds (at most ``HI``) after its
  n-th failure, as Horovod does, after which discovery may bring it back.
* **Memberships.** Each change (a failure, hosts added or removed) is published in the
  rendezvous store as a new epoch (keys in :mod:`ferrovod.elastic.membership`); survivors reach it
  through ``HorovodInternalError`` or, for host updates, ``HostsUpdatedInterrupt`` at their
  next commit, and new workers are started for the new slots. ``--reset-limit`` bounds the
  number of new memberships after the first.
* **Never waiting forever.** Below ``--min-np`` the driver waits at most the elastic timeout
  for hosts, then publishes an abort every worker raises, and exits non-zero naming what it
  waited for. When every worker of the membership has failed there is nothing to recover (the
  committed state lived in them): the job ends at once with the first failure.
* **The end.** Once a worker exits 0 (training finished) no new membership is made; the job
  ends when every worker has exited, with 0 if they all did.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

from ...elastic import membership as _elastic
from ...elastic.membership import HostUpdateResult
from ..._defaults import default
from ..hosts import HostInfo, HostSpecError, SlotInfo, get_host_assignments, parse_hostfile_text
from ..supervisor import SpawnError, describe_status
from . import constants

__all__ = ["ElasticSettings", "Discovery", "DiscoveryError", "Blacklist", "ElasticDriver",
           "HostSource", "WorkerPool", "DISCOVER_HOSTS_FREQUENCY_SECS", "ELASTIC_TIMEOUT_SECS"]

# The two names below are Horovod's (horovod.runner.elastic.driver), which scripts and tests
# written for Horovod patch; the driver reads them each time it needs them.
#: How often the discovery script runs, in seconds.
DISCOVER_HOSTS_FREQUENCY_SECS = 1.0
#: The elastic timeout when neither --elastic-timeout nor the environment gives one.
ELASTIC_TIMEOUT_SECS = float(default(_elastic.TIMEOUT_VAR))
#: Why a job ended when its pool of workers went (``"gone"``).
GONE_MESSAGE = "the workers' pool ended: no worker can run any more"
#: After a worker fails, how long to wait for others of the same failure (a lost host takes
#: all its workers) before publishing one membership for all of them.
FAILURE_SETTLE_S = 0.3
#: How long a discovery script may run.
SCRIPT_TIMEOUT_S = 30.0
#: How long workers get to exit after an abort before they are stopped.
ABORT_GRACE_S = 10.0
#: How long the other workers get to finish after the first one has: a worker started for a
#: membership the finished ones will never join waits for them in vain.
FINISH_GRACE_S = 10.0

Log = Callable[[str], None]


@dataclass
class ElasticSettings:
    """The elastic flags, checked."""

    num_proc: int
    min_np: int
    max_np: Optional[int]
    timeout_s: float
    reset_limit: Optional[int]
    cooldown: Optional[Tuple[int, int]]
    script: Optional[str]
    fixed_hosts: Optional[List[HostInfo]]
    slots_per_host: Optional[int]
    #: How many hosts the first membership waits for (besides -np slots).
    min_start_hosts: int = 1
    #: How long the first membership waits for its slots (default: ``timeout_s``).
    start_timeout_s: Optional[float] = None
    #: What the user calls ``min_np`` in the driver's messages (the launcher's flag, or an
    #: API's argument).
    min_np_name: str = "--min-np"


class HostSource(Protocol):
    """Where the driver learns which hosts it may use: :class:`Discovery` (a script, or a
    fixed list), or Ray's cluster state (:mod:`ferrovod.ray.elastic`)."""

    #: Whether a later answer may list hosts this one did not (waiting for hosts can help).
    dynamic: bool

    def find(self) -> List[HostInfo]:
        """The hosts available now, with their slots; raises :class:`DiscoveryError`."""


class WorkerPool(Protocol):
    """What starts and watches the workers the driver asks for: ``ferrovodrun``'s
    :class:`~ferrovod.runner.supervisor.Supervisor` (processes, local or over ssh), or Ray
    actors (:mod:`ferrovod.ray.elastic`). A worker is known by the number its spec gives."""

    def add(self, specs: Sequence[Any]) -> None:
        """Starts the workers of ``specs`` (what ``spec_for`` built); raises ``SpawnError``."""

    def next_event(self, timeout: float) -> Optional[Tuple[str, int, int]]:
        """The next ``("exit", worker, status)`` (a negative status: killed by that signal),
        ``("signal", -1, signum)`` (the launcher was asked to stop) or ``("gone", -1, 0)``
        (the pool can run no worker any more: its platform's job ended), or None after
        ``timeout`` seconds."""

    def keep_reaping(self, on: bool) -> None:
        """While on, no worker left is not the end of the job (between two memberships)."""

    def stop(self) -> None:
        """Stops every worker still running."""


class DiscoveryError(RuntimeError):
    """The discovery script failed or printed something that is not a host list."""


class Discovery:
    """The hosts available now: the script's answer, or the fixed list.

    ``dynamic``: whether a later answer may list hosts this one did not (a script may; a
    fixed list never does), so that waiting for hosts can help."""

    def __init__(self, settings: ElasticSettings, environ: Dict[str, str],
                 run: Callable[[str, float], "subprocess.CompletedProcess[str]"]) -> None:
        self._run = run
        self._script = settings.script
        self._fixed = settings.fixed_hosts
        self._default_slots = settings.slots_per_host
        self.dynamic = self._script is not None
        if self._default_slots is None:
            text = environ.get("OMPI_MCA_orte_set_default_slots", "").strip()
            if text.isdigit() and int(text) > 0:
                self._default_slots = int(text)

    def find(self) -> List[HostInfo]:
        if self._script is None:
            return list(self._fixed or [])
        try:
            proc = self._run(self._script, SCRIPT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"the host discovery script {self._script!r} ran longer than "
                                 f"{SCRIPT_TIMEOUT_S:g} s") from None
        if proc.returncode != 0:
            err = proc.stderr.strip().splitlines()[-1:] or ["no output on stderr"]
            raise DiscoveryError(f"the host discovery script {self._script!r} exited with "
                                 f"{describe_status(proc.returncode)}: {err[0]}")
        return self.parse(proc.stdout)

    def parse(self, text: str) -> List[HostInfo]:
        lines = []
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            if ":" not in line:
                if self._default_slots is None:
                    raise DiscoveryError(
                        f"the host discovery script printed {line!r} (line {number}) without "
                        "a slot count: print host:slots, or give --slots-per-host")
                line = f"{line}:{self._default_slots}"
            lines.append(line)
        try:
            return parse_hostfile_text("\n".join(lines), source="host discovery script")
        except HostSpecError as exc:
            raise DiscoveryError(str(exc)) from None


class Blacklist:
    """Hosts whose workers failed: kept out for good, or for a cooldown that doubles with each
    failure of the host (``LO * 2**n`` seconds after the n-th, at most ``HI``: Horovod's)."""

    def __init__(self, cooldown: Optional[Tuple[int, int]]) -> None:
        self._cooldown = cooldown
        self._failures: Dict[str, int] = {}
        self._until: Dict[str, float] = {}

    def add(self, host: str, now: float) -> float:
        """Blacklists ``host``; returns for how long (``inf``: for good)."""
        n = self._failures.get(host, 0) + 1
        self._failures[host] = n
        if self._cooldown is None:
            span = math.inf
        else:
            lo, hi = self._cooldown
            span = float(min(lo * 2 ** n, hi))
        self._until[host] = now + span
        return span

    def blocked(self, host: str, now: float) -> bool:
        return self._until.get(host, -math.inf) > now

    def any_returning(self, now: float) -> bool:
        """Whether a blacklisted host will be let back in some day."""
        return any(now < t < math.inf for t in self._until.values())


@dataclass
class _Worker:
    wid: int
    host: str
    local_rank: int
    alive: bool = True
    removed: bool = False
    code: Optional[int] = None
    # A failure the job recovered from: a later membership went on without this worker.
    recovered: bool = False


@dataclass
class _Membership:
    epoch: int
    slots: Dict[Tuple[str, int], SlotInfo] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.slots)


class ElasticDriver:
    """Runs an elastic job to its end; see the module doc.

    ``spec_for(slot, wid, epoch)`` builds what ``supervisor`` starts a new worker for ``slot``
    from (numbered ``wid``), ``store`` is the launcher's rendezvous server (``set(key, value)``).
    """

    def __init__(self, settings: ElasticSettings, discovery: HostSource, store: object,
                 supervisor: WorkerPool, spec_for: Callable[[SlotInfo, int, int], Any],
                 log: Log, verbose: bool = False,
                 prepare: Optional[Callable[[List[SlotInfo]], Dict[Tuple[str, int],
                                                                   Dict[str, str]]]] = None
                 ) -> None:
        self.s = settings
        self.discovery = discovery
        self.store = store
        self.sup = supervisor
        self.spec_for = spec_for
        # Called with a membership's slots before it is published: what each slot's place
        # adds (the store address its worker forms with); may raise SpawnError.
        self.prepare = prepare or (lambda slots: {})
        self.log = log
        self.verbose = verbose
        self.blacklist = Blacklist(settings.cooldown)
        self.order: List[str] = []  # hosts in the order they joined
        self.hosts: Dict[str, int] = {}  # host -> slots, as last discovered
        self.workers: Dict[int, _Worker] = {}
        self.current = _Membership(epoch=0)
        self.resets = 0
        self.finishing = False
        self.aborted = False
        self.finish_by = math.inf
        self.first_failure: Optional[_Worker] = None
        #: Why the job failed, once it has (what ``_run_elastic`` raises).
        self.error: Optional[str] = None
        self._next_wid = 0
        self._last_discovery = -math.inf
        self._discovery_failing_since: Optional[float] = None

    # -- hosts ----------------------------------------------------------------------------------

    def _discover(self, now: float, first: bool = False) -> bool:
        """Runs discovery if it is due; returns whether the host list changed."""
        if not first and now - self._last_discovery < DISCOVER_HOSTS_FREQUENCY_SECS:
            return False
        self._last_discovery = now
        try:
            found = self.discovery.find()
        except DiscoveryError as exc:
            if first:
                raise
            if self._discovery_failing_since is None:
                self._discovery_failing_since = now
                self.log(f"warning: {exc}; retrying")
            if now - self._discovery_failing_since > self.s.timeout_s:
                raise DiscoveryError(f"{exc} (failing for longer than the elastic timeout, "
                                     f"{self.s.timeout_s:g} s)") from None
            return False
        self._discovery_failing_since = None
        hosts = {h.hostname: h.slots for h in found}
        changed = hosts != self.hosts
        for h in found:
            if h.hostname not in self.order:
                self.order.append(h.hostname)
        # A host that disappeared and comes back later joins at the end again.
        self.order = [h for h in self.order if h in hosts]
        self.hosts = hosts
        return changed

    def _plan(self, now: float) -> List[SlotInfo]:
        usable = [HostInfo(h, self.hosts[h]) for h in self.order
                  if h in self.hosts and not self.blacklist.blocked(h, now)]
        if not usable:
            return []
        # Hosts whose workers hold the committed state come first, whatever their age: rank 0
        # hands every rank its state (a host back from its cooldown, or added, is fresh).
        holding = {w.host for w in self.workers.values() if w.alive and not w.removed
                   and (w.host, w.local_rank) in self.current.slots}
        usable.sort(key=lambda h: h.hostname not in holding)
        try:
            return get_host_assignments(usable, 0, self.s.max_np)
        except HostSpecError:
            return []

    # -- memberships ----------------------------------------------------------------------------

    def _publish(self, slots: List[SlotInfo], update: HostUpdateResult) -> None:
        """Publishes the next membership; raises SpawnError (nothing published) when a new
        host of it cannot take workers."""
        extras = self.prepare(slots)
        epoch = self.current.epoch + 1
        new = _Membership(epoch, {(s.hostname, s.local_rank): s for s in slots})
        for (host, lr), slot in new.slots.items():
            place: Dict[str, object] = {
                "rank": slot.rank, "size": slot.size, "local_rank": slot.local_rank,
                "local_size": slot.local_size, "cross_rank": slot.cross_rank,
                "cross_size": slot.cross_size, **extras.get((host, lr), {})}
            self._set(_elastic.slot_key(epoch, host, lr), place)
        for w in self.workers.values():
            if w.alive and (w.host, w.local_rank) not in new.slots:
                w.removed = True
                self._set(_elastic.slot_key(epoch, w.host, w.local_rank),
                          {"removed": f"no slot {w.local_rank} on {w.host} in epoch {epoch}"})
        self._set(_elastic.ready_key(epoch), {"update": int(update)})
        self._set(_elastic.LATEST_KEY, epoch)
        for w in self.workers.values():
            if w.code not in (0, None):
                w.recovered = True
        self.current = new
        ranks = ", ".join(f"{h}[{lr}]={s.rank}" for (h, lr), s in sorted(
            new.slots.items(), key=lambda kv: kv[1].rank))
        self.log(f"elastic: epoch {epoch}: {new.size} worker(s): {ranks}")

    def _abort(self, why: str) -> None:
        self.aborted = True
        self.error = why
        epoch = self.current.epoch + 1
        for w in self.workers.values():
            if w.alive:
                self._set(_elastic.slot_key(epoch, w.host, w.local_rank), {"abort": why})
        self._set(_elastic.ready_key(epoch), {"update": 0})
        self._set(_elastic.LATEST_KEY, epoch)
        self.current = _Membership(epoch)

    def _set(self, key: str, value: object) -> None:
        self.store.set(key, json.dumps(value).encode())  # type: ignore[attr-defined]

    def _spawn_missing(self) -> None:
        have = {(w.host, w.local_rank) for w in self.workers.values() if w.alive and not w.removed}
        specs = []
        for key, slot in self.current.slots.items():
            if key in have:
                continue
            wid = self._next_wid
            self._next_wid += 1
            self.workers[wid] = _Worker(wid, slot.hostname, slot.local_rank)
            specs.append(self.spec_for(slot, wid, self.current.epoch))
        if specs:
            self.sup.add(specs)

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job; returns the launcher's exit status."""
        self.sup.keep_reaping(True)
        try:
            return self._run()
        finally:
            self.sup.keep_reaping(False)
            self.sup.stop()

    def _fail(self, why: str, code: int = 1) -> int:
        self.error = why
        self.log(f"error: {why}")
        return code

    def _run(self) -> int:
        start = time.monotonic()
        try:
            self._discover(start, first=True)
        except DiscoveryError as exc:
            return self._fail(str(exc))
        # The job starts once -np slots (on at least min_start_hosts hosts) exist, waiting at
        # most the elastic timeout.
        slots = self._plan(start)
        need_hosts = self.s.min_start_hosts
        wait_s, wait_name = ((self.s.timeout_s, "the elastic timeout")
                             if self.s.start_timeout_s is None
                             else (self.s.start_timeout_s, "the start timeout"))
        while len(slots) < self.s.num_proc or len({s.hostname for s in slots}) < need_hosts:
            if time.monotonic() - start > wait_s:
                return self._fail(
                    f"waited {wait_s:g} s ({wait_name}) for {self.s.num_proc} "
                    f"slots on at least {need_hosts} host(s) to start with; found {len(slots)} "
                    f"on {len({s.hostname for s in slots})}")
            code = self._stopping(0.2)
            if code is not None:
                return code
            try:
                self._discover(time.monotonic())
            except DiscoveryError as exc:
                return self._fail(str(exc))
            slots = self._plan(time.monotonic())
        try:
            self._publish(slots, HostUpdateResult.no_update)
            self._spawn_missing()
        except SpawnError as exc:
            self.error = str(exc)
            self.log(str(exc))
            return exc.exit_code
        return self._watch()

    def _stopping(self, timeout: float) -> Optional[int]:
        """Waits for the next event; the launcher's exit status when it ends the job (a
        signal, or the pool gone), else None."""
        event = self.sup.next_event(timeout)
        if event is None:
            return None
        if event[0] == "signal":
            return 128 + event[2]
        if event[0] == "gone":
            return self._fail(GONE_MESSAGE)
        self._exited(event[1], event[2])
        return None

    def _exited(self, wid: int, code: int) -> bool:
        """Records a worker's exit; returns whether it was a failure of a member."""
        w = self.workers.get(wid)
        if w is None:
            return False
        w.alive, w.code = False, code
        if w.removed:
            return False
        if code == 0:
            if not self.finishing:
                if self.verbose:
                    self.log(f"elastic: {w.host}[{w.local_rank}] finished; no more resets")
                self.finish_by = time.monotonic() + FINISH_GRACE_S
            self.finishing = True
            return False
        if self.first_failure is None:
            self.first_failure = w
        if self.finishing or self.aborted:
            return False
        span = self.blacklist.add(w.host, time.monotonic())
        # Its workers all leave, so when its cooldown ends it comes back holding no state,
        # like a new host: at the end of the order, never ahead of the survivors' hosts (a
        # returning host first in the order gave rank 0 to a fresh worker, whose empty state
        # the sync then gave every rank).
        if w.host in self.order:
            self.order.remove(w.host)
            self.order.append(w.host)
        for_how_long = "for good" if span == math.inf else f"for {span:g} s"
        self.log(f"elastic: {w.host}[{w.local_rank}] failed with {describe_status(code)}; "
                 f"blacklisting {w.host} {for_how_long}")
        return True

    def _watch(self) -> int:
        pending_change = False
        failed = False
        below_since: Optional[float] = None
        orphaned_logged = False
        while True:
            event = self.sup.next_event(0.1)
            now = time.monotonic()
            if event is not None:
                if event[0] == "signal":
                    self.log(f"received signal {event[2]}, stopping the workers")
                    return 128 + event[2]
                if event[0] == "gone":
                    return self._fail(GONE_MESSAGE)
                if self._exited(event[1], event[2]):
                    failed = pending_change = True
                    # Let the rest of one failure (a whole host) arrive before deciding.
                    settle = now + FAILURE_SETTLE_S
                    while (left := settle - time.monotonic()) > 0:
                        ev = self.sup.next_event(left)
                        if ev is not None and ev[0] == "exit":
                            self._exited(ev[1], ev[2])
            if not any(w.alive for w in self.workers.values()):
                if pending_change and not self.finishing and not self.aborted:
                    # Horovod stops here too: new workers would start from scratch.
                    self.log("elastic: every worker has failed; no survivor holds the committed "
                             "state, so the job ends")
                return self._final_status()
            if self.finishing:
                if now > self.finish_by:
                    late = [w for w in self.workers.values() if w.alive]
                    self.log(f"elastic: the job finished; stopping {len(late)} worker(s) that "
                             f"had not after {FINISH_GRACE_S:g} s: "
                             + ", ".join(f"{w.host}[{w.local_rank}]" for w in late))
                    for w in late:
                        w.removed = True
                    return self._final_status()
                continue
            try:
                if self._discover(now):
                    pending_change = True
            except DiscoveryError as exc:
                self.log(f"error: {exc}")
                self._abort(str(exc))
                return self._end(1)
            slots = self._plan(now)
            new = {(s.hostname, s.local_rank) for s in slots}
            old = set(self.current.slots)
            if new == old and not failed:
                # A change that moves no slot (a blacklisted host listed or dropped, a host
                # beyond --max-np) leaves the membership as it is: a reset would cost every
                # worker a new formation for nothing.
                pending_change = False
                continue
            # A blacklisted host's cooldown may also have ended with discovery's list unchanged.
            pending_change = True
            if len(slots) < self.s.min_np:
                if below_since is None:
                    below_since = now
                    self.log(f"elastic: {len(slots)} slot(s) available, fewer than "
                             f"{self.s.min_np_name} {self.s.min_np}; waiting up to {self.s.timeout_s:g} s for hosts")
                recoverable = self._can_recover(now)
                if now - below_since > self.s.timeout_s or not recoverable:
                    why = (f"waited {now - below_since:.0f} s (elastic timeout "
                           f"{self.s.timeout_s:g} s) for at least {self.s.min_np} slots "
                           f"({self.s.min_np_name}); {len(slots)} available" if recoverable else
                           f"{len(slots)} slot(s) left and no host can come back "
                           f"(need {self.s.min_np_name} {self.s.min_np})")
                    self.log(f"error: {why}")
                    self._abort(why)
                    return self._end(1)
                continue
            # Rank 0 hands every rank its state at the reset, so it must be a worker that holds
            # the committed state. A membership whose rank 0 would be a new worker (discovery
            # removed the hosts of every survivor and listed fresh ones) would start training
            # over: none is made, and the current workers train on (if they die, the job ends
            # as any job whose every worker failed).
            holders = {(w.host, w.local_rank) for w in self.workers.values()
                       if w.alive and not w.removed and (w.host, w.local_rank) in old}
            first = min(slots, key=lambda slot: slot.rank)
            if holders and (first.hostname, first.local_rank) not in holders:
                if failed:
                    # The survivors wait in their reset for a membership none can be given.
                    why = ("a worker failed and the hosts listed keep no worker of the current "
                           "membership to be rank 0 and hand on the committed state (discovery "
                           "removed their hosts); new workers alone would start training over")
                    self.log(f"error: {why}")
                    self._abort(why)
                    return self._end(1)
                if not orphaned_logged:
                    orphaned_logged = True
                    self.log("elastic: the hosts listed keep no worker of the current membership "
                             "to be rank 0 and hand on the committed state; the current workers "
                             "train on until one of their hosts is listed again")
                continue
            orphaned_logged = False
            below_since = None
            if self.s.reset_limit is not None and self.resets >= self.s.reset_limit:
                why = constants.RESET_LIMIT_EXCEEDED_MESSAGE.format(self.s.reset_limit)
                self.log(f"error: {why}")
                self._abort(why)
                return self._end(1)
            self.resets += 1
            update = HostUpdateResult.no_update
            if new - old:
                update |= HostUpdateResult.added
            if old - new or failed:
                update |= HostUpdateResult.removed
            pending_change = failed = False
            try:
                self._publish(slots, update)
                self._spawn_missing()
            except SpawnError as exc:
                self.log(str(exc))
                self._abort(str(exc))
                return self._end(exc.exit_code)

    def _can_recover(self, now: float) -> bool:
        """Whether waiting can bring slots: discovery may report new hosts, or a blacklisted
        host may come back after its cooldown."""
        return self.discovery.dynamic or self.blacklist.any_returning(now)

    def _end(self, code: int) -> int:
        """After an abort: lets the workers raise it and exit, then stops what is left."""
        deadline = time.monotonic() + ABORT_GRACE_S
        while any(w.alive for w in self.workers.values()) and time.monotonic() < deadline:
            if self._stopping(0.1) is not None:
                break
        return code

    def _final_status(self) -> int:
        members = [w for w in self.workers.values() if not w.removed and not w.recovered]
        bad = [w for w in members if w.code not in (0, None)]
        if not bad and any(w.code == 0 for w in members):
            return 0
        first = self.first_failure if self.first_failure in bad else (
            bad[0] if bad else self.first_failure)
        if first is None:
            return self._fail("every worker left the job without finishing")
        if self.error is None:
            self.error = constants.WORKER_FAILURE_MESSAGE.format(
                name=f"{first.host}[{first.local_rank}]", status=describe_status(first.code or 1))
        self.log(f"error: the elastic job ended without finishing; the first failure was "
                 f"{first.host}[{first.local_rank}] with {describe_status(first.code or 1)}")
        code = first.code or 1
        return 128 - code if code < 0 else code


