"""How gradients are split into grouped allreduces (Horovod's ``groups`` / ``num_groups``),
shared by every framework adapter; imports no framework."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, TypeVar

T = TypeVar("T")


def split_evenly(items: List[T], n: int) -> List[List[T]]:
    """``n`` contiguous chunks of nearly equal length (the first ones one longer); empty
    chunks are dropped."""
    base, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + base + (1 if i < extra else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


def plan_groups(position_keys: Optional[Sequence[Set[int]]], count: int, groups: Any,
                keys_of: Callable[[Any], Set[int]]) -> List[List[int]]:
    """Positions ``0..count-1`` of each grouped allreduce, Horovod's way: nothing (or 0) makes
    one group of all; an int n makes n contiguous groups; a list of variable lists makes one
    group per list and one group per gradient left over. ``position_keys[p]`` are the identity
    keys of position p's variable and ``keys_of(v)`` those of a variable in ``groups``."""
    positions = list(range(count))
    if groups is None or (isinstance(groups, int) and groups == 0):
        return [positions] if positions else []
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("groups must be a non-negative integer or a list of lists of "
                             "variables")
        return split_evenly(positions, groups)
    if position_keys is None:
        raise ValueError("groups given as lists of variables need the variables")
    where: Dict[int, int] = {}
    for p, keys in enumerate(position_keys):
        for k in keys:
            where[k] = p
    planned: List[List[int]] = []
    taken: Set[int] = set()
    for group in groups:
        members = []
        for v in group:
            p = next((where[k] for k in keys_of(v) if k in where), None)
            if p is not None and p not in taken:
                members.append(p)
                taken.add(p)
        if members:
            planned.append(members)
    planned.extend([p] for p in positions if p not in taken)
    return planned
