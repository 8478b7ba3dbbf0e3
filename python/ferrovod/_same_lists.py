"""Whether every rank of a process set passed the same list (an optimizer's parameters, the
variables of a broadcast), and if not, where they differ: a collective, so that every rank
fails alike instead of waiting for collectives that would never match."""

from __future__ import annotations

import hashlib
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from . import _api
from .process_sets import ProcessSet


def differences(items: Sequence[Any], key: Callable[[Any], Any], noun: str,
                names: Tuple[Optional[str], Optional[str]],
                process_set: ProcessSet) -> List[str]:
    """One line per rank whose ``items`` differ from set rank 0's, compared by ``key`` (each
    item shown whole); none when every rank passed the same. One allgather of a digest of
    the keys (``names[0]``), and only when the digests differ one of the items
    (``names[1]``), so a job that agrees pays 32 bytes per rank."""
    keys = [key(x) for x in items]
    digest = np.frombuffer(hashlib.sha256(repr(keys).encode()).digest(), dtype=np.uint8)
    seen = _api.allgather(digest, name=names[0], process_set=process_set).reshape(-1, 32)
    if all((row == seen[0]).all() for row in seen):
        return []
    every = _api.allgather_object(list(items), name=names[1], process_set=process_set)
    ranks = process_set.ranks if process_set.process_set_id != 0 else list(range(_api.size()))
    first_keys = [key(x) for x in every[0]]
    lines = []
    for r, theirs in zip(ranks, every):
        their_keys = [key(x) for x in theirs]
        if their_keys == first_keys:
            continue
        at = next((i for i, (a, b) in enumerate(zip(first_keys, their_keys)) if a != b),
                  min(len(their_keys), len(first_keys)))
        mine = theirs[at] if at < len(theirs) else "nothing"
        first = every[0][at] if at < len(every[0]) else "nothing"
        lines.append(f"rank {r} has {len(theirs)} {noun}, rank {ranks[0]} has "
                     f"{len(every[0])}; first difference at position {at}: rank {r} {mine} "
                     f"vs rank {ranks[0]} {first}")
    return lines


__all__ = ["differences"]
