"""Thousands of random ops in one job, each checked against NumPy.

usage: stress_worker.py SEED N_OPS

The plan (which op, dtype, size, reduce op, how it is issued) comes from SEED and is the same
on every rank; the order in which async batches are submitted and waited on comes from a
rank-specific generator. A quarter of the batches repeat a fixed set of names with fixed
shapes, as a training step does, so the repeated-name (cached) path is exercised too.
"""

import os
import sys
import time

import numpy as np

import fvtest as T
from fvtest import AVERAGE, MAX, MIN, PRODUCT, SUM

import ferrovod as fv

OPS = {SUM: fv.Sum, AVERAGE: fv.Average, MIN: fv.Min, MAX: fv.Max, PRODUCT: fv.Product}
KINDS = ["allreduce"] * 5 + ["allgather", "broadcast", "alltoall", "reducescatter"]


class Op:
    """One planned collective: everything needed to issue it and to know its answer."""

    def __init__(self, seed, idx, rng, n, name=None, spec=None):
        self.key = (seed, idx)
        if spec is None:
            kind = KINDS[rng.integers(len(KINDS))]
            dtypes = T.ALL_DTYPES if kind in ("allgather", "broadcast", "alltoall") else T.REDUCE_DTYPES
            dt = dtypes[rng.integers(len(dtypes))]
            if rng.random() < 0.01:
                size = int(rng.integers(200_000, 1_000_000))
            else:
                size = int(10 ** rng.uniform(0, 5)) - 1  # 0 .. ~100k, mostly small
            if kind == "reducescatter":
                opn = [SUM, AVERAGE][rng.integers(2)]
            else:
                opn = T.REDUCE_OPS[rng.integers(5)]
            spec = (kind, dt, size, opn, int(rng.integers(n)))
        self.kind, self.dt, self.size, self.opn, self.root = spec
        self.spec = spec
        self.name = name
        self.n = n

    def inputs(self, r):
        k, n, dt = self.key, self.n, self.dt
        if self.kind == "allgather":
            rows = [int(T.rng_for(*k, 500 + j).integers(0, max(1, self.size // 4) + 1)) for j in range(n)]
            return T.gen(k, r, dt, (rows[r], 2)), [T.gen(k, j, dt, (rows[j], 2)) for j in range(n)]
        if self.kind == "alltoall":
            per = self.size // (4 * n)
            xs = [T.gen(k, j, dt, (n * per, 4)) for j in range(n)]
            return xs[r], xs
        mode = T.input_mode(self.opn, dt) if self.kind != "broadcast" else "normal"
        xs = [T.gen(k, j, dt, (self.size,), mode, n) for j in range(n)]
        return xs[r], xs

    def submit(self, x, r):
        kw = {"name": self.name}
        if self.kind == "allreduce":
            return fv.allreduce_async(x, op=OPS[self.opn], **kw)
        if self.kind == "allgather":
            return fv.allgather_async(x, **kw)
        if self.kind == "broadcast":
            return fv.broadcast_async(x, self.root, **kw)
        if self.kind == "alltoall":
            return fv.alltoall_async(x, **kw)
        return fv.reducescatter_async(x, op=OPS[self.opn], **kw)

    def run_sync(self, x):
        kw = {"name": self.name}
        if self.kind == "allreduce":
            return fv.allreduce(x, op=OPS[self.opn], **kw)
        if self.kind == "allgather":
            return fv.allgather(x, **kw)
        if self.kind == "broadcast":
            return fv.broadcast(x, self.root, **kw)
        if self.kind == "alltoall":
            return fv.alltoall(x, **kw)
        return fv.reducescatter(x, op=OPS[self.opn], **kw)

    def expected(self, xs, r):
        n = self.n
        if self.kind == "allreduce":
            return T.ref_reduce(xs, self.opn, self.dt, n)
        if self.kind == "allgather":
            return np.concatenate(xs)
        if self.kind == "broadcast":
            return xs[self.root]
        if self.kind == "alltoall":
            per = xs[0].shape[0] // n
            return np.concatenate([x[r * per:(r + 1) * per] for x in xs])
        start, cnt = T.split_rows(self.size, n)[r]
        return T.ref_reduce(xs, self.opn, self.dt, n)[start:start + cnt]

    def describe(self):
        return f"{self.kind} name={self.name} dtype={np.dtype(self.dt)} size={self.size} op={self.opn} root={self.root}"


def main():
    T.require_bf16()
    seed, n_ops = int(sys.argv[1]), int(sys.argv[2])
    fv.init()
    r, n = fv.rank(), fv.size()
    ck = T.Checker(r)
    plan_rng = T.rng_for(seed, 1)
    order_rng = T.rng_for(seed, 2, r)  # differs per rank
    step_specs = [Op(seed, -1 - i, plan_rng, n).spec for i in range(12)]
    step_specs = [(k, dt, min(s, 20000), o, rt) for k, dt, s, o, rt in step_specs]
    counts = dict.fromkeys(["sync", "async", "grouped", "step"], 0)
    idx = 0
    t0 = time.monotonic()
    while idx < n_ops:
        u = plan_rng.random()
        if u < 0.6:  # one synchronous op, named or not
            idx += 1
            op = Op(seed, idx, plan_rng, n, name=f"sync.{idx}" if plan_rng.random() < 0.5 else None)
            x, xs = op.inputs(r)
            ck.array(op.run_sync(x), op.expected(xs, r), op.describe())
            counts["sync"] += 1
            continue
        if u < 0.7:  # a grouped allreduce / allgather / reducescatter
            kind = ["allreduce", "allgather", "reducescatter"][plan_rng.integers(3)]
            k = int(plan_rng.integers(2, 6))
            opn = [SUM, AVERAGE][plan_rng.integers(2)]
            ops = []
            for _ in range(k):
                idx += 1
                o = Op(seed, idx, plan_rng, n)
                spec = (kind, o.dt if kind == "allgather" else T.REDUCE_DTYPES[plan_rng.integers(len(T.REDUCE_DTYPES))],
                        min(o.size, 30000), opn, 0)
                ops.append(Op(seed, idx, plan_rng, n, spec=spec))
            ins = [o.inputs(r) for o in ops]
            mine = [x for x, _ in ins]
            name = f"grp.{idx}"
            if kind == "allreduce":
                res = fv.grouped_allreduce(mine, op=OPS[opn], name=name)
            elif kind == "allgather":
                res = fv.grouped_allgather(mine, name=name)
            else:
                res = fv.grouped_reducescatter(mine, op=OPS[opn], name=name)
            ck.equal(len(res), len(ops), f"grouped {kind} result count")
            for o, got, (_, xs) in zip(ops, res, ins):
                ck.array(got, o.expected(xs, r), "grouped " + o.describe())
            counts["grouped"] += len(ops)
            continue
        if u < 0.85:  # a "training step": fixed names and shapes, fresh data
            step = idx
            ops = []
            for i, spec in enumerate(step_specs):
                idx += 1
                ops.append(Op(seed, idx, plan_rng, n, name=f"step.param.{i}", spec=spec))
            kind = "step"
        else:  # a batch of unrelated async ops with unique names
            ops = []
            for _ in range(int(plan_rng.integers(2, 16))):
                idx += 1
                ops.append(Op(seed, idx, plan_rng, n, name=f"async.{idx}"))
            kind = "async"
            step = idx
        ins = [o.inputs(r) for o in ops]
        handles = {}
        for i in order_rng.permutation(len(ops)):
            handles[i] = ops[i].submit(ins[i][0], r)
        for i in order_rng.permutation(len(ops)):
            res = fv.synchronize(handles[i])
            if isinstance(res, tuple):
                res = res[0]
            ck.array(res, ops[i].expected(ins[i][1], r), f"{kind} batch at {step}: " + ops[i].describe())
        counts[kind] += len(ops)
    elapsed = time.monotonic() - t0
    print(f"STRESS ops={idx} sync={counts['sync']} async={counts['async']} step={counts['step']} "
          f"grouped={counts['grouped']} elapsed={elapsed:.2f}s", flush=True)
    # every rank ran the same plan
    plans = fv.allgather_object((idx, counts))
    ck.true(all(p == plans[0] for p in plans), "plan", f"ranks ran different plans: {plans}")
    # ferrovod's shared-memory segments are unnamed memfds (never in /dev/shm): this process's
    # maps and descriptors are where they show, and shutdown() must release every one.
    held = segments()
    if os.environ.get("FERROVOD_SHM_DISABLE") == "1":
        ck.equal(held, 0, "no ferrovod memfd with shared memory disabled")
    else:
        ck.true(held > 0, "segments seen while running", "no ferrovod memfd mapped: the leak "
                "check below could not see a leak")
    fv.shutdown()
    ck.equal(segments(), 0, f"ferrovod memfds left after shutdown (held {held} while running)")
    return ck.count


def segments():
    """ferrovod's memfd segments this process maps or holds open."""
    tag = "memfd:ferrovod-shm"
    maps = sum(1 for line in open("/proc/self/maps") if tag in line)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += tag in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return maps + fds


if __name__ == "__main__":
    T.run_main(main)
