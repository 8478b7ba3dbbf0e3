"""Elastic training without a framework adapter (``ferrovod.elastic``): ``run``, ``State``
and ``ObjectState`` over ferrovod's own collectives. The framework modules
(``ferrovod.torch.elastic``, ``ferrovod.tensorflow.elastic``, ``ferrovod.keras.elastic``) add
their model states; see :mod:`ferrovod.elastic.state` for the semantics.

The worker side of an elastic job is this package: :mod:`~ferrovod.elastic.membership` (the
launcher's memberships, read from the rendezvous store by ``init()``; the protocol the
launcher's driver writes), :mod:`~ferrovod.elastic.state` (what survives a reset, and the
loop around the training function) and this facade."""

from __future__ import annotations

from typing import Any, Callable, Optional

from .. import _api
from . import state as _common
from .state import HostUpdateResult, State, notify_hosts_updated, run_fn

__all__ = ["run", "State", "ObjectState", "HostUpdateResult", "notify_hosts_updated"]


def _reset() -> None:
    _api.shutdown()
    _api.init()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator running ``func(state, *args, **kwargs)`` elastically (see
    :func:`ferrovod.elastic.state.run_fn`), resetting through ``shutdown()`` and ``init()``,
    which takes the launcher's newest membership."""
    return run_fn(func, _reset)


class ObjectState(_common.ObjectState):
    """Picklable values kept consistent across ranks, given as keyword arguments and exposed
    as attributes. ``bcast_object`` and ``get_rank`` default to ferrovod's own."""

    def __init__(self, bcast_object: Optional[Callable[[Any], Any]] = None,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs: Any) -> None:
        super().__init__(
            bcast_object=bcast_object or (lambda obj: _api.broadcast_object(obj, name="elastic.state")),
            get_rank=get_rank or _api.rank, **kwargs)
