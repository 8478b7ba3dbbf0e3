"""The Ray actor that holds one rank of a :class:`ferrovod.ray.RayExecutor` job.

Its process stays up between calls: ``start`` gives it the rank's environment once (the same
variables ``ferrovodrun`` gives a worker), and every ``run``/``execute`` then calls the user's
function in it, which calls ``ferrovod.init()`` as a script would.
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..runner.outcome import Outcome, capture


class Worker:
    """One rank (made a Ray actor by the executor, with its CPUs, GPUs and placement)."""

    def __init__(self) -> None:
        self.executable: Any = None

    def node(self) -> Tuple[str, str, List[str]]:
        """(Ray node id, host name, the GPU ids Ray gave this actor)."""
        import ray

        gpus = [str(g) for g in ray.get_gpu_ids()]
        return ray.get_runtime_context().get_node_id(), socket.gethostname(), gpus

    def setup(self, env: Dict[str, str], executable_cls: Optional[type],
              args: Sequence[Any], kwargs: Dict[str, Any]) -> None:
        """Takes this rank's environment, then makes the executable (Horovod's
        ``executable_cls``) that ``execute`` hands to its functions."""
        os.environ.update(env)
        if executable_cls is not None:
            self.executable = executable_cls(*args, **kwargs)

    def run(self, fn: Callable[..., Any], args: Sequence[Any],
            kwargs: Dict[str, Any]) -> Outcome:
        """``fn(*args, **kwargs)``'s outcome (its result, or the traceback of what it raised)."""
        return _ended(capture(fn, args, kwargs))

    def execute(self, fn: Callable[[Any], Any]) -> Outcome:
        """``fn(executable)``'s outcome."""
        return _ended(capture(fn, (self.executable,)))

    def call(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` itself, raising what it raises (for ``run_remote``)."""
        return fn(*args, **kwargs)


def _ended(outcome: Outcome) -> Outcome:
    """A rank that raised stops its engine, as its process would end under ``ferrovodrun``:
    peers waiting on it in a collective then fail at once instead of waiting for it."""
    lifecycle = sys.modules.get("ferrovod._lifecycle")
    if outcome[0] == "error" and lifecycle is not None and lifecycle.is_initialized():
        lifecycle.shutdown()
    return outcome
