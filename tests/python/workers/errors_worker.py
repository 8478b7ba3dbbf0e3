"""Error paths: disagreeing ranks, invalid arguments, ops before init, a dead rank, fork.

usage: errors_worker.py CASE [ARGS...]
  mismatch            every kind of disagreement; each must raise MismatchError on every rank
  invalid             arguments rejected locally (ValueError) on every rank
  notinit             ops and queries before init() (plain python, no launcher needed)
  kill MARKER ITER    rank 1 SIGKILLs itself at loop iteration ITER; the others report
  fork                a child forked after init() must get NotInitializedError
  stall               rank 1 SIGSTOPs itself mid-transfer; the others must time out, not hang
  settings            rank 1 cuts rings into other chunks; init() must fail on every rank
"""

import os
import re
import signal
import sys
import time

import numpy as np

import fvtest as T

import ferrovod as fv


def names_rank(msg, rank):
    """True when ``msg`` mentions rank ``rank`` near the word "rank"."""
    return re.search(rf"rank[s]?\b[^\n]{{0,60}}?(?<![\d.]){rank}(?![\d.])", msg, re.I) is not None


def expect_mismatch(ck, what, name, bad_rank, fn):
    t0 = time.monotonic()
    e = ck.raises(fv.MismatchError, fn, what)
    elapsed = time.monotonic() - t0
    msg = str(e)
    ck.true(isinstance(e, fv.FerrovodError) and isinstance(e, RuntimeError), what, "class hierarchy")
    ck.true(name in msg, what, f"message does not name the tensor {name!r}: {msg!r}")
    ck.true(names_rank(msg, bad_rank), what, f"message does not name rank {bad_rank}: {msg!r}")
    ck.true(elapsed < 20, what, f"took {elapsed:.1f} s to fail")
    print(f"caught {what}: {msg}", flush=True)


def still_works(ck, tag):
    n = fv.size()
    x = np.full(6, fv.rank() + 1, np.float64)
    ck.array(fv.allreduce(x, op=fv.Sum, name=f"after.{tag}"), np.full(6, n * (n + 1) / 2), f"op after {tag}")
    ck.array(fv.allreduce(x, op=fv.Sum), np.full(6, n * (n + 1) / 2), f"unnamed op after {tag}")


def case_mismatch():
    fv.init()
    r, n = fv.rank(), fv.size()
    assert n >= 3, "run with at least 3 ranks"
    ck = T.Checker(r)
    odd = n - 1  # the rank that disagrees, unless a case says otherwise

    shape = (5,) if r == odd else (4,)
    expect_mismatch(ck, "shape mismatch", "mm.shape", odd,
                    lambda: fv.allreduce(np.ones(shape, np.float32), name="mm.shape"))
    still_works(ck, "shape")

    dt = np.float64 if r == 1 else np.float32
    expect_mismatch(ck, "dtype mismatch", "mm.dtype", 1,
                    lambda: fv.allreduce(np.ones(4, dt), name="mm.dtype"))
    still_works(ck, "dtype")

    def kind():
        x = np.ones((2, 3), np.float32)
        if r == odd:
            return fv.allgather(x, name="mm.kind")
        return fv.allreduce(x, name="mm.kind")
    expect_mismatch(ck, "op kind mismatch", "mm.kind", odd, kind)
    still_works(ck, "kind")

    op = fv.Max if r == 0 else fv.Sum  # the coordinator itself disagrees
    expect_mismatch(ck, "reduce op mismatch", "mm.redop", 0,
                    lambda: fv.allreduce(np.ones(4, np.float32), op=op, name="mm.redop"))
    still_works(ck, "redop")

    root = 1 if r == odd else 0
    expect_mismatch(ck, "broadcast root mismatch", "mm.root", odd,
                    lambda: fv.broadcast(np.ones(3, np.int32), root, name="mm.root"))
    still_works(ck, "root")

    trailing = (2, 4) if r == 1 else (2, 3)
    expect_mismatch(ck, "allgather trailing-dim mismatch", "mm.gather", 1,
                    lambda: fv.allgather(np.ones(trailing, np.float32), name="mm.gather"))
    still_works(ck, "gather")

    pre = 2.0 if r == odd else 1.0
    expect_mismatch(ck, "prescale mismatch", "mm.scale", odd,
                    lambda: fv.allreduce(np.ones(4, np.float32), op=fv.Sum, prescale_factor=pre, name="mm.scale"))
    still_works(ck, "scale")

    # an unnamed op gets its automatic name in the message
    shape = (3,) if r == odd else (2,)
    expect_mismatch(ck, "unnamed shape mismatch", "allreduce.noname.", odd,
                    lambda: fv.allreduce(np.ones(shape, np.float32)))
    still_works(ck, "unnamed")

    # an async mismatch raises from synchronize
    shape = (2, 2) if r == odd else (4,)
    h = fv.allreduce_async(np.ones(shape, np.float32), name="mm.async")
    expect_mismatch(ck, "async shape mismatch", "mm.async", odd, lambda: fv.synchronize(h))
    still_works(ck, "async")
    return ck.count


