"""torch.distributed's store for the workers of a ``ferrovodrun`` job.

A torch script run under ``ferrovodrun`` calls ``dist.init_process_group("ferrovod")`` (or
``"gloo"``) with no arguments, which means ``env://``: torch wants ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, and rank 0 would host a store on that port. The launcher
does what torchrun's agent does instead: it holds the port itself, bound before any worker
starts (so no other process can take it between the choice and the use), and exports
``TORCHELASTIC_USE_AGENT_STORE=True`` so that every rank joins it as a client.

torch's store server is torch's own (``TCPStore``); importing torch costs the launcher a second
or two and a few hundred MiB, so it happens only once a worker connects: a job that never starts
a process group never pays it. Until then the kernel queues the connections on the bound
socket, and torch's client waits for the server's answer.

Like every ``TCPStore``, it does not authenticate its clients. The ferrovod backend's own
connections still prove the job secret ``ferrovodrun`` hands every worker.
"""

from __future__ import annotations

import importlib.util
import select
import socket
import threading
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

from .hosts import SlotInfo

__all__ = ["TorchStore", "torch_env"]


def torch_env(slot: SlotInfo, host: str, port: int) -> Dict[str, str]:
    """The variables torch's ``env://`` reads, for ``slot``, with the launcher's store at
    ``host:port`` (as torchrun exports them)."""
    return {
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(slot.size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_size),
        "GROUP_RANK": str(slot.cross_rank),
        "MASTER_ADDR": host.strip("[]"),
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


class TorchStore:
    """A bound, listening port whose torch ``TCPStore`` server starts when a worker first
    connects. ``port`` is None when torch is not installed here (the workers then get no
    torch variables, and ``env://`` says what it misses)."""

    def __init__(self, host: str, timeout_s: float, log: Callable[[str], None]) -> None:
        self.port: Optional[int] = None
        self._log = log
        self._timeout = timedelta(seconds=timeout_s)
        self._store: Any = None
        self._stop = threading.Event()
        self._sock: Optional[socket.socket] = None
        if importlib.util.find_spec("torch") is None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        # Every rank may connect before the server runs: the kernel holds them meanwhile.
        sock.listen(4096)
        self._sock = sock
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="ferrovodrun-torch-store",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([sock], [], [], 0.5)
            except (OSError, ValueError):  # closed by close()
                return
            if ready:
                break
        else:
            return
        try:
            from torch.distributed import TCPStore

            # The store owns the socket from here (and closes it when it goes).
            self._store = TCPStore(sock.getsockname()[0], self.port, None, True, self._timeout,
                                   wait_for_workers=False, master_listen_fd=sock.detach())
        except Exception as exc:  # noqa: BLE001 - the workers' env:// then times out, said here
            self._log(f"warning: torch.distributed's store for the workers did not start: {exc}")

    def close(self) -> None:
        """Stops the store (the workers have gone)."""
        self._stop.set()
        if self._sock is not None and self._store is None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._store = None
