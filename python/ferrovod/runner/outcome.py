"""What a function run on every rank left behind, and the one error a caller gets from them.

Shared by ``ferrovod.run``, ``ferrovod.ray`` and ``ferrovod.spark``: each worker calls the
function through :func:`capture`, and the caller turns the ranks' outcomes into results or
into one exception that names the first rank that raised, with its traceback.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

__all__ = ["Outcome", "capture", "first_failure"]

#: ``("ok", result, when)`` or ``("error", traceback text, when)``; the time tells the first
#: failure from the others it caused.
Outcome = Tuple[str, Any, float]


def capture(func: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: Optional[Dict[str, Any]] = None) -> Outcome:
    """Calls ``func(*args, **kwargs)``; what it returned or the traceback of what it raised.
    ``SystemExit`` passes through (an elastic job that removed this worker)."""
    try:
        return ("ok", func(*args, **(kwargs or {})), time.time())
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the caller gets the traceback, naming the rank
        frames = exc.__traceback__.tb_next if exc.__traceback__ else None  # from func's frame on
        return ("error", "".join(traceback.format_exception(type(exc), exc, frames)), time.time())


def first_failure(who: str, outcomes: Mapping[int, Outcome]) -> Optional[RuntimeError]:
    """The error naming the rank that raised first (and the others after it), or None when no
    rank raised."""
    raised = sorted((t, rank, tb) for rank, (kind, tb, t) in outcomes.items() if kind == "error")
    if not raised:
        return None
    _, rank, tb = raised[0]
    others = [r for _, r, _ in raised[1:]]
    also = f" (then rank(s) {others}, most likely because of it)" if others else ""
    return RuntimeError(f"{who}: rank {rank} raised an exception{also}:\n{tb}")