def case_invalid():
    fv.init()
    r, n = fv.rank(), fv.size()
    ck = T.Checker(r)
    x = np.ones((2 * n, 2), np.float32)
    for op in (fv.Min, fv.Max, fv.Product):
        ck.raises(ValueError, lambda: fv.reducescatter(x, op=op), f"reducescatter op={op}")
    for bad_root in (n, n + 5, -1):
        ck.raises(ValueError, lambda: fv.broadcast(x, bad_root), f"broadcast root={bad_root}")
        ck.raises(ValueError, lambda: fv.broadcast_(x.copy(), bad_root), f"broadcast_ root={bad_root}")
    ck.raises(ValueError, lambda: fv.allreduce(x, average=False, op=fv.Sum), "average= with op=")
    # What the one-call path of a plain array declines, the general path refuses, by name.
    for bad in (True, "sum", 1.0, 99):
        ck.raises(ValueError, lambda: fv.allreduce(x, op=bad), f"allreduce op={bad!r}",
                  contains=(f"op={bad!r}", "not a reduction"))
        ck.raises(ValueError, lambda: fv.allreduce_(x.copy(), op=bad), f"allreduce_ op={bad!r}",
                  contains=(f"op={bad!r}", "not a reduction"))
    ck.raises((ValueError, fv.FerrovodError), lambda: fv.allgather(np.float32(3.0) * np.ones(())),
              "allgather of a 0-d array")
    ck.raises((ValueError, fv.FerrovodError), lambda: fv.alltoall(np.ones(2 * n + 1, np.float32)),
              "alltoall whose dim 0 does not divide")
    ck.raises((ValueError, fv.FerrovodError), lambda: fv.alltoall(x, splits=[1] * (n + 1)),
              "alltoall with too many splits")
    ck.raises((ValueError, fv.FerrovodError), lambda: fv.alltoall(x, splits=[2 * n + 1] + [0] * (n - 1)),
              "alltoall splits summing past dim 0")
    # nothing above reached the wire: the job still works
    still_works(ck, "invalid arguments")
    return ck.count


def case_notinit():
    ck = T.Checker(0)
    import ferrovod.exceptions as fe

    for name, base in [("FerrovodError", RuntimeError), ("HorovodInternalError", fv.FerrovodError),
                       ("RankFailureError", fv.HorovodInternalError), ("FerrovodTimeoutError", fv.HorovodInternalError),
                       ("ShutdownError", fv.HorovodInternalError), ("MismatchError", fv.FerrovodError),
                       ("NotInitializedError", fv.FerrovodError), ("NotInitializedError", ValueError)]:
        ck.true(issubclass(getattr(fv, name), base), "exception classes", f"{name} is not a {base.__name__}")
        ck.true(getattr(fe, name) is getattr(fv, name), "exception classes", f"ferrovod.exceptions.{name}")
    ck.equal(fv.is_initialized(), False, "is_initialized before init")
    x = np.ones(3, np.float32)
    calls = {
        "allreduce": lambda: fv.allreduce(x),
        "allreduce_async": lambda: fv.allreduce_async(x),
        "allgather": lambda: fv.allgather(x),
        "broadcast": lambda: fv.broadcast(x, 0),
        "barrier": lambda: fv.barrier(),
        "rank": fv.rank,
        "size": fv.size,
        "local_rank": fv.local_rank,
        "cross_size": fv.cross_size,
    }
    for what, fn in calls.items():
        e = ck.raises(fv.NotInitializedError, fn, f"{what} before init")
        ck.true(isinstance(e, ValueError) and isinstance(e, fv.FerrovodError), what, "class hierarchy")
    fv.init()
    ck.equal(fv.size(), 1, "size after init")
    ck.array(fv.allreduce(x, op=fv.Sum), x, "allreduce after init")
    return ck.count


