"""``ferrovod.run`` (Horovod's ``horovod.run`` / ``horovod.runner.run``): runs a Python function
on every process of a job started as ``ferrovodrun`` would, and returns their results."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

__all__ = ["run"]

# Where the function and the results travel in the job's rendezvous store (run_task.py).
FUNC_KEY = "run/func"
SIZE_KEY = "run/size"


def result_key(rank: int) -> str:
    return f"run/result/{rank}"


def run(func: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        np: int = 1, min_np: Optional[int] = None, max_np: Optional[int] = None,
        slots: Optional[int] = None, reset_limit: Optional[int] = None,
        hosts: Optional[str] = None, hostfile: Optional[str] = None,
        start_timeout: Optional[int] = None, ssh_port: Optional[int] = None,
        ssh_identity_file: Optional[str] = None, disable_cache: Optional[bool] = None,
        output_filename: Optional[str] = None, verbose: Optional[bool] = None,
        use_gloo: Optional[bool] = None, use_mpi: Optional[bool] = None,
        mpi_args: Optional[str] = None, network_interface: Optional[str] = None,
        executable: Optional[str] = None) -> List[Any]:
    """Runs ``func(*args, **kwargs)`` on ``np`` processes (on ``hosts``, e.g. ``"a:2,b:2"``,
    or the hosts of ``hostfile``; this machine by default) and returns the list of their
    results, rank 0's first. ``func`` and its results travel pickled (cloudpickle); ``func``
    calls ``ferrovod.init()`` itself, as a script would.

    A worker that raises makes this raise ``RuntimeError`` naming the first such rank, with
    its traceback; any other failure of the job raises ``RuntimeError`` saying which worker
    failed and how. Bad arguments raise ``ValueError``. ``min_np`` / ``max_np`` /
    ``reset_limit`` run it as an elastic job on ``hosts`` (``func`` then uses
    ``ferrovod.elastic.run``), and the results are those of the last membership's ranks.
    ``use_gloo``, ``use_mpi``, ``mpi_args`` and ``disable_cache`` are accepted for Horovod
    compatibility and change nothing. ``executable`` is the Python the workers run (default:
    this one).
    """
    import cloudpickle

    from .flags import build_parser
    from .launch import Exchange, _run
    from .outcome import first_failure

    argv = ["-np", str(np)]
    for flag, value in (("--min-np", min_np), ("--max-np", max_np),
                        ("--slots-per-host", slots), ("--reset-limit", reset_limit),
                        ("-H", hosts), ("--hostfile", hostfile),
                        ("--start-timeout", start_timeout), ("-p", ssh_port),
                        ("-i", ssh_identity_file), ("--output-filename", output_filename),
                        ("--network-interface", network_interface)):
        if value is not None:
            argv += [flag, str(value)]
    if verbose:
        argv.append("--verbose")
    argv += [executable or sys.executable, "-m", "ferrovod.runner.run_task"]
    parser = build_parser()
    parser.exit_on_error = False  # a bad argument is the caller's ValueError, not an exit
    try:
        parsed = parser.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise ValueError(f"ferrovod.run: {exc}") from None
    results: Dict[int, Any] = {}
    size = np  # the last membership's, once rank 0 has said

    def collect(store: Any) -> None:
        nonlocal size
        told = store.get(SIZE_KEY, 0.0)
        if told is not None:
            size = int(told)
        for rank in range(size):
            raw = store.get(result_key(rank), 0.0)
            if raw is not None:
                results[rank] = cloudpickle.loads(raw)

    exchange = Exchange(put={FUNC_KEY: cloudpickle.dumps((func, tuple(args),
                                                          dict(kwargs or {})))},
                        collect=collect)
    failure: Optional[RuntimeError] = None
    try:
        _run(parsed, exchange=exchange)
    except ValueError as exc:
        raise ValueError(f"ferrovod.run: {exc}") from None
    except RuntimeError as exc:
        failure = exc
    raised = first_failure("ferrovod.run", results)
    if raised is not None:
        raise raised
    if failure is not None:
        raise RuntimeError(f"ferrovod.run: {failure}") from None
    missing = [r for r in range(size) if r not in results]
    if missing:
        raise RuntimeError(f"ferrovod.run: no result from rank(s) {missing}")
    return [results[r][1] for r in range(size)]
