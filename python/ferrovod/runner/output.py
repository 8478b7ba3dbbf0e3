"""Forwarding of worker output: whole lines, prefixed ``[rank]<stdout>:`` as horovodrun does.

Each local worker stream is read by its own thread; the streams of a remote host's workers
come over that host's one ssh session as frames (``SessionReader``), read by one thread per
host. Complete lines are written to the launcher's stream under a per-destination lock with a
single write, so lines of different ranks never mix inside a line. ``\\r`` ends a line too (as
in horovodrun), so progress bars keep updating; a ``\\r\\n`` pair counts as one ending. With
``--output-filename`` the raw, unprefixed bytes also go to
``DIR/rank.<padded rank>/{stdout,stderr}``.
"""

from __future__ import annotations

import os
import re
import struct
import threading
import time
from typing import BinaryIO, Callable, Dict, List, Optional, Tuple

__all__ = ["FrameDecoder", "LineSplitter", "RankStream", "SessionReader", "Sink", "StreamForwarder",
           "encode_frame", "pad_rank", "rank_output_dir"]

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


class RankStream:
    """One worker stream on its way to the launcher's: whole lines, each prefixed (see the
    module doc), and the raw bytes to the ``--output-filename`` copy.

    Owns ``copy`` (opened by the caller so that a bad path fails before any worker starts) and
    closes it in :meth:`close`.
    """

    def __init__(
        self,
        label: str,
        stream_name: str,
        sink: Sink,
        copy: Optional[BinaryIO] = None,
        timestamp: bool = False,
        clock: Callable[[], bytes] = _asctime_prefix,
    ) -> None:
        #: ``label`` and ``stream_name``, for the thread that forwards it.
        self.name = f"{stream_name}-{label}"
        self._prefix = f"[{label}]<{stream_name}>:".encode("ascii", "replace")
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

    def feed(self, data: bytes) -> None:
        """Forwards the complete lines ``data`` ends and copies ``data`` to the file."""
        if self._copy is not None and not _write_quietly(self._copy, data):
            self._copy = None  # e.g. disk full: keep forwarding so the worker never blocks
        self._sink.write(self._prefixed(self._splitter.feed(data)))

    def close(self) -> None:
        """Forwards what is left (a last line without an ending) and closes the copy."""
        rest = self._splitter.flush()
        if rest is not None:
            self._sink.write(self._prefixed([rest]))
        if self._copy is not None:
            _close_quietly(self._copy)
            self._copy = None


class StreamForwarder(threading.Thread):
    """Reads one worker stream until EOF and forwards it through ``stream``.

    Owns ``fd`` and ``stream`` and closes both at EOF.
    """

    def __init__(self, fd: int, stream: RankStream) -> None:
        super().__init__(name=f"ferrovodrun-{stream.name}", daemon=True)
        self._fd = fd
        self._stream = stream

    def run(self) -> None:
        """Forwards until the write end is closed by every process holding it."""
        try:
            while True:
                data = _read(self._fd)
                if not data:
                    break
                self._stream.feed(data)
        finally:
            self._stream.close()
            os.close(self._fd)


# -- one host's workers over one ssh session ----------------------------------------------------
#
# A host's agent (``remote_agent``) runs all of that host's workers and sends their output and
# exit statuses back on its one stdout as frames: a header (rank, kind, payload length), then
# the payload.

FRAME_HEADER = struct.Struct("!IBI")
#: A worker's stdout bytes.
FRAME_STDOUT = 1
#: A worker's stderr bytes.
FRAME_STDERR = 2
#: A worker ended: the payload is its ``Popen`` return code (``-N`` for signal N), as ``!i``.
FRAME_EXIT = 3
EXIT_CODE = struct.Struct("!i")


def encode_frame(rank: int, kind: int, payload: bytes) -> bytes:
    """One frame of a host agent's output stream."""
    return FRAME_HEADER.pack(rank, kind, len(payload)) + payload


class FrameDecoder:
    """Cuts a host agent's output stream into ``(rank, kind, payload)`` frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> List[Tuple[int, int, bytes]]:
        """Adds ``data``; returns the frames it completed."""
        self._buf += data
        frames = []
        at = 0
        while len(self._buf) - at >= FRAME_HEADER.size:
            rank, kind, length = FRAME_HEADER.unpack_from(self._buf, at)
            end = at + FRAME_HEADER.size + length
            if end > len(self._buf):
                break
            frames.append((rank, kind, bytes(self._buf[at + FRAME_HEADER.size : end])))
            at = end
        del self._buf[:at]
        return frames


def _read(fd: int) -> bytes:
    """The next bytes of ``fd``; empty at EOF (or on an error, which ends the stream too)."""
    while True:
        try:
            return os.read(fd, _READ_SIZE)
        except InterruptedError:
            continue
        except OSError:
            return b""


class SessionReader(threading.Thread):
    """Reads one host agent's framed output (its ssh session's stdout) until EOF: each frame
    of a worker's stream goes to that rank's :class:`RankStream`, each exit to ``on_exit(rank,
    returncode)``; then ``on_eof(ranks that were never reported)``. Owns ``fd`` and the
    streams."""

    def __init__(
        self,
        fd: int,
        label: str,
        streams: Dict[Tuple[int, int], RankStream],
        on_exit: Callable[[int, int], None],
        on_eof: Callable[[List[int]], None],
    ) -> None:
        super().__init__(name=f"ferrovodrun-session-{label}", daemon=True)
        self._fd = fd
        self._streams = streams
        self._on_exit = on_exit
        self._on_eof = on_eof

    def run(self) -> None:
        """Dispatches frames until the session's stdout closes."""
        decoder = FrameDecoder()
        ranks = sorted({rank for rank, _ in self._streams})
        unreported = set(ranks)
        try:
            while True:
                data = _read(self._fd)
                if not data:
                    break
                for rank, kind, payload in decoder.feed(data):
                    if kind == FRAME_EXIT and rank in unreported:
                        unreported.discard(rank)
                        self._on_exit(rank, EXIT_CODE.unpack(payload)[0])
                    else:
                        stream = self._streams.get((rank, kind))
                        if stream is not None:
                            stream.feed(payload)
        finally:
            for stream in self._streams.values():
                stream.close()
            os.close(self._fd)
            self._on_eof([r for r in ranks if r in unreported])


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
