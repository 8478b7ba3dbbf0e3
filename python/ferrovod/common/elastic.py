"""Horovod's ``horovod.common.elastic``, the path Horovod-era code imports the elastic states
from: the names of :mod:`ferrovod.elastic.state`, where they live."""

from __future__ import annotations

from ..elastic.state import (
    HostUpdateResult,
    ModelState,
    ObjectState,
    State,
    notify_hosts_updated,
    run_fn,
)

__all__ = ["State", "ObjectState", "ModelState", "run_fn", "HostUpdateResult",
           "notify_hosts_updated"]
