"""``ferrovodrun``, the job launcher (horovodrun-compatible flags); see :mod:`.launch`.

Modules: :mod:`.launch` (command line and job flow), :mod:`.hosts` (host lists and rank
assignment), :mod:`.worker_env` (what each worker's environment holds), :mod:`.supervisor`
(starting, watching and stopping workers), :mod:`.output` (line-prefixed output forwarding) and
:mod:`.check_build` (``--check-build``); :func:`run` runs a Python function on a job's
processes (``ferrovod.run``). Importing this package imports none of them, so
``import ferrovod.runner`` stays cheap.
"""

from .run_func import run

__all__ = ["main", "run"]


def main() -> None:
    """Runs ``ferrovodrun`` with ``sys.argv`` (same as the console script)."""
    from .launch import main as _main

    _main()
