"""The worker side of an elastic job (``ferrovodrun --min-np`` / ``--host-discovery-script``).

The launcher's driver owns membership (see ``runner/elastic/driver.py``). It publishes each new
membership as a numbered *epoch* in the job's rendezvous store, under these keys:

``elastic/e<E>/slot/<host>/<local rank>``
    this worker's place in epoch E, as JSON: ``{"rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size"}``, or ``{"removed": why}`` (the worker leaves the job), or
    ``{"abort": why}`` (the job ends: below ``--min-np`` for the elastic timeout, the reset
    limit reached);
``elastic/e<E>/ready``
    set once every slot of E is: JSON ``{"update": HostUpdateResult}``, what E changed;
``elastic/latest``
    the newest epoch.

``init()`` in a worker of an elastic job calls :func:`join_next`: it waits (up to the elastic
timeout) for an epoch newer than the last one this process formed, takes the newest, rewrites
the topology variables (as Horovod rewrites ``HOROVOD_RANK`` and the others) and forms the job
with the epoch as its generation, which every member shares. A watcher thread waits for the
epoch after the current one and tells whoever registered with :func:`on_hosts_updated` of
host changes (the elastic states, through :mod:`ferrovod.elastic.state`), which raise
``HostsUpdatedInterrupt`` at the next commit on every rank alike.

This module is the protocol both sides import: the keys and variables above, and
:class:`HostUpdateResult`; the launcher's driver writes what the workers here read. It imports
neither the driver nor the states.
"""

from __future__ import annotations

import atexit
import enum
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from .._defaults import default, positive_seconds
from ..exceptions import FerrovodError, FerrovodTimeoutError, HorovodInternalError

__all__ = ["enabled", "join_next", "current_epoch", "watch_hosts", "on_hosts_updated",
           "HostUpdateResult", "JobStoppedError", "FormingError"]


class HostUpdateResult(enum.IntFlag):
    """What a host update did (Horovod's values): hosts were removed, added, or both."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class JobStoppedError(FerrovodError):
    """The launcher stopped the elastic job (below ``--min-np`` for the elastic timeout, the
    reset limit reached): no membership will follow."""


class FormingError(HorovodInternalError):
    """Forming the job with a membership failed (a member died or left meanwhile): the
    launcher publishes another, which a reset takes."""


ENABLED_VAR = "FERROVOD_ELASTIC"
EPOCH_VAR = "FERROVOD_ELASTIC_EPOCH"
TIMEOUT_VAR = "FERROVOD_ELASTIC_TIMEOUT"
#: Seconds the store may take to answer a key that must exist already.
_PROMPT_S = 30.0
#: How often a worker looks whether every member of its membership has arrived.
_ARRIVAL_POLL_S = 0.02
#: How much longer than the launcher a worker waits for a membership.
_LAUNCHER_MARGIN_S = 15.0
#: How long the watcher's store call may last (also how long it may delay exit).
_WATCH_POLL_S = 0.25
_TOPOLOGY = ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE")


def _settings(settings: Optional[Any] = None) -> Dict[str, Any]:
    """This worker's launch settings as the engine's config reads them (from ``settings``, a
    ``_core.Settings`` that ``init()`` read, or the environment now): nothing here parses a
    variable of the launcher's again, with defaults of its own."""
    from .. import _core

    return (settings if settings is not None else _core.read_settings()).elastic()


def enabled(settings: Optional[Any] = None) -> bool:
    """Whether this process is a worker of an elastic job (``FERROVOD_ELASTIC``, or Horovod's
    ``HOROVOD_ELASTIC``, as the engine's config reads it, from ``settings`` when given): the one
    check, for the engine's start and the optimizers alike."""
    return bool(_settings(settings)["enabled"])


_host_listeners: List[Callable[[int, HostUpdateResult], None]] = []


def on_hosts_updated(listener: Callable[[int, HostUpdateResult], None]) -> None:
    """Registers ``listener(epoch, update)``, called by the watcher thread for every host
    update the launcher publishes."""
    if listener not in _host_listeners:
        _host_listeners.append(listener)


def slot_key(epoch: int, host: str, local_rank: int) -> str:
    return f"elastic/e{epoch}/slot/{host}/{local_rank}"


def ready_key(epoch: int) -> str:
    return f"elastic/e{epoch}/ready"


LATEST_KEY = "elastic/latest"


def timeout_s(environ: Optional[Dict[str, str]] = None,
              fallback: Optional[float] = None) -> float:
    """The launcher's elastic timeout in seconds: ``FERROVOD_ELASTIC_TIMEOUT``, else
    ``HOROVOD_ELASTIC_TIMEOUT``, else ``fallback``, else the engine table's default. (A worker
    reads its own through the engine's config, :func:`_settings`.)"""
    env = os.environ if environ is None else environ
    if fallback is None:
        fallback = float(default(TIMEOUT_VAR))
    return positive_seconds(env, (TIMEOUT_VAR, "HOROVOD_ELASTIC_TIMEOUT"), fallback)


