"""Elastic training state (Horovod's ``horovod.common.elastic``, which
:mod:`ferrovod.common.elastic` re-exports): ``State``, ``ObjectState``
and ``run_fn``, the framework-free part that ``ferrovod.tensorflow.elastic`` and the Keras
``elastic`` modules build on.

A state object holds what training must not lose when ranks come and go: ``commit()`` saves
it in host memory (and checks whether the set of hosts changed), ``restore()`` rolls back to
the last commit after a collective failed, ``sync()`` makes every rank hold rank 0's copy.
``run_fn(func, reset)`` is the loop around the user's training function: sync, run; on
``HorovodInternalError`` restore, reset, run again; on ``HostsUpdatedInterrupt`` keep the
state, reset, run again.

Host updates reach a state through :func:`notify_hosts_updated` (called by the worker side of
the elastic launcher for every registered state); ``check_host_updates`` turns the newest one
into a ``HostsUpdatedInterrupt`` on every rank at the same commit, because rank 0's view is
broadcast first.
"""

from __future__ import annotations

import copy
import functools
import queue
import threading
from typing import Any, Callable, Dict, List, Tuple

from . import membership as _elastic
from .membership import HostUpdateResult
from ..exceptions import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["State", "ObjectState", "run_fn", "HostUpdateResult", "notify_hosts_updated"]


_listeners: List["State"] = []
_listeners_lock = threading.Lock()


def notify_hosts_updated(timestamp: int, update_res: HostUpdateResult) -> None:
    """Tells every state registered by a running :func:`run_fn` that the hosts changed at
    ``timestamp``; each raises ``HostsUpdatedInterrupt`` at its next ``commit()``."""
    with _listeners_lock:
        states = list(_listeners)
    for state in states:
        state.on_hosts_updated(timestamp, update_res)


# The worker's watcher (ferrovod.elastic.membership) calls it for every host update the launcher
# publishes; no state exists before this module is imported, so none misses one.
_elastic.on_hosts_updated(notify_hosts_updated)


class State:
    """In-memory training state kept consistent across ranks.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 to every rank.
        get_rank: returns this process's rank.
    """

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int]) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: "queue.Queue[Tuple[int, HostUpdateResult]]" = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Functions to call after every reset (a rank joined or left), e.g. to rescale the
        learning rate to the new number of ranks."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Called by :func:`run_fn` after a reset: drops pending host messages, calls
        :meth:`reset` and the registered callbacks."""
        self._host_messages = queue.Queue()
        # Updates up to the membership just formed are already in effect.
        self._last_updated_timestamp = max(self._last_updated_timestamp, _elastic.current_epoch())
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: int, update_res: HostUpdateResult) -> None:
        """Records a host update (see :func:`notify_hosts_updated`)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self) -> None:
        """Saves the state in host memory, then raises ``HostsUpdatedInterrupt`` (on every
        rank alike) if the hosts changed since the last commit. Commits copy the state: commit
        less often than every batch when that costs too much."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raises ``HostsUpdatedInterrupt`` when a newer host update than the last one seen
        arrived. Rank 0's view is broadcast first, so every rank raises at the same commit."""
        last = prev = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, res = self._host_messages.get()
            if timestamp > last:
                last = timestamp
                update |= res
        prev, self._last_updated_timestamp, update = self._bcast_object((prev, last, update))
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(update == HostUpdateResult.removed)

    def save(self) -> None:
        """Saves the state in host memory."""
        raise NotImplementedError()

    def restore(self) -> None:
        """Restores the last committed state, undoing what changed since."""
        raise NotImplementedError()

    def sync(self) -> None:
        """Makes every rank hold rank 0's state."""
        raise NotImplementedError()

    def reset(self) -> None:
        """Resets objects after a reset event, before the state is synchronized."""


class ObjectState(State):
    """State made of picklable Python objects, given as keyword arguments and exposed as
    attributes (``state.epoch``, ``state.batch``, ...)."""

    def __init__(self, bcast_object: Callable[[Any], Any], get_rank: Callable[[], int],
                 **kwargs: Any) -> None:
        self._bcast_object = bcast_object
        self._saved_state: Dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        """Saves a copy of the current values of the attributes (a copy: a list the training
        appends to after the commit must not change what the commit saved)."""
        self._saved_state = copy.deepcopy({attr: getattr(self, attr) for attr in self._saved_state})

    def restore(self) -> None:
        """Sets the attributes back to (copies of) their saved values."""
        self._set_attrs()

    def sync(self) -> None:
        """Sets every rank's saved values and attributes to rank 0's saved values."""
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for attr, value in copy.deepcopy(self._saved_state).items():
            setattr(self, attr, value)


class ModelState(ObjectState):
    """:class:`ObjectState` plus a framework's values (variables, optimizer slots), which a
    subclass copies to host memory in ``_save_model`` and assigns back in ``_load_model``."""

    def save(self) -> None:
        """Copies the values and attributes to host memory."""
        self._save_model()
        super().save()

    def restore(self) -> None:
        """Assigns the last saved values and attributes back."""
        self._load_model()
        super().restore()

    def _save_model(self) -> None:
        raise NotImplementedError()

    def _load_model(self) -> None:
        raise NotImplementedError()


def _reset_until_formed(reset: Callable[[], None]) -> None:
    """``reset()``, again while forming the new membership fails because one of its members
    failed too (the launcher then publishes the next one: a failure during a reset is just
    another failure). A stopped job, a removed worker or the elastic timeout end it."""
    while True:
        try:
            reset()
            return
        except _elastic.FormingError:
            continue


def run_fn(func: Callable[..., Any], reset: Callable[[], None]) -> Callable[..., Any]:
    """Wraps ``func(state, *args, **kwargs)`` in the elastic loop: sync the state, run; on
    ``HorovodInternalError`` (a rank failed) restore the last commit, ``reset()`` and run
    again; on ``HostsUpdatedInterrupt`` keep the state, ``reset()`` and run again (skipping
    the sync when the interrupt says so)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        with _listeners_lock:
            _listeners.append(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    return func(state, *args, **kwargs)
                except HorovodInternalError:
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    skip_sync = e.skip_sync
                _reset_until_formed(reset)
                state.on_reset()
        finally:
            with _listeners_lock:
                if state in _listeners:
                    _listeners.remove(state)

    return wrapper
