"""Horovod's ``horovod.common.process_sets`` names, backed by :mod:`ferrovod.process_sets`."""

from ..process_sets import (  # noqa: F401  (re-exported)
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__all__ = ["ProcessSet", "global_process_set", "add_process_set", "remove_process_set"]
