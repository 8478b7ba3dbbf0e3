"""The ``ferrovod`` logger: where the Rust engine's records (bridged from ``log``) and the
Python layer's messages go, with the rank in every line.

Levels follow ``FERROVOD_LOG_LEVEL`` (trace, debug, info, warning, error, fatal); trace is
level 5, below DEBUG, as the bridge maps it. The logger writes to stderr through its own
handler and does not propagate, so records are not printed twice when the application
configures the root logger; add handlers to ``logging.getLogger("ferrovod")`` to route them.
"""

from __future__ import annotations

import logging
import sys

from . import _core

LOGGER = logging.getLogger("ferrovod")

_LEVELS = {
    "trace": 5,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.CRITICAL,
}


class _FerrovodHandler(logging.StreamHandler):
    """Marks our handler so a re-init replaces it instead of adding another."""


def configure(level: str, hide_time: bool, who: str) -> None:
    """Sets the ``ferrovod`` logger's level and its stderr handler; ``who`` (e.g. "rank 3")
    starts every line."""
    logging.addLevelName(5, "TRACE")
    LOGGER.setLevel(_LEVELS.get(level.lower(), logging.WARNING))
    for h in list(LOGGER.handlers):
        if isinstance(h, _FerrovodHandler):
            LOGGER.removeHandler(h)
    handler = _FerrovodHandler(sys.stderr)
    stamp = "" if hide_time else "%(asctime)s "
    handler.setFormatter(logging.Formatter(f"[{stamp}ferrovod {who}: %(levelname)s] %(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.propagate = False
    _core.reset_log_cache()
