"""init / shutdown / re-init, join with uneven data, topology.

usage: lifecycle_worker.py CASE [N]
  single      size-1 job without any launcher (the test strips the launch environment)
  reinit      shutdown() then init() again, several times
  join        rank 0 runs 3 fewer steps and joins; the others go on; join() returns the last
  joinerr     an allgather while rank 0 is joined must raise on the ranks that call it
  topology N  rank/size/local/cross values of an N-rank job on one host
"""

import os
import sys
import time
import zlib

import numpy as np

import fvtest as T
from fvtest import AVERAGE, SUM

import ferrovod as fv


def check_topology(ck, n):
    r = fv.rank()
    ck.equal(fv.size(), n, "size()")
    ck.true(0 <= r < n, "rank()", f"rank {r} out of range")
    ck.equal(fv.local_rank(), r, "local_rank() on one host")
    ck.equal(fv.local_size(), n, "local_size() on one host")
    ck.equal(fv.cross_rank(), 0, "cross_rank() on one host")
    ck.equal(fv.cross_size(), 1, "cross_size() on one host")
    ck.equal(fv.is_homogeneous(), True, "is_homogeneous()")
    ck.equal(fv.is_initialized(), True, "is_initialized()")
    ck.equal(fv.global_process_set.size(), n, "global_process_set.size()")
    info = fv.allgather_object((r, os.getpid()))
    ck.equal([i[0] for i in info], list(range(n)), "every rank once, in order")
    ck.equal(len({i[1] for i in info}), n, "one process per rank")


def basic_ops(ck, tag):
    r, n = fv.rank(), fv.size()
    k = (3, zlib.crc32(tag.encode()))
    xs = [T.gen(k, j, np.float32, (10,)) for j in range(n)]
    ck.array(fv.allreduce(xs[r], op=fv.Sum, name=f"{tag}.ar"), T.ref_reduce(xs, SUM, np.float32, n), f"{tag} allreduce")
    ck.array(fv.allreduce(xs[r]), T.ref_reduce(xs, AVERAGE, np.float32, n), f"{tag} unnamed allreduce")
    ck.array(fv.allgather(xs[r]), np.concatenate(xs), f"{tag} allgather")
    ck.array(fv.broadcast(xs[r], n - 1), xs[n - 1], f"{tag} broadcast")
    fv.barrier()
    ck.equal(fv.broadcast_object(tag, root_rank=0), tag, f"{tag} broadcast_object")


def case_single():
    ck = T.Checker(0)
    fv.init()
    check_topology(ck, 1)
    fv.init()  # a second init is a no-op
    ck.equal(fv.size(), 1, "size() after a second init()")
    basic_ops(ck, "single")
    x = np.arange(6, dtype=np.int64).reshape(3, 2)
    out, recv = fv.alltoall(x, splits=[3])
    ck.array(out, x, "alltoall on one rank")
    ck.equal([int(v) for v in np.asarray(recv)], [3], "alltoall received splits on one rank")
    ck.array(fv.reducescatter(x, op=fv.Sum), x, "reducescatter on one rank")
    ck.equal(fv.allgather_object({"a": 1}), [{"a": 1}], "allgather_object on one rank")
    ck.equal(fv.join(), 0, "join() on one rank")
    info = fv.build_info()
    ck.true(isinstance(info, dict) and "version" in info, "build_info()", f"got {info!r}")
    for q in ("mpi_built", "mpi_enabled", "mpi_threads_supported", "cuda_built",
              "ddl_built", "ccl_built", "rocm_built"):
        ck.equal(getattr(fv, q)(), False, f"{q}()")
    # ferrovod's controller stands where Gloo does in Horovod: a job without MPI.
    ck.equal((fv.gloo_built(), fv.gloo_enabled()), (True, True), "gloo_built(), gloo_enabled()")
    # The NCCL the run-time search found when CUDA tensors are dispatched to it (unless
    # FERROVOD_NCCL_DISPATCH=0), else 0.
    nccl = fv.gpu_libraries()["nccl"]
    dispatch = os.environ.get("FERROVOD_NCCL_DISPATCH", "1") != "0" and nccl["found"]
    ck.equal(fv.nccl_built(), int(nccl["code"]) if dispatch else 0, "nccl_built()")
    ck.equal([fv.Average, fv.Sum, fv.Adasum, fv.Min, fv.Max, fv.Product], [0, 1, 2, 3, 4, 5], "op constants")
    # The one-call route of a small blocking allreduce takes the names ferrovod.torch builds
    # (OpName: a str that says where its base begins) as it takes plain ones; declined, the op
    # would still complete, through the general path's frames (3 us a 4-byte op became 15).
    from ferrovod import _core
    from ferrovod._arguments import OpName

    for name in ("plain.name", OpName("allreduce", "grad.w"), OpName("allreduce", "")):
        y = np.full(3, 2.0, np.float32)
        ck.equal(_core.allreduce_now(y, y, name, fv.Sum, None, 1.0, 1.0), True,
                 f"allreduce_now takes the name {name!r} ({type(name).__name__})")
        ck.array(y, np.full(3, 2.0, np.float32), f"allreduce_now's result under {name!r}")
    fv.shutdown()
    ck.equal(fv.is_initialized(), False, "is_initialized() after shutdown")
    ck.equal(fv.gloo_enabled(), False, "gloo_enabled() after shutdown")
    return ck.count


