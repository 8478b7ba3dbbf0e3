"""Forwarding of worker output: whole lines, prefixed ``[rank]<stdout>:`` as horovodrun does.

Each worker stream is read by its own thread. Complete lines are written to the launcher's
stream under a per-destination lock with a single write, so lines of different ranks never mix
inside a line. ``\\r`` ends a line too (as in horovodrun), so progress bars keep updating; a
``\\r\\n`` pair counts as one ending. With ``--output-filename`` the raw, unprefixed bytes also
go to ``DIR/rank.<padded rank>/{stdout,stderr}``.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import BinaryIO, Callable, List, Optional

__all__ = ["LineSplitter", "Sink", "StreamForwarder", "pad_rank", "rank_output_dir"]

_READ_SIZE = 65536
_LINE_END = re.compile(rb"\r\n|\r|\n")
_MAX_LINE = 1 << 20


def pad_rank(rank: int, size: int) -> str:
    """Zero-pads ``rank`` to the width of the largest rank, so names sort lexicographically."""
    width = len(str(max(size - 1, 0)))
    return str(rank).zfill(width)


def rank_output_dir(base: str, rank: int, size: int) -> str:
    """The ``--output-filename`` directory of one rank: ``base/rank.<padded rank>``."""
    return os.path.join(base, f"rank.{pad_rank(rank, size)}")


class LineSplitter:
    """Cuts a byte stream into lines ending in ``\\n``, ``\\r`` or ``\\r\\n``.

    A trailing ``\\r`` is held back until the next chunk shows whether ``\\n`` follows.
    """

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> List[bytes]:
        """Adds ``data``; returns the lines it completed, each with its line ending."""
        buf = self._pending + data
        hold = b""
        if buf.endswith(b"\r"):
            buf, hold = buf[:-1], b"\r"
        lines: List[bytes] = []
        start = 0
        for match in _LINE_END.finditer(buf):
            lines.append(buf[start : match.end()])
            start = match.end()
        self._pending = buf[start:] + hold
        if len(self._pending) > _MAX_LINE:
            # A line this long is most likely binary output; forward it in pieces rather
            # than buffer without bound.
            lines.append(self._pending)
            self._pending = b""
        return lines

    def flush(self) -> Optional[bytes]:
        """Returns what is left (a last line without an ending), or None."""
        rest, self._pending = self._pending, b""
        return rest or None


class Sink:
    """A launcher output stream shared by all workers; one lock keeps lines whole.

    Write errors (say a closed pipe when the launcher's output goes to ``head``) turn the sink
    off instead of stopping the forwarding, so workers never block on a full pipe.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self._broken = False

    def write(self, data: bytes) -> None:
        """Writes ``data`` in one piece and flushes it."""
        if not data:
            return
        with self._lock:
            if self._broken:
                return
            try:
                self._stream.write(data)
                self._stream.flush()
            except (OSError, ValueError):
                self._broken = True


def _asctime_prefix() -> bytes:
    return time.asctime(time.localtime()).encode("ascii")


class StreamForwarder(threading.Thread):
    """Reads one worker stream until EOF and forwards it (see the module doc).

    Owns ``fd`` and ``copy`` (the ``--output-filename`` file, opened by the caller so that a
    bad path fails before any worker starts) and closes both at EOF.
    """

    def __init__(
        self,
        fd: int,
        rank: int,
        stream_name: str,
        sink: Sink,
        copy: Optional[BinaryIO] = None,
        timestamp: bool = False,
        clock: Callable[[], bytes] = _asctime_prefix,
    ) -> None:
        super().__init__(name=f"ferrovodrun-{stream_name}-{rank}", daemon=True)
        self._fd = fd
        self._prefix = f"[{rank}]<{stream_name}>:".encode("ascii")
        self._sink = sink
        self._copy = copy
        self._timestamp = timestamp
        self._clock = clock
        self._splitter = LineSplitter()

    def _prefixed(self, lines: List[bytes]) -> bytes:
        # A piece without a line ending (the last bytes at EOF, or a cut overlong line) gets
        # one on the console so the next prefix starts a line; the file copy stays exact.
        stamp = self._clock() if self._timestamp else b""
        return b"".join(
            stamp + self._prefix + line + (b"" if line.endswith((b"\n", b"\r")) else b"\n")
            for line in lines
        )

    def run(self) -> None:
        """Forwards until the write end is closed by every process holding it."""
        try:
            self._pump(self._copy)
        finally:
            if self._copy is not None:
                _close_quietly(self._copy)
            os.close(self._fd)

    def _pump(self, copy: Optional[BinaryIO]) -> None:
        while True:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            if copy is not None and not _write_quietly(copy, data):
                copy = None  # e.g. disk full: keep draining the pipe so the worker never blocks
            self._sink.write(self._prefixed(self._splitter.feed(data)))
        rest = self._splitter.flush()
        if rest is not None:
            self._sink.write(self._prefixed([rest]))


def _write_quietly(f: BinaryIO, data: bytes) -> bool:
    try:
        f.write(data)
        f.flush()
        return True
    except (OSError, ValueError):
        return False


def _close_quietly(f: BinaryIO) -> None:
    try:
        f.close()
    except OSError:
        pass
