"""``ferrovod.data`` (Horovod's ``horovod.data``): the base loader and the background-reading
mixin, with a real thread, a bounded queue, several passes, errors and closing."""

import threading
import time

import pytest

from ferrovod.data import AsyncDataLoaderMixin, BaseDataLoader


class Numbers(BaseDataLoader):
    def __init__(self, n, fail_at=None, delay=0.0):
        self.n, self.fail_at, self.delay = n, fail_at, delay
        self.passes = 0
        self.reader = None

    def __len__(self):
        return self.n

    def _iterate(self):
        self.passes += 1
        self.reader = threading.current_thread()
        for i in range(self.n):
            if i == self.fail_at:
                raise ValueError(f"bad record {i}")
            time.sleep(self.delay)
            yield [i, self.passes]


class AsyncNumbers(AsyncDataLoaderMixin, Numbers):
    pass


def test_base_loader_gives_one_pass_per_iteration():
    loader = Numbers(5)
    assert len(loader) == 5
    assert [b[0] for b in loader] == [0, 1, 2, 3, 4]
    assert [b[1] for b in loader] == [2] * 5
    with pytest.raises(NotImplementedError):
        len(BaseDataLoader())


def test_async_loader_reads_in_its_thread_pass_after_pass():
    loader = AsyncNumbers(async_loader_queue_size=3, n=7)
    for epoch in (1, 2, 3):
        got = list(loader)
        assert [b[0] for b in got] == list(range(7)), got
        assert {b[1] for b in got} == {epoch}
    assert loader.reader is loader.thread and loader.reader is not threading.current_thread()
    loader.close_async_loader()
    assert not loader.thread.is_alive()


def test_async_loader_reads_ahead_up_to_the_queue_size():
    loader = AsyncNumbers(async_loader_queue_size=4, n=100)
    it = iter(loader)
    assert next(it)[0] == 0
    time.sleep(0.3)
    assert loader.queue.qsize() == 4  # read ahead, bounded
    loader.close_async_loader()  # while the reader is blocked on the full queue
    assert not loader.thread.is_alive()


def test_an_error_while_reading_reaches_the_training_loop():
    loader = AsyncNumbers(async_loader_queue_size=2, n=10, fail_at=3)
    seen = []
    with pytest.raises(ValueError, match="bad record 3"):
        for b in loader:
            seen.append(b[0])
    assert seen == [0, 1, 2]


def test_queue_size_zero_reads_in_the_caller():
    loader = AsyncNumbers(async_loader_queue_size=0, n=3)
    assert [b[0] for b in loader] == [0, 1, 2]
    assert loader.reader is threading.current_thread()
    loader.close_async_loader()  # nothing to stop