def case_reinit():
    ck = T.Checker(int(os.environ.get("FERROVOD_RANK", "-1")))
    n = None
    for cycle in range(3):
        fv.init()
        fv.init()  # no-op
        if n is None:
            n = fv.size()
        ck.equal(fv.size(), n, f"size after init #{cycle}")
        ck.equal(fv.is_initialized(), True, f"is_initialized after init #{cycle}")
        check_topology(ck, n)
        basic_ops(ck, f"cycle{cycle}")
        for i in range(20):  # the same names every cycle
            x = np.full(4, fv.rank() + i, np.float64)
            exp = np.full(4, n * (n - 1) / 2 + n * i)
            ck.array(fv.allreduce(x, op=fv.Sum, name=f"rep.{i}"), exp, f"cycle {cycle} op {i}")
        fv.shutdown()
        ck.equal(fv.is_initialized(), False, f"is_initialized after shutdown #{cycle}")
        ck.raises((fv.NotInitializedError, fv.ShutdownError), lambda: fv.allreduce(np.ones(2)),
                  f"op after shutdown #{cycle}")
        fv.shutdown()  # harmless when already shut down
    fv.init()
    basic_ops(ck, "final")
    return ck.count


def case_join():
    fv.init()
    r, n = fv.rank(), fv.size()
    ck = T.Checker(r)
    steps = 10
    for rnd, (short, last) in enumerate([(0, n - 1), (n - 1, 0)]):
        my_steps = steps - 3 if r == short else steps
        for i in range(my_steps):
            k = (8, rnd, i)
            active = [j for j in range(n) if i < steps - 3 or j != short]
            xs = [T.gen(k, j, np.float64, (6,)) for j in range(n)]
            exp = np.sum([xs[j] for j in active], axis=0) / n  # joined ranks count as zeros
            ck.array(fv.allreduce(xs[r], op=fv.Average, name=f"join.{rnd}.f.{i}"), exp,
                     f"round {rnd} step {i} Average ({len(active)} active ranks)")
            ys = [T.gen(k, j, np.int32, (3, 2), "nowrap", n) for j in range(n)]
            exp = np.sum([ys[j] for j in active], axis=0, dtype=np.int32)
            ck.array(fv.allreduce(ys[r], op=fv.Sum, name=f"join.{rnd}.i.{i}"), exp, f"round {rnd} step {i} Sum")
            h = fv.allreduce_async(ys[r], op=fv.Max, name=f"join.{rnd}.m.{i}")
            res = fv.synchronize(h)
            if len(active) < n:  # a joined rank's zeros take part in Max as well
                exp = np.maximum(np.max([ys[j] for j in active], axis=0), 0).astype(np.int32)
            else:
                exp = np.max(ys, axis=0)
            ck.array(res, exp, f"round {rnd} step {i} Max")
            # One response mixing sizes the engine treats differently (fused, reduced where it
            # lies, larger than the fusion buffer): a joined rank must run the same collectives,
            # in the same order, as the ranks that have the tensors.
            shapes = [(6,), (196_613,), (655_367,)]  # float64: 48 B, 1.5 MiB, 5 MiB
            gs = [[T.gen((10, rnd, i, q), j, np.float64, s) for j in range(n)]
                  for q, s in enumerate(shapes)]
            res = fv.grouped_allreduce([g[r] for g in gs], op=fv.Sum, name=f"join.{rnd}.g.{i}")
            for q, g in enumerate(gs):
                ck.array(res[q], np.sum([g[j] for j in active], axis=0),
                         f"round {rnd} step {i} grouped Sum, tensor {q} {shapes[q]}")
        if r == last:
            # Completes only once every other rank has joined (a joined rank reduces zeros):
            # this rank joins last.
            ck.array(fv.allreduce(np.full(3, r + 1.0), op=fv.Sum, name=f"join.{rnd}.last"),
                     np.full(3, r + 1.0), f"round {rnd} allreduce while every other rank is joined")
        t0 = time.monotonic()
        got = fv.join()
        print(f"round {rnd}: join() returned {got} after {time.monotonic() - t0:.3f} s", flush=True)
        ck.equal(got, last, f"round {rnd} join() return value")
        x = np.full(5, r + 1.0)
        ck.array(fv.allreduce(x, op=fv.Sum, name=f"after.join.{rnd}"), np.full(5, n * (n + 1) / 2),
                 f"round {rnd} allreduce after everyone joined")
    return ck.count


