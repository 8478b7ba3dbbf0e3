"""NCCL unique ids agreed on through the job's real rendezvous store (no GPU needed).

usage: nccl_worker.py          (3 ranks)
Every rank asks ``_core.nccl_unique_id`` (the engine's exchange: the set's first rank calls
ncclGetUniqueId and publishes, the others fetch) for the global set, for a second communicator
of it, and for process set [1, 2]; ferrovod's allgather of the bytes then shows that every
member holds its set's first rank's id byte for byte, and that the communicators' ids differ.
"""

import numpy as np

import fvtest as T

import ferrovod as fv
from ferrovod import _core
from ferrovod._build_info import _nccl_wheel_dirs
from ferrovod.exceptions import InvalidArgumentError


def gathered(uid, name, process_set=fv.global_process_set):
    row = np.frombuffer(uid, dtype=np.uint8).reshape(1, -1)
    return fv.allgather(row, name=name, process_set=process_set)


def body():
    pset = fv.ProcessSet([1, 2])
    fv.init(process_sets=[pset])
    ck = T.Checker(fv.rank())
    ck.equal(fv.size(), 3, "size()")
    dirs = _nccl_wheel_dirs()
    ps_id = pset.process_set_id
    ck.true(ps_id not in (None, 0), "process set [1, 2] registered", f"id {ps_id!r}")

    uid = _core.nccl_unique_id(dirs, 0, 0)
    ck.true(isinstance(uid, bytes) and len(uid) == 128, "unique id", f"got {uid!r}")
    ck.true(any(uid), "unique id", "all zero bytes")
    rows = gathered(uid, "uid.global.0")
    ck.equal(rows.shape, (3, 128), "gathered ids shape")
    for r in range(3):
        ck.array(rows[r], rows[0], f"rank {r}'s id is rank 0's")

    uid1 = _core.nccl_unique_id(dirs, 0, 1)
    rows1 = gathered(uid1, "uid.global.1")
    for r in range(3):
        ck.array(rows1[r], rows1[0], f"second communicator: rank {r}'s id is rank 0's")
    ck.true(uid1 != uid, "two communicators of one set", "got the same id")

    if fv.rank() == 0:
        ck.raises(InvalidArgumentError, lambda: _core.nccl_unique_id(dirs, ps_id, 0),
                  "a rank outside the set", contains=("not a member",))
    else:
        sid = _core.nccl_unique_id(dirs, ps_id, 0)
        srows = gathered(sid, "uid.set", process_set=pset)
        ck.equal(srows.shape, (2, 128), "set ids shape")
        ck.array(srows[1], srows[0], "set [1, 2]: rank 2's id is rank 1's")
        ck.true(sid != uid and sid != uid1, "set and global communicators", "share an id")
    fv.barrier()  # rank 0 runs the coordinator: it stays until the set's ranks are done
    fv.shutdown()
    return ck.count


if __name__ == "__main__":
    T.run_main(body)
