"""Exceptions raised by ferrovod. The engine maps each failure to one of these classes.

``HorovodInternalError`` keeps Horovod's name, so elastic code written for Horovod catches
ferrovod's collective failures unchanged.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "FerrovodError",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "RankFailureError",
    "FerrovodTimeoutError",
    "ShutdownError",
    "MismatchError",
    "InvalidArgumentError",
    "NotInitializedError",
]


class FerrovodError(RuntimeError):
    """Base class of every ferrovod error."""


class HorovodInternalError(FerrovodError):
    """A collective failed (Horovod's name; elastic training restores state on it)."""


class HostsUpdatedInterrupt(FerrovodError):
    """The set of hosts changed (elastic training); ``skip_sync`` as in Horovod."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class RankFailureError(HorovodInternalError):
    """A peer died or its connection broke; ``rank`` names it (global rank)."""

    rank: Optional[int] = None


class FerrovodTimeoutError(HorovodInternalError):
    """A peer made no progress for longer than ``FERROVOD_TIMEOUT_SECONDS``."""


class ShutdownError(HorovodInternalError):
    """ferrovod was shut down, on this rank or on a rank this op needs."""


class MismatchError(FerrovodError):
    """Ranks disagreed about a collective; the message names the tensor and the ranks."""

    tensor_name: Optional[str] = None


class HorovodVersionMismatchError(ImportError):
    """Horovod's error for a framework whose version differs from the one Horovod was compiled
    against. ferrovod is compiled against no framework, so it never raises it; it exists for
    scripts that catch it.

    Args:
        name: the framework's module name.
        version: the version found at run time.
        installed_version: the version at installation (compilation) time.
    """

    def __init__(self, name: str, version: str, installed_version: str) -> None:
        super().__init__(f"Framework {name} installed with version {installed_version} but "
                         f"found version {version}.")
        self.name = name
        self.version = version
        self.installed_version = installed_version


class InvalidArgumentError(FerrovodError, ValueError):
    """An op was called with arguments no rank could satisfy."""


class NotInitializedError(FerrovodError, ValueError):
    """An op or query before ``init()``, or in a process forked after ``init()``."""