def case_kill(marker, kill_at):
    fv.init()
    r, n = fv.rank(), fv.size()
    ck = T.Checker(r)
    kill_at = int(kill_at)
    if r != 1:
        # The launcher may signal the survivors once rank 1 is gone; they must still get to
        # report what ferrovod raised, so a SIGTERM only ends them a little later.
        signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM", flush=True))
    x = np.ones(1024, np.float32)
    i = 0
    while True:
        if r == 1 and i == kill_at:
            print(f"killing myself at iteration {i}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            res = fv.allreduce(x, op=fv.Sum, name=f"loop.{i % 7}")
        except fv.RankFailureError as e:
            elapsed = time.monotonic() - t0
            print(f"RANKFAIL iteration={i} rank_attr={e.rank} elapsed={elapsed:.3f} "
                  f"internal={isinstance(e, fv.HorovodInternalError)} msg={e}", flush=True)
            # the engine stays failed, it does not hang: the next op raises at once too
            t1 = time.monotonic()
            try:
                fv.allreduce(x, name="after.failure")
                print("NEXT-OP succeeded", flush=True)
            except fv.HorovodInternalError as e2:
                print(f"NEXT-OP {type(e2).__name__} elapsed={time.monotonic() - t1:.3f}", flush=True)
            sys.exit(0)
        ck.array(res, np.full(1024, n, np.float32), f"loop allreduce {i}")
        i += 1
        if i > kill_at + 10000:
            raise RuntimeError("rank 1 never died")


def case_stall():
    """Rank 1 SIGSTOPs itself while a large allgather is moving data; the others must time out.

    Rank 1 contributes one row and so submits at once, while the other ranks' 64 MiB each
    keep the transfer going well past the moment rank 1 stops.
    """
    fv.init()
    r = fv.rank()
    ck = T.Checker(r)
    pids = fv.allgather_object(os.getpid(), name="pids")
    rows = 1 if r == 1 else 16 << 20
    x = np.ones(rows, np.float32)
    waiting = T.Marks(pids[0], "stall-waiting")
    others = [o for o in range(fv.size()) if o != 1]
    if r == 1:
        waiting.wait(others)
        fv.allgather_async(x, name="stall.op")
        # Most often the data is moving by now; where rank 1 stops before its request has gone
        # out, the others wait for it in negotiation instead, and time out all the same.
        time.sleep(0.03)
        print("rank 1 stops itself now", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError("unreachable: rank 1 is stopped and then killed")
    t0 = time.monotonic()
    print("waiting for the stopped rank", flush=True)
    waiting.set(r)
    try:
        fv.allgather(x, name="stall.op")
        print("STALLED none: the op completed without rank 1", flush=True)
    except fv.HorovodInternalError as e:
        print(f"STALLED {type(e).__name__} elapsed={time.monotonic() - t0:.3f} "
              f"named={names_rank(str(e), 1)} msg={e}", flush=True)
    finally:
        # A stopped rank cannot end by itself, and killing it makes the launcher stop the job:
        # rank 0 kills it once every other rank has reported (rank 2 may still be waiting for
        # the coordinator's verdict when rank 0 has its own).
        reported = T.Marks(pids[0], "stall-reported")
        reported.set(r)
        if r == 0:
            reported.wait(others)
            os.kill(pids[1], signal.SIGKILL)
    return ck.count


def case_fork():
    fv.init()
    r, n = fv.rank(), fv.size()
    ck = T.Checker(r)
    x = np.full(5, r + 1, np.float64)
    exp = np.full(5, n * (n + 1) / 2)
    ck.array(fv.allreduce(x, op=fv.Sum, name="before.fork"), exp, "allreduce before fork")
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rd)
        try:
            fv.allreduce(x, op=fv.Sum, name="in.child")
            verdict = "child: allreduce succeeded"
        except fv.NotInitializedError as e:
            verdict = "ok" if "fork" in str(e).lower() else f"child: message does not mention fork: {e}"
        except BaseException as e:  # noqa: BLE001
            verdict = f"child: raised {type(e).__name__}: {e}"
        os.write(wr, verdict.encode())
        os._exit(0)
    os.close(wr)
    chunks = []
    while True:
        b = os.read(rd, 4096)
        if not b:
            break
        chunks.append(b)
    _, status = os.waitpid(pid, 0)
    verdict = b"".join(chunks).decode()
    ck.equal(verdict, "ok", "forked child")
    ck.equal(status, 0, "forked child exit status")
    for i in range(3):
        ck.array(fv.allreduce(x, op=fv.Sum, name=f"after.fork.{i}"), exp, "allreduce in the parent after fork")
    return ck.count


def case_settings():
    """Settings the algorithms depend on must agree: a rank that chunked rings differently
    would wait for transfers that never come. init() must say so on every rank, naming the
    setting, both values and the other rank."""
    rank = int(os.environ["FERROVOD_RANK"])
    if rank == 1:
        os.environ["FERROVOD_CHUNK_BYTES"] = "65536"
    ck = T.Checker(rank)
    t0 = time.monotonic()
    e = ck.raises(fv.InvalidArgumentError, fv.init, "init with disagreeing settings",
                  contains=("FERROVOD_CHUNK_BYTES=65536", "FERROVOD_CHUNK_BYTES=1048576"))
    msg = str(e)
    ck.true(names_rank(msg, 0 if rank == 1 else 1), "settings", f"does not name the other rank: {msg}")
    ck.true(time.monotonic() - t0 < 30, "settings", "took too long to fail")
    ck.equal(fv.is_initialized(), False, "not initialized after the failed init")
    print(f"caught: {msg}", flush=True)
    return ck.count


def main():
    case, args = sys.argv[1], sys.argv[2:]
    fn = {"mismatch": case_mismatch, "invalid": case_invalid, "notinit": case_notinit,
          "kill": case_kill, "fork": case_fork, "stall": case_stall,
          "settings": case_settings}[case]
    return fn(*args)


if __name__ == "__main__":
    T.run_main(main)