def case_joinerr():
    fv.init()
    r, n = fv.rank(), fv.size()
    ck = T.Checker(r)
    if r == 0:
        got = fv.join()
        ck.equal(got, n - 1, "join() return value")
    else:
        for what, fn in {
            "allgather": lambda: fv.allgather(np.ones((2, 2)), name="je.ag"),
            "broadcast": lambda: fv.broadcast(np.ones(2), 1, name="je.bc"),
            "alltoall": lambda: fv.alltoall(np.ones(2 * n), name="je.a2a"),
            "reducescatter": lambda: fv.reducescatter(np.ones(2 * n), name="je.rs"),
        }.items():
            ck.raises(fv.FerrovodError, fn, f"{what} while rank 0 is joined")
        ck.array(fv.allreduce(np.ones(3), op=fv.Sum, name="je.ar"), np.full(3, n - 1.0),
                 "allreduce while rank 0 is joined")
        if r == n - 1:
            # Completes only once every other rank has joined: this rank joins last.
            ck.array(fv.allreduce(np.ones(3), op=fv.Sum, name="je.last"), np.ones(3),
                     "allreduce while every other rank is joined")
        ck.equal(fv.join(), n - 1, "join() return value")
    ck.array(fv.allgather(np.full((1, 2), r)), np.repeat(np.arange(n), 2).reshape(n, 2), "allgather after join")
    return ck.count


def case_topology(n):
    fv.init()
    ck = T.Checker(fv.rank())
    check_topology(ck, int(n))
    print(f"TOPO rank={fv.rank()} size={fv.size()} local_rank={fv.local_rank()} local_size={fv.local_size()} "
          f"cross_rank={fv.cross_rank()} cross_size={fv.cross_size()} homogeneous={fv.is_homogeneous()}",
          flush=True)
    return ck.count


def case_cycles(count):
    """Many init/shutdown cycles in a row, each ending right after the ranks' last op (so
    that shutdowns overlap the coordinator's last answers): every one must be clean."""
    ck = T.Checker(int(os.environ.get("FERROVOD_RANK", "-1")))
    for cycle in range(int(count)):
        fv.init()
        n = fv.size()
        for i in range(50):
            got = fv.allreduce(np.full(2, fv.rank() + i, np.float32), op=fv.Sum, name=f"cy.{i}")
            ck.array(got, np.full(2, n * (n - 1) / 2 + n * i, np.float32), f"cycle {cycle} op {i}")
        fv.shutdown()
    return ck.count


def case_vanish():
    """Rank 0 ends its process the moment init returns, as a Ray actor is killed once its
    function returns: every other rank's init must still succeed (its own word that the job
    has formed is out before rank 0's is)."""
    fv.init()
    if fv.rank() == 0:
        os._exit(0)
    print("OK 1", flush=True)
    os._exit(0)


def main():
    case, args = sys.argv[1], sys.argv[2:]
    return {"single": case_single, "reinit": case_reinit, "join": case_join, "joinerr": case_joinerr,
            "topology": case_topology, "cycles": case_cycles, "vanish": case_vanish}[case](*args)


if __name__ == "__main__":
    T.run_main(main)
