"""Alias of ``horovod.torch.mpi_ops``: the ops and basics under the module path some Horovod
code imports (``from horovod.torch.mpi_ops import allreduce_async_``), plus
``is_homogeneous``, which Horovod defines here but not at the package top level."""

from __future__ import annotations

from .._api import is_homogeneous  # noqa: F401
from ..common.basics import HorovodBasics
from . import *  # noqa: F401,F403
from . import __all__ as _pkg_all
from .autograd import (  # noqa: F401
    HorovodAllgather,
    HorovodAllreduce,
    HorovodAlltoall,
    HorovodBroadcast,
    HorovodGroupedAllgather,
    HorovodGroupedAllreduce,
    HorovodGroupedReducescatter,
    HorovodReducescatter,
)

__all__ = list(_pkg_all) + ["is_homogeneous"]

# Horovod's per-framework basics object (see ferrovod.common.basics).
_basics = HorovodBasics()
