"""The engine's defaults for its environment variables, read from its one table
(``_core.env_vars()``, the rows of ``VARS`` in src/config.rs), so that Python never writes a
default down a second time."""

from __future__ import annotations

import functools
from typing import Dict, Mapping, Sequence, Union

from . import _core


@functools.lru_cache(maxsize=None)
def _table() -> Dict[str, str]:
    return {name: default for name, _alias, default, _doc in _core.env_vars()}


def default(name: str) -> str:
    """The default of variable ``name`` as the engine's table shows it (``KeyError`` for a
    name the engine does not document)."""
    return _table()[name]


def positive_seconds(env: Mapping[str, str], names: Sequence[str], fallback: float,
                     whole: bool = False) -> Union[int, float]:
    """The first of ``names`` set in ``env``, as seconds above 0 (``whole``: a whole number);
    ``ValueError`` naming the variable for anything else; ``fallback`` when none is set."""
    for name in names:
        text = env.get(name, "").strip()
        if text:
            try:
                value: Union[int, float] = int(text) if whole else float(text)
            except ValueError:
                value = 0
            if value <= 0:
                kind = "a whole number" if whole else "a number"
                raise ValueError(f"{name} must be {kind} of seconds above 0, got {text!r}")
            return value
    return int(fallback) if whole else fallback
