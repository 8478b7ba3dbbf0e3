"""Python objects across ranks (Horovod's ``horovod.mxnet.functions``)."""

from .._api import allgather_object, broadcast_object

__all__ = ["broadcast_object", "allgather_object"]
