"""What :func:`ferrovod.torch.DistributedOptimizer` decides once, at construction: its
parameters' names, its buckets, whether its allreduces overlap backward, and the check that
every rank wraps the same parameters."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import _api, _defaults
from .._groups import split_evenly
from ..elastic import membership as _elastic
from .._same_lists import differences
from ..process_sets import ProcessSet
from ..runner.cpus import BIND_VAR, usable_cpu_count


def parameter_names(named: Optional[Sequence[Tuple[str, torch.Tensor]]],
           all_params: List[torch.Tensor]) -> Dict[torch.Tensor, str]:
    # Horovod's names: each gradient's allreduce is then ``allreduce.<name>``, and an
    # unnamed parameter's ``allreduce.allreduce.noname.<i>``, apart from unnamed ops.
    if named is None:
        return {p: f"allreduce.noname.{i}" for i, p in enumerate(all_params)}
    named = list(named)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    by_param = {p: n for n, p in named}
    unnamed = [i for i, p in enumerate(all_params) if p not in by_param]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters "
                         f"were not named (optimizer parameter indices {unnamed}). Python "
                         "object ids: " + ", ".join(str(id(all_params[i])) for i in unnamed))
    return {p: by_param[p] for p in all_params}


def chosen_groups(groups: Any, params: List[torch.Tensor]) -> List[List[torch.Tensor]]:
    """The groups the user chose (``groups``: a count, or lists of parameters) over ``params``,
    those that need no gradient left out; none for ``None`` or 0."""
    if groups is None or groups == 0:
        return []
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError("groups must be a non-negative integer or a list of lists")
        return split_evenly(params, groups)
    known = set(params)
    chosen = [[p for p in g if p in known] for g in groups]
    return [g for g in chosen if g]


def check_same_parameters(desc: List[Tuple[str, Tuple[int, ...], str]],
                          process_set: ProcessSet, instance: int) -> None:
    """Fails on every rank, naming the difference, when ranks registered different
    parameters (``desc``: each one's name, shape and dtype): their allreduces would never
    match and training would hang. A collective over ``process_set``."""
    base = f"DistributedOptimizer.{instance}"
    lines = differences(desc, lambda x: x, "parameters", (f"{base}.check", f"{base}.params"),
                        process_set)
    if lines:
        raise ValueError("DistributedOptimizer: ranks registered different parameters (name, "
                         "shape, dtype), so their gradient allreduces could never match: "
                         + "; ".join(lines))


def overlap_wanted(overlap: Optional[bool], params: List[torch.Tensor]) -> bool:
    """Whether gradients' allreduces overlap backward (see :func:`DistributedOptimizer`)."""
    if overlap is not None:
        return bool(overlap)
    setting = os.environ.get("FERROVOD_OVERLAP", _defaults.default("FERROVOD_OVERLAP")).strip().lower()
    if setting in ("1", "true", "yes", "on"):
        return True
    if setting in ("0", "false", "no", "off"):
        return False
    if setting != "auto":
        raise ValueError(f"FERROVOD_OVERLAP={setting!r}: expected 1, 0 or auto")
    # In an elastic job, workers that joined later decide under another membership than the
    # survivors did, and the two paths run different collectives: decide without it.
    if _elastic.enabled():
        return True
    if _api.local_size() < _api.size() or any(p.device.type != "cpu" for p in params):
        return True
    cores = usable_cpu_count()
    if os.environ.get(BIND_VAR) == "1":  # the cores above are this rank's own
        return torch.get_num_threads() < cores
    return _api.local_size() * torch.get_num_threads() < cores


def buckets(params: List[torch.Tensor], cap: int) -> List[List[torch.Tensor]]:
    """Consecutive ``params`` in reverse order, grouped up to ``cap`` bytes each; buckets of one
    parameter are left out (it is reduced on its own). Every rank computes the same buckets:
    the constructor has checked that they wrap the same parameters."""
    if cap <= 0:
        return []
    out: List[List[torch.Tensor]] = []
    current: List[torch.Tensor] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap:
            out.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        out.append(current)
    return [b for b in out if len(b) > 1]


__all__ = ["buckets", "check_same_parameters", "chosen_groups", "overlap_wanted",
           "parameter_names"]
