"""One rank of a ``backend="ferrovod"`` job whose ranks disagree or die (see
test_process_group.py). Started as a plain process: ``pg_fail_worker.py <mode> <rank> <size>
<file store path>``, joining through ``init_method="file://..."`` with a 600 s timeout, so that
an error that comes is the engine's report, never the timeout.

- ``mismatch``: ranks disagree on a collective's shape, then dtype, then reduce op, and a send and its
  receive on shape and dtype; every rank
  must get an error naming the ranks, and the job must go on (the next op is checked). Then
  rank 0 alone gives arguments its op cannot take (a reduce-scatter's size, all-to-all splits):
  every rank must fail with rank 0's reason.
- ``auth``: the job steps until the test says stop, while the test connects to rank 0's
  coordinator as a stranger (test_process_group.py).
- ``kill``: the last rank SIGKILLs itself while the others are in an allreduce; they must get
  a rank-failure error naming it.
- ``early``: rank 0 leaves (destroy_process_group) while the other ranks go on among
  themselves in a group without it: they must finish, since rank 0's engine serves them
  until they have gone (torch's destroy_process_group is no barrier).
- ``early-attached``: as ``early``, in a job ``ferrovodrun`` started (``<rank> <size> <path>``
  are then ``- - -``): every rank calls ``ferrovod.init()`` first and
  ``init_process_group("ferrovod")`` (env://) then joins that engine; rank 0 leaves with
  ``destroy_process_group`` and ``ferrovod.shutdown()``.
- ``timeout``: rank 0 alone enters a barrier of a group made with ``timeout=``; it must fail
  once that time has passed (not before), naming the ranks that never came, and the job must
  go on. The ranks also carry ``WORLD_SIZE`` without ``RANK``, as torch's own test harness
  leaves them: torch hands the backend the rank, so no launcher's variables are read.
- ``detail``: under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (the test sets it), torch wraps the
  backend in its own, which checks every collective across ranks: ops and an object gather on
  a subgroup must work, a shape mismatch must raise torch's report on every rank, and
  ``destroy_process_group`` must reach the backend (which then keeps no group open). With
  ``EXPECT_FRONT=0`` the backend's C++ half cannot be built (the test gives torch no
  compiler): the Python half alone must do all that, and refuse ``recv`` without ``src``.

Each rank prints ``rank <r> OK <checks>`` when all its checks held.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ferrovod.torch  # noqa: F401 - registers the backend
from ferrovod.exceptions import MismatchError, RankFailureError

mode = sys.argv[1]
if mode == "early-attached":
    ferrovod.torch.init()
    rank, size, path = ferrovod.torch.rank(), ferrovod.torch.size(), None
else:
    rank, size, path = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
checks = 0


def check(ok, what):
    global checks
    if not ok:
        print(f"rank {rank} FAIL {what}", flush=True)
        sys.exit(1)
    checks += 1


def goes_on(after):
    """The job's own group still reduces right, ``after`` something failed on some ranks."""
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    check(torch.equal(t, torch.full((2,), float(size * (size - 1) // 2))),
          f"the job goes on after {after}: {t}")


if mode == "timeout":
    os.environ["WORLD_SIZE"] = str(size)
    os.environ.pop("RANK", None)
if path is None:
    dist.init_process_group("ferrovod", timeout=timedelta(seconds=600))
else:
    dist.init_process_group("ferrovod", init_method=f"file://{path}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=600))
t = torch.ones(4)
dist.all_reduce(t)
check(torch.equal(t, torch.full((4,), float(size))), f"first all_reduce {t}")

if mode == "mismatch":
    others = ", ".join(str(r) for r in range(1, size))
    cases = [
        ("shape", lambda: dist.all_reduce(torch.ones(3 if rank == 0 else 5))),
        ("dtype", lambda: dist.all_reduce(torch.ones(3, dtype=torch.float32 if rank == 0
                                                     else torch.float64))),
        ("op", lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.SUM if rank == 0
                                       else dist.ReduceOp.MAX)),
        ("root", lambda: dist.broadcast(torch.ones(3), src=0 if rank == 0 else 1)),
    ]
    for what, call in cases:
        try:
            call()
            check(False, f"a {what} mismatch raised nothing")
        except MismatchError as e:
            text = str(e)
            print(f"rank {rank} {what}: {text}", flush=True)
            check("rank 0" in text or "ranks 0" in text, f"{what}: rank 0 not named: {text}")
            check(any(f"{r}" in text for r in range(1, size)),
                  f"{what}: ranks {others} not named: {text}")
        goes_on(f"the {what} mismatch")
    # A message whose receive disagrees with it fails on both sides, naming both; the pair's
    # next message goes through.
    for what, shape, dtype in (("shape", (5,), torch.float32), ("dtype", (4,), torch.int32)):
        try:
            if rank == 0:
                dist.send(torch.ones(4), 1)
            elif rank == 1:
                dist.recv(torch.empty(shape, dtype=dtype), 0)
            if rank < 2:
                check(False, f"a point-to-point {what} mismatch raised nothing")
        except MismatchError as e:
            text = str(e)
            print(f"rank {rank} point-to-point {what}: {text}", flush=True)
            check("rank 0 sends float32 [4]" in text and "rank 1 receives into" in text,
                  f"point-to-point {what}: both ranks not named: {text}")
        if rank == 0:
            dist.send(torch.arange(3.0), 1)
        elif rank == 1:
            got = torch.empty(3)
            dist.recv(got, 0)
            check(torch.equal(got, torch.arange(3.0)), f"the message after the {what} mismatch")
        goes_on(f"the point-to-point {what} mismatch")
    # Arguments only rank 0 gets wrong: refused on rank 0, failed on every rank with its reason.
    refusals = [
        ("rank 0 gives", lambda: dist.reduce_scatter_tensor(
            torch.empty(2), torch.ones(2 * size + (1 if rank == 0 else 0)))),
        ("rank 0's input splits", lambda: dist.all_to_all_single(
            torch.empty(size), torch.ones(size),
            input_split_sizes=[size + 1] + [0] * (size - 1) if rank == 0 else None)),
    ]
    for what, call in refusals:
        try:
            call()
            check(False, f"{what}: rank 0's bad arguments raised nothing here")
        except Exception as e:  # noqa: BLE001 - every rank gets rank 0's reason
            text = str(e)
            print(f"rank {rank} {what}: {text}", flush=True)
            check(what in text, f"rank 0's reason ({what} ...) not given: {text}")
        goes_on(f"the {what} refusal")
    dist.destroy_process_group()
elif mode in ("early", "early-attached"):
    if rank == 0:
        dist.destroy_process_group()
        if mode == "early-attached":
            ferrovod.torch.shutdown()
    else:
        # An op of the whole job fails once rank 0 has left (not waiting for it); only then do
        # the others make their group (torch's new_group asks no rank outside the group), which
        # rank 0's node must still register for them.
        try:
            dist.all_reduce(torch.ones(1 << 20))
            check(False, "an op of the whole job completed after rank 0 left")
        except Exception as e:  # noqa: BLE001 - what torch's users catch
            check("rank 0" in str(e), f"the error does not name rank 0: {e}")
        rest = dist.new_group(list(range(1, size)))
        others = size - 1
        for i in range(300):
            t = torch.full((5,), float(rank + i))
            dist.all_reduce(t, group=rest)
            want = float(sum(r + i for r in range(1, size)))
            check(torch.equal(t, torch.full((5,), want)),
                  f"op {i} among ranks 1..{others} after rank 0 left: {t}")
        dist.destroy_process_group()
elif mode == "timeout":
    limit = 1.5
    # Every rank (a group over the whole job with a timeout of its own) and ranks 0 and 1.
    groups = [dist.new_group(list(range(size)), timeout=timedelta(seconds=limit)),
              dist.new_group([0, 1], timeout=timedelta(seconds=limit))]
    for i, group in enumerate(groups):
        if rank == 0:
            started = time.monotonic()
            try:
                dist.barrier(group=group)
                check(False, f"group {i}: a barrier rank 0 entered alone completed")
            except Exception as e:  # noqa: BLE001 - what torch's users catch
                took = time.monotonic() - started
                print(f"rank 0 group {i} after {took:.2f} s: {e}", flush=True)
                check(" timeout " in str(e), f"group {i}: the error does not say timeout: {e}")
                check("ranks [1" in str(e), f"group {i}: the missing ranks are not named: {e}")
                # Never before the timeout; the check runs a few times a second.
                check(took >= limit - 0.05, f"group {i}: failed after {took:.2f} s")
        # The other ranks wait here, on the job's own group, until rank 0 has had its error.
        goes_on(f"group {i}'s timeout")
    dist.destroy_process_group()
elif mode == "detail":
    from ferrovod.torch import _front
    expect_front = os.environ["EXPECT_FRONT"] == "1"
    check((_front.backend_class() is not None) == expect_front,
          f"the C++ half: {_front.backend_class()}, expected: {expect_front}")
    if not expect_front and rank == 0:
        try:
            dist.recv(torch.empty(1))
            check(False, "recv without src raised nothing")
        except Exception as e:  # noqa: BLE001 - what torch's users catch
            check("src" in str(e) and "C++ half" in str(e), f"not the reason: {e}")
    pair = dist.new_group([0, 1])
    if rank < 2:
        got = [None, None]
        dist.all_gather_object(got, {"rank": rank, "text": "x" * (rank + 1)}, group=pair)
        check(got == [{"rank": 0, "text": "x"}, {"rank": 1, "text": "xx"}], f"objects {got}")
    try:
        dist.all_reduce(torch.ones(3 if rank == 0 else 4))
        check(False, "a shape mismatch raised nothing")
    except RuntimeError as e:
        print(f"rank {rank} mismatch: {e}", flush=True)
        check("mismatch" in str(e).lower(), f"not torch's report of a mismatch: {e}")
    goes_on("torch's check of a mismatch")
    from ferrovod.torch import process_group as _pg
    check(len(_pg._open_groups) == (2 if rank < 2 else 1), f"open groups {_pg._open_groups}")
    dist.destroy_process_group()
    check(not _pg._open_groups, f"groups left open: {_pg._open_groups}")
elif mode == "auth":
    # The job steps (a checked allreduce every 10 ms) while the test attacks rank 0's
    # coordinator from outside, until the test leaves <path>.stop. Rank 0 looks for it and
    # tells the others with each step, so that every rank takes its last step together (one
    # that looked by itself could go on to the barrier while another steps once more).
    deadline = time.monotonic() + 300
    while True:
        check(time.monotonic() < deadline, "the test never said stop")
        stop = torch.tensor([float(rank == 0 and os.path.exists(f"{path}.stop"))])
        dist.broadcast(stop, src=0)
        if stop.item():
            break
        goes_on("a stranger's connection")
        time.sleep(0.01)
    dist.barrier()
    dist.destroy_process_group()
elif mode == "kill":
    victim = size - 1
    # A receive from the victim, posted before it dies, fails naming it.
    pending = dist.irecv(torch.empty(3), victim) if rank == 0 else None
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        work.wait()
        check(False, "an allreduce with a dead rank completed")
    except RankFailureError as e:
        print(f"rank {rank} error: {e}", flush=True)
        check(f"rank {victim}" in str(e), f"the dead rank is not named: {e}")
    if pending is not None:
        try:
            pending.wait()
            check(False, "a receive from a dead rank completed")
        except RankFailureError as e:
            print(f"rank {rank} receive error: {e}", flush=True)
            check(f"rank {victim}" in str(e), f"the receive's error does not name it: {e}")
    # A survivor that left now would be a second lost rank to those still waiting for their
    # error (rank 0 holds the coordinator): each stays until every survivor has had its own.
    open(f"{path}.seen.{rank}", "w").close()
    deadline = time.monotonic() + 300
    while not all(os.path.exists(f"{path}.seen.{r}") for r in range(victim)):
        check(time.monotonic() < deadline, "the other survivors never saw the failure")
        time.sleep(0.05)
    print(f"rank {rank} OK {checks}", flush=True)
    # The engine has lost a peer: leave without a shutdown that would wait on it.
    os._exit(0)
print(f"rank {rank} OK {checks}", flush=True)
