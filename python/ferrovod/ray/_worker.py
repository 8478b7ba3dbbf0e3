"""The Ray actor that holds one rank of a :class:`ferrovod.ray.RayExecutor` job.

Its process stays up between calls: ``start`` gives it the rank's environment once (the same
variables ``ferrovodrun`` gives a worker), and every ``run``/``execute`` then calls the user's
function in it, which calls ``ferrovod.init()`` as a script would.
"""

from __future__ import annotations

import os
import socket
import sys
import time
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

    def elastic(self, env: Dict[str, str], gpus_on_node: int,
                executable: Optional[Tuple[type, Sequence[Any], Dict[str, Any]]],
                on_executable: bool, fn: Callable[..., Any], args: Sequence[Any],
                kwargs: Dict[str, Any]) -> Tuple[Outcome, int, int]:
        """One worker of an elastic job (:mod:`ferrovod.ray.elastic`), from its start to its
        end: takes its slot's environment, calls ``fn(*args, **kwargs)`` (or
        ``fn(executable)``), and returns the outcome with the worker's last rank and size. A
        worker the job removed returns ``("removed", None, t)``."""
        os.environ.update(env)
        if gpus_on_node:
            import ray

            local_rank = int(env.get("FERROVOD_LOCAL_RANK", "0"))
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(
                gpu_order([str(g) for g in ray.get_gpu_ids()], local_rank, gpus_on_node))
        try:
            if executable is not None:
                cls, cargs, ckwargs = executable
                self.executable = cls(*cargs, **ckwargs)
            outcome = _ended(capture(fn, (self.executable,)) if on_executable
                             else capture(fn, args, kwargs))
        except SystemExit as exc:
            outcome = ("removed", None, time.time()) if exc.code in (None, 0) else _ended(
                ("error", f"SystemExit: {exc.code}\n", time.time()))
        return (outcome, int(os.environ.get("FERROVOD_RANK", "-1")),
                int(os.environ.get("FERROVOD_SIZE", "0")))


def gpu_order(mine: Sequence[str], local_rank: int, gpus_on_node: int) -> List[str]:
    """The node's GPUs as a rank of an elastic job sees them: its own (Ray's choice) at index
    ``local_rank``, so that a script's ``set_device(local_rank)`` finds them, and the others
    around them (a rank's local rank is its slot's, fixed for its life)."""
    if not mine:
        return []
    others = [str(g) for g in range(gpus_on_node) if str(g) not in mine]
    at = min(local_rank, len(others))
    return others[:at] + list(mine) + others[at:]


def _ended(outcome: Outcome) -> Outcome:
    """A rank that raised stops its engine, as its process would end under ``ferrovodrun``:
    peers waiting on it in a collective then fail at once instead of waiting for it."""
    lifecycle = sys.modules.get("ferrovod._lifecycle")
    if outcome[0] == "error" and lifecycle is not None and lifecycle.is_initialized():
        lifecycle.shutdown()
    return outcome
