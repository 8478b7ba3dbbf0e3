"""The framework-free helpers of ``horovod.common.util`` that user scripts and tests import:
version comparison, an environment-variable context manager, list splitting, the
``average``/``op`` compatibility rule, and the build probes (``gloo_built()``,
``extension_available("torch")`` ..., also at the top level: ``ferrovod.mpi_built()``)."""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from .._build_info import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    mpi_built,
    nccl_built,
    rocm_built,
)

__all__ = ["is_version_greater_equal_than", "env", "split_list", "is_iterable",
           "num_rank_is_power_2", "get_average_backwards_compatibility_fun", "gpu_available",
           "extension_available", "gloo_built", "mpi_built", "nccl_built", "ddl_built",
           "ccl_built", "cuda_built", "rocm_built"]

# The frameworks ferrovod has an adapter for, by Horovod's extension names.
_ADAPTERS = {"tensorflow": "tensorflow", "torch": "torch", "mxnet": "mxnet"}


def _cache(f: Callable[..., Any]) -> Callable[..., Any]:
    """Memoizes ``f`` on its arguments (Horovod's helper for its costly probes)."""
    cache: Dict[Any, Any] = {}

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = (args, frozenset(kwargs.items()))
        if key not in cache:
            cache[key] = f(*args, **kwargs)
        return cache[key]

    return wrapper


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Whether ferrovod can serve framework ``ext_base_name`` (``"tensorflow"``, ``"torch"``,
    ``"mxnet"``) here. Horovod asks whether it was compiled against it; ferrovod's one wheel
    serves every framework, so this is whether the framework is installed (it is looked up,
    not imported)."""
    del verbose
    module = _ADAPTERS.get(ext_base_name)
    return module is not None and importlib.util.find_spec(module) is not None


@functools.lru_cache(maxsize=None)
def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Whether version string ``ver`` is at least ``target`` (``"major.minor.patch"``)."""
    from packaging import version

    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError("This function only accepts string arguments. Received: "
                         f"ver ({type(ver).__name__}: {ver!r}), "
                         f"target ({type(target).__name__}: {target!r})")
    if len(target.split(".")) != 3:
        raise ValueError("We only accepts target version values in the form of: "
                         f"major.minor.patch. Received: {target}")
    return version.parse(ver) >= version.parse(target)


@contextmanager
def env(**kwargs: Optional[str]) -> Iterator[None]:
    """Sets environment variables for the duration of the block (None values are ignored)
    and restores the previous values afterwards."""
    values = {k: v for k, v in kwargs.items() if v is not None}
    backup = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, old in backup.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def split_list(items: Sequence[Any], n: int) -> List[Sequence[Any]]:
    """``items`` in ``n`` contiguous chunks whose lengths differ by at most one (the first
    ones are longer)."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


def is_iterable(x: Any) -> bool:
    """Whether ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def num_rank_is_power_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Adasum's requirement in Horovod)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[Any, Any], Any]:
    """Horovod's rule for the deprecated ``average`` argument: ``op`` wins, giving both is an
    error, ``average`` alone warns and maps to Average / Sum, neither means Average.
    ``reduce_ops`` is anything with ``Average`` and ``Sum`` attributes (a framework module)."""
    def impl(op: Any, average: Optional[bool]) -> Any:
        if op is not None:
            if average is not None:
                raise ValueError("The op parameter supersedes average. Please provide only one "
                                 "of them.")
            return op
        if average is not None:
            warnings.warn("Parameter `average` has been replaced with `op` and will be removed "
                          "in v1.0", DeprecationWarning)
            return reduce_ops.Average if average else reduce_ops.Sum
        return reduce_ops.Average

    return impl


def gpu_available(ext_base_name: str = "", verbose: bool = False) -> bool:
    """Whether collectives on GPU tensors are available (ferrovod built with CUDA or ROCm
    support). ``ext_base_name`` (Horovod's extension name, e.g. ``"tensorflow"``) and
    ``verbose`` are accepted for compatibility: one build serves every framework."""
    del ext_base_name, verbose
    from .. import _api

    return bool(_api.cuda_built() or _api.rocm_built())
