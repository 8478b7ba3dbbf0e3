"""Horovod's ``horovod.common.exceptions`` names, backed by ferrovod's exception classes."""

from ..exceptions import (  # noqa: F401  (re-exported)
    FerrovodError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    HorovodVersionMismatchError,
    InvalidArgumentError,
    MismatchError,
    NotInitializedError,
    RankFailureError,
)

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError",
           "FerrovodError",
           "InvalidArgumentError", "MismatchError", "NotInitializedError", "RankFailureError"]
