"""Horovod's data-loader base classes (``horovod.data``): see :mod:`.data_loader_base`."""

from .data_loader_base import AsyncDataLoaderMixin, BaseDataLoader

__all__ = ["BaseDataLoader", "AsyncDataLoaderMixin"]
