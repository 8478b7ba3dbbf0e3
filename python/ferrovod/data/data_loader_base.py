"""Horovod's data-loader base classes (``horovod.data.data_loader_base``): a loader is a class
with ``__len__`` (batches per pass) and ``_iterate()`` (one pass of batches); iterating it
gives one pass. ``AsyncDataLoaderMixin`` reads the passes in a background thread, up to
``async_loader_queue_size`` batches ahead of the training loop, so that loading overlaps
training.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Iterator

__all__ = ["BaseDataLoader", "AsyncDataLoaderMixin"]

_log = logging.getLogger("ferrovod.data")
#: How often a blocked background reader looks whether the loader was closed.
_POLL_S = 0.1


class BaseDataLoader:
    """A loader: subclasses implement ``__len__`` and ``_iterate``."""

    def __len__(self) -> int:
        """The number of batches of one pass."""
        raise NotImplementedError()

    def _iterate(self) -> Iterator[Any]:
        """One pass over the data, batch by batch."""
        raise NotImplementedError()

    def __iter__(self) -> Iterator[Any]:
        for batch in self._iterate():
            yield self._process_batch(batch)

    def _process_batch(self, batch: Any) -> Any:
        """A hook for trainers that reshape batches; loaders leave it alone."""
        return batch


class _EndOfPass:
    pass


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = _EndOfPass()


class AsyncDataLoaderMixin:
    """Reads batches in a background thread; put it first among the bases, e.g.
    ``class AsyncLoader(AsyncDataLoaderMixin, MyLoader)``.

    The thread reads pass after pass of ``_iterate()`` into a queue of
    ``async_loader_queue_size`` batches (0: no thread, every pass read when iterated); each
    iteration of the loader yields one pass. An exception in ``_iterate()`` is raised by the
    iteration that reaches it. ``close_async_loader()`` stops the thread. ``debug_data_loader``
    logs each batch at debug level (logger ``ferrovod.data``).
    """

    def __init__(self, async_loader_queue_size: int = 64, debug_data_loader: bool = False,
                 *args: Any, **kwargs: Any) -> None:
        self.async_loader_queue_size = async_loader_queue_size
        self.debug_data_loader = debug_data_loader
        super().__init__(*args, **kwargs)
        if self.async_loader_queue_size > 0:
            self.finished_event = threading.Event()
            self.queue: "queue.Queue[Any]" = queue.Queue(self.async_loader_queue_size)
            self.thread = threading.Thread(target=self._async_worker, daemon=True,
                                           name="ferrovod-async-loader")
            self.started = False

    def _put(self, item: Any) -> bool:
        """Queues ``item``; False when the loader was closed meanwhile."""
        while not self.finished_event.is_set():
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _async_worker(self) -> None:
        try:
            while not self.finished_event.is_set():
                for n, batch in enumerate(self._iterate()):  # type: ignore[attr-defined]
                    if not self._put(batch):
                        return
                    if self.debug_data_loader:
                        _log.debug("async loader: queued batch %d", n)
                if not self._put(_END):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the iterating thread
            self._put(_Failure(exc))

    def close_async_loader(self) -> None:
        """Stops the background thread (it may be blocked on a full queue) and drops what it
        had read ahead."""
        if self.async_loader_queue_size > 0 and self.started:
            self.finished_event.set()
            while True:
                try:
                    self.queue.get_nowait()
                except queue.Empty:
                    break
            self.thread.join(timeout=10 * _POLL_S + 5.0)

    def __iter__(self) -> Iterator[Any]:
        if self.async_loader_queue_size <= 0:
            for batch in self._iterate():  # type: ignore[attr-defined]
                yield self._process_batch(batch)  # type: ignore[attr-defined]
            return
        if not self.started:
            self.started = True
            self.thread.start()
        while True:
            item = self.queue.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield self._process_batch(item)  # type: ignore[attr-defined]