class _Worker:
    """This process's standing in the elastic job."""

    def __init__(self, settings: Dict[str, Any]) -> None:
        from .. import _core

        self.host = str(settings["hostname"])
        self.local_rank = int(settings["local_rank"])  # type: ignore[call-overload]
        # The epoch the launcher started this process for; it joins that one or a newer one.
        self.epoch = int(settings["epoch"]) - 1  # type: ignore[call-overload]
        self.timeout = float(settings["timeout"])  # type: ignore[arg-type]
        addr, secret = settings["rendezvous_addr"], settings["secret"]
        if not addr or not secret:
            raise FerrovodError("an elastic worker needs FERROVOD_RENDEZVOUS_ADDR and "
                                "FERROVOD_SECRET (start it with ferrovodrun)")
        self.store = _core.StoreClient(str(addr), bytes(secret), _PROMPT_S)  # type: ignore[arg-type]
        self.watcher: Optional[threading.Thread] = None
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def me(self) -> str:
        return f"{self.host}[{self.local_rank}]"

    def read(self, key: str, wait_s: float) -> Optional[Any]:
        raw = self.store.get(key, wait_s)
        return None if raw is None else json.loads(raw.decode())

    def join_next(self) -> int:
        # Longer than the launcher waits for hosts, so that its answer (a membership, or an
        # abort saying what it waited for) arrives first; this only ends a wait for a
        # launcher that is gone.
        wait = self.timeout + _LAUNCHER_MARGIN_S
        deadline = time.monotonic() + wait
        while True:
            want = self.epoch + 1
            left = deadline - time.monotonic()
            if left <= 0 or self.read(ready_key(want), left) is None:
                raise FerrovodTimeoutError(
                    f"{self.me()} waited {wait:g} s (the elastic timeout and then some) for the "
                    f"launcher to publish the job's next membership (epoch {want}); is "
                    "ferrovodrun still running?")
            latest = max(want, int(self.read(LATEST_KEY, _PROMPT_S) or want))
            place = self.read(slot_key(latest, self.host, self.local_rank), _PROMPT_S)
            if place is None:
                raise FerrovodError(f"the launcher published epoch {latest} without a place "
                                    f"for {self.me()}")
            if "abort" in place:
                raise JobStoppedError(f"the elastic job was stopped: {place['abort']}")
            if "removed" in place:
                sys.stderr.write(f"ferrovod: {self.me()} has been removed from the elastic job "
                                 f"({place['removed']}); exiting\n")
                sys.stderr.flush()
                raise SystemExit(0)
            with self.lock:
                self.epoch = latest
            if self._all_arrived(latest, int(place["size"]), deadline):
                break
            # A newer membership came while this one gathered: take that instead.
        for key in _TOPOLOGY:
            value = str(place[key.lower()])
            os.environ["FERROVOD_" + key] = value
            os.environ["HOROVOD_" + key] = value
        if "store" in place:
            # The forming publishes the address of the route to the store: with workers on
            # other hosts in this membership, one they can reach (see runner/elastic).
            os.environ["FERROVOD_RENDEZVOUS_ADDR"] = str(place["store"])
        return latest

    def _all_arrived(self, epoch: int, size: int, deadline: float) -> bool:
        """Counts this worker in for ``epoch`` and waits until all ``size`` members are:
        True, or False when the launcher published a newer membership first (a member
        failed, or hosts changed, while the others gathered). Only then does the forming
        start, so a new worker never waits in it for survivors still training until their
        next commit, and the forming's own timeout can stay short."""
        key = f"elastic/e{epoch}/arrived"
        count = self.store.add(key, 1)
        while count < size:
            if self.store.get(ready_key(epoch + 1), 0.0) is not None:
                return False
            if time.monotonic() > deadline:
                raise FerrovodTimeoutError(
                    f"{self.me()}: {count} of the {size} workers of the job's membership "
                    f"{epoch} arrived within the elastic timeout")
            time.sleep(_ARRIVAL_POLL_S)
            count = self.store.add(key, 0)
        return True

    def watch(self) -> None:
        if self.watcher is not None:
            return
        self.watcher = threading.Thread(target=self._watch, name="ferrovod-elastic-hosts",
                                        daemon=True)
        self.watcher.start()
        # A daemon thread still inside the native store call when the interpreter finalizes
        # would be torn down there (and abort the process): stop it first.
        atexit.register(self.stop_watching)

    def stop_watching(self) -> None:
        self.stopping.set()
        if self.watcher is not None:
            self.watcher.join(2 * _WATCH_POLL_S + 1.0)

    def _watch(self) -> None:
        told = 0
        while not self.stopping.is_set():
            with self.lock:
                nxt = max(self.epoch, told) + 1
            try:
                ready = self.read(ready_key(nxt), _WATCH_POLL_S)
            except Exception:  # noqa: BLE001 - the launcher is gone; the job is ending
                return
            if ready is None:
                continue
            told = nxt
            update = HostUpdateResult(int(ready.get("update", 0)))
            if update:
                for listener in list(_host_listeners):
                    listener(nxt, update)


_worker: Optional[_Worker] = None


def join_next(settings: Optional[Any] = None) -> int:
    """Waits for the job's next membership and takes this worker's place in it (see the
    module doc); returns its epoch, the generation to form the job with. ``settings``: the
    ``_core.Settings`` that ``init()`` read (else the environment is read now). Raises
    ``SystemExit(0)`` when the launcher removed this worker, and a ferrovod error when the
    job was stopped or the elastic timeout passed."""
    global _worker
    if _worker is None:
        _worker = _Worker(_settings(settings))
    return _worker.join_next()


def watch_hosts() -> None:
    """Starts (once) the thread that turns the launcher's host updates into notifications."""
    if _worker is not None:
        _worker.watch()


def current_epoch() -> int:
    """The epoch this process formed last (0 outside an elastic job)."""
    return 0 if _worker is None else _worker.epoch
