"""``horovod.runner.util.threads``: running a function in the background."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Tuple


def in_thread(target: Callable[..., Any], args: Tuple[Any, ...] = (), name: Optional[str] = None,
              daemon: bool = True, silent: bool = False) -> threading.Thread:
    """Starts ``target(*args)`` in a new thread and returns the thread. ``daemon``: the thread
    does not keep the process alive; ``silent``: an exception ``target`` raises is swallowed
    rather than reported by the thread."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}; for one argument use (arg,)")
    fn = target
    if silent:
        def fn(*a: Any) -> None:
            try:
                target(*a)
            except Exception:  # noqa: BLE001 - silent=True asks for exactly this
                pass

    thread = threading.Thread(target=fn, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
