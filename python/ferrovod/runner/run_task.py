"""The worker side of ``ferrovod.run``: ``python -m ferrovod.runner.run_task``, started by the
launcher on every slot. It takes the pickled ``(func, args, kwargs)`` from the job's rendezvous
store, calls it, and leaves its result (or the traceback of what it raised) there under its
rank for ``ferrovod.run`` to collect.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from .outcome import Outcome, capture
from .run_func import FUNC_KEY, SIZE_KEY, result_key


def _pickled(outcome: Outcome) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(outcome)
    except Exception:  # noqa: BLE001 - a result that cannot travel is reported as such
        return cloudpickle.dumps(("error", "the function's result cannot be pickled:\n"
                                  + traceback.format_exc(), time.time()))


def main() -> int:
    import cloudpickle

    from .._core import StoreClient  # type: ignore[import-not-found,unused-ignore]

    addr, secret = os.environ.get("FERROVOD_RENDEZVOUS_ADDR"), os.environ.get("FERROVOD_SECRET")
    if not addr or not secret:
        sys.stderr.write("ferrovod.runner.run_task: no rendezvous store in the environment "
                         "(started by ferrovod.run only)\n")
        return 2
    store = StoreClient(addr, bytes.fromhex(secret), 30.0)
    payload = store.get(FUNC_KEY, 30.0)
    if payload is None:
        sys.stderr.write("ferrovod.runner.run_task: the launcher gave no function to run\n")
        return 2

    def call() -> object:
        func, args, kwargs = cloudpickle.loads(payload)  # a missing module is this rank's error
        return func(*args, **kwargs)

    # SystemExit passes: a worker an elastic job removed leaves no result, its rank went on.
    outcome = capture(call)
    code = 0 if outcome[0] == "ok" else 1
    # The rank of the job's last membership (an elastic worker's may have changed).
    rank, size = int(os.environ.get("FERROVOD_RANK", "0")), int(os.environ.get("FERROVOD_SIZE", "1"))
    store.set(result_key(rank), _pickled(outcome))
    if rank == 0:
        store.set(SIZE_KEY, str(size).encode())
    return code


if __name__ == "__main__":
    sys.exit(main())
