"""The engine's defaults for its environment variables, read from its one table
(``_core.env_vars()``, the rows of ``VARS`` in src/config.rs), so that Python never writes a
default down a second time."""

from __future__ import annotations

import functools
from typing import Dict

from . import _core


@functools.lru_cache(maxsize=None)
def _table() -> Dict[str, str]:
    return {name: default for name, _alias, default, _doc in _core.env_vars()}


def default(name: str) -> str:
    """The default of variable ``name`` as the engine's table shows it (``KeyError`` for a
    name the engine does not document)."""
    return _table()[name]
