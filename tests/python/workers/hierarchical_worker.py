"""A worker of a 2 hosts x 2 ranks job (hosts simulated as network namespaces) that checks
allreduce across hosts, run with and without hierarchical allreduce.

Checks, each against NumPy on every rank's input regenerated from seeds: several dtypes, ops
and sizes on both sides of the small-payload threshold (64 KiB), Average and scale factors
(applied by the engine around the algorithm); every rank's result bitwise equal to every
other's (gathered); the same in a process set with one member on the first host and two on
the second (the leader variant). Then ``BIG_ROUNDS`` allreduces of ``BIG_MIB`` MiB float32
between two barriers, and local rank 0 prints ``TX <bytes>``: what its host's ``eth0`` sent
meanwhile, which tells the algorithm apart (a flat ring sends 1.5x the payload out of each
host here, the hierarchical one 1.0x). Prints ``OK <checks>``.
"""

import numpy as np

from fvtest import (AVERAGE, BF16, MAX, MIN, PRODUCT, SUM, Checker, gen, input_mode, ref_reduce,
                    require_bf16, run_main)

import ferrovod as fv

BIG_MIB = 16
BIG_ROUNDS = 2
OPS = {SUM: fv.Sum, AVERAGE: fv.Average, MIN: fv.Min, MAX: fv.Max, PRODUCT: fv.Product}


def tx_bytes():
    with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
        return int(f.read())


def check_identical(ck, out, members, ps, what):
    """Every member's result has the same bytes."""
    raw = np.ascontiguousarray(out).view(np.uint8).reshape(1, -1)
    every = fv.allgather(raw, name=f"same.{what}", process_set=ps)
    ck.true(all(np.array_equal(every[0], row) for row in every[1:]), what,
            f"results differ bitwise between ranks {members}")


def check_allreduce(ck, ps, members, key, dt, op, size, pre=1.0, post=1.0):
    n = len(members)
    xs = [gen(key, q, dt, (size,), mode=input_mode(op, dt), n=n) for q in members]
    me = members.index(fv.rank())
    what = f"{np.dtype(dt).name} {op} {size} pre={pre} post={post} set={members}"
    out = fv.allreduce(xs[me], op=OPS[op], name=f"ar.{key}", prescale_factor=pre,
                       postscale_factor=post, process_set=ps)
    ck.array(out, ref_reduce(xs, op, dt, n, pre, post), what)
    check_identical(ck, out, members, ps, what)


def main():
    require_bf16()
    uneven = fv.ProcessSet([1, 2, 3])
    fv.init(process_sets=[uneven])
    ck = Checker(fv.rank())
    ck.equal((fv.size(), fv.local_size(), fv.cross_size()), (4, 2, 2), "placement")
    world = list(range(4))
    k = 0
    # Sizes: one element, odd, just below / above the 64 KiB threshold in float32, ~1.2 MB.
    for dt in (np.float32, np.float64, np.float16, BF16, np.int32, np.int64, np.uint8):
        for size in (1, 7, 16383, 16385, 300001):
            for op in (SUM, MIN, MAX, PRODUCT):
                if size == 300001 and op in (MIN, PRODUCT):
                    continue
                k += 1
                check_allreduce(ck, fv.global_process_set, world, (31, k), dt, op, size)
    for dt, size, pre, post in ((np.float32, 70001, 0.5, 3.0), (np.float64, 5, 2.0, 0.25),
                                (np.int32, 40000, 1.0, 1.0)):
        k += 1
        check_allreduce(ck, fv.global_process_set, world, (31, k), dt, AVERAGE, size, pre, post)
    if fv.rank() in uneven.ranks:
        for dt, op, size in ((np.float32, SUM, 3), (np.float32, SUM, 200001),
                             (np.int64, MAX, 70001), (np.float16, AVERAGE, 50001)):
            k += 1
            check_allreduce(ck, uneven, list(uneven.ranks), (32, k), dt, op, size)

    count = BIG_MIB * (1 << 20) // 4
    x = np.full(count, float(fv.rank() + 1), dtype=np.float32)
    fv.barrier()
    before = tx_bytes()
    for i in range(BIG_ROUNDS):
        out = fv.allreduce(x, op=fv.Sum, name=f"big.{i}")
    fv.barrier()
    sent = tx_bytes() - before
    ck.true(bool(np.all(out == 10.0)), "big allreduce", f"got {out[:4]}...")
    if fv.local_rank() == 0:
        print(f"TX {sent}", flush=True)
    fv.shutdown()
    return ck.count


run_main(main)
