"""Every collective against an independent NumPy reference, in one launch.

usage: ops_worker.py SEED [SECTION,SECTION,...]

Sections: allreduce, grouped, allgather, broadcast, alltoall, reducescatter, misc.
Every rank runs the same sequence of cases; each case's inputs for all ranks come from
``fvtest.gen((seed, case), rank, ...)``, so each rank computes the expected result itself.
"""

import sys
import time

import numpy as np

import fvtest as T
from fvtest import AVERAGE, MAX, MIN, PRODUCT, SUM

import ferrovod as fv

OPS = {SUM: fv.Sum, AVERAGE: fv.Average, MIN: fv.Min, MAX: fv.Max, PRODUCT: fv.Product}
SHAPES = [(), (0,), (1,), (7,), (1023,), (3, 5, 7), (2, 0, 3)]
BIG_BYTES = 3 * 1024 * 1024 + 40  # a few MiB, not a power of two
MODES = ["out", "inplace", "async", "async_inplace"]


class Ctx(T.Cases):
    def __init__(self, seed):
        super().__init__(seed, fv.rank(), fv.size())


def wait(h):
    deadline = time.monotonic() + 120
    while not fv.poll(h):
        if time.monotonic() > deadline:
            raise TimeoutError("poll() never became True")
        time.sleep(0.0002)
    return fv.synchronize(h)


def big_shape(dt):
    return (BIG_BYTES // np.dtype(dt).itemsize,)


# ---------------------------------------------------------------------------------------------
def do_allreduce(c, dt, shape, opn, mode, name=None, pre=1.0, post=1.0, vmode=None):
    k = c.key()
    xs = c.inputs(k, dt, shape, vmode or T.input_mode(opn, dt))
    exp = T.ref_reduce(xs, opn, dt, c.n, pre, post)
    x = xs[c.rank].copy()
    what = f"allreduce[{mode}] op={opn} dtype={np.dtype(dt)} shape={shape} pre={pre} post={post}"
    kw = dict(op=OPS[opn], name=name, prescale_factor=pre, postscale_factor=post)
    if mode == "out":
        res = fv.allreduce(x, **kw)
        c.ck.array(x, xs[c.rank], what + " (input must be left untouched)")
    elif mode == "inplace":
        res = fv.allreduce_(x, **kw)
        c.ck.true(res is x, what, "allreduce_ must return its argument")
    elif mode == "async":
        h = fv.allreduce_async(x, **kw)
        c.ck.true(isinstance(h, int), what, f"handle is {type(h).__name__}, not int")
        res = wait(h)
    else:
        h = fv.allreduce_async_(x, **kw)
        res = wait(h)
        c.ck.array(x, exp, what + " (in-place target)")
    c.ck.array(res, exp, what)
    if mode in ("out", "async") and x.nbytes >= 64 << 10:
        # A large result is the engine's (pooled pages): TensorFlow takes a host op's output
        # without a copy only when it is 64-byte aligned, which NumPy's large arrays are not.
        c.ck.true(res.ctypes.data % 64 == 0 and res.flags.writeable, what,
                  f"large result at {res.ctypes.data:#x} is not 64-byte aligned and writable")


def sec_allreduce(c):
    i = 0
    for dt in T.REDUCE_DTYPES:
        for opn in T.REDUCE_OPS:
            for shape in SHAPES:
                i += 1
                name = f"ar.{i}" if i % 2 else None  # half named, half automatic names
                do_allreduce(c, dt, shape, opn, MODES[i % 4], name=name)
        do_allreduce(c, dt, big_shape(dt), SUM, MODES[i % 4], name=f"ar.big.{dt}")
    for opn in T.REDUCE_OPS:
        do_allreduce(c, np.float32, big_shape(np.float32), opn, "out")
    # scale factors: floats with both ops, integers with Sum on small values (round toward zero)
    for dt in T.REDUCE_DTYPES:
        for shape in [(7,), (1023,), ()]:
            if T.is_float(dt):
                do_allreduce(c, dt, shape, SUM, "out", pre=0.5, post=3.0)
                do_allreduce(c, dt, shape, AVERAGE, "inplace", pre=2.0, post=0.25)
            else:
                do_allreduce(c, dt, shape, SUM, "out", pre=3.0, post=0.5, vmode="tiny")
                do_allreduce(c, dt, shape, SUM, "async", pre=1.0, post=0.5, vmode="tiny")
    # deprecated average= and the default op
    k = c.key()
    xs = c.inputs(k, np.float64, (5,))
    x = xs[c.rank]
    c.ck.array(fv.allreduce(x), T.ref_reduce(xs, AVERAGE, np.float64, c.n), "allreduce default op")
    c.ck.array(fv.allreduce(x, average=True), T.ref_reduce(xs, AVERAGE, np.float64, c.n), "average=True")
    c.ck.array(fv.allreduce(x, average=False), T.ref_reduce(xs, SUM, np.float64, c.n), "average=False")
    c.ck.raises(ValueError, lambda: fv.allreduce(x, average=True, op=fv.Sum), "average= and op= together")
    # Forms the one-call path of a plain array hands on to the general one: an op or average
    # as a NumPy scalar, a name that is not a string, scale factors as NumPy scalars.
    want = T.ref_reduce(xs, SUM, np.float64, c.n)
    c.ck.array(fv.allreduce(x, op=np.int64(fv.Sum), name=7, prescale_factor=np.float32(2.0)),
               2.0 * want, "op as np.int64, name 7, prescale as np.float32")
    c.ck.array(fv.allreduce_(x.copy(), average=np.bool_(False), name=8.5,
                             postscale_factor=np.float64(3.0)),
               3.0 * want, "in place, average as np.bool_, name 8.5, postscale as np.float64")
    c.ck.array(fv.allreduce_(x.copy(), op=np.int32(fv.Max)), T.ref_reduce(xs, MAX, np.float64, c.n),
               "in place, op as np.int32")
    sec_adasum(c)


def sec_adasum(c):
    """Adasum against NumPy's recurrence on power-of-two sets; refused on the others, and for
    integer tensors, with a message on every rank."""
    if c.n & (c.n - 1):
        x = np.ones(5)
        c.ck.raises((ValueError, fv.FerrovodError), lambda: fv.allreduce(x, op=fv.Adasum),
                    "Adasum on a set that is not a power of two", contains=("power-of-two",))
        return
    for dt in (np.float16, T.BF16, np.float32, np.float64):
        for shape in [(0,), (7,), (3, 5), (1023,)]:
            for pre, post in ((1.0, 1.0), (0.5, 3.0)):
                xs = c.inputs(c.key(), dt, shape)
                exp = T.ref_adasum(xs, dt, pre, post)
                got = fv.allreduce(xs[c.rank].copy(), op=fv.Adasum, prescale_factor=pre,
                                   postscale_factor=post)
                c.ck.array(got, exp, f"Adasum dtype={np.dtype(dt)} shape={shape} pre={pre} "
                           f"post={post}")
    # One dot product per tensor: a group is not reduced as one vector.
    xs = c.inputs(c.key(), np.float64, (6,))
    ys = c.inputs(c.key(), np.float64, (4, 2))
    got = fv.grouped_allreduce([xs[c.rank], ys[c.rank]], op=fv.Adasum)
    c.ck.array(got[0], T.ref_adasum(xs, np.float64), "grouped Adasum, first tensor")
    c.ck.array(got[1], T.ref_adasum(ys, np.float64), "grouped Adasum, second tensor")
    # What it interpolates: orthogonal gradients add, equal ones average.
    e = np.zeros(c.n * 2)
    e[c.rank * 2] = c.rank + 1.0
    want = np.zeros(c.n * 2)
    want[0::2] = np.arange(1.0, c.n + 1)
    c.ck.array(fv.allreduce(e, op=fv.Adasum), want, "Adasum of orthogonal vectors is their sum")
    same = np.linspace(-1.0, 2.0, 9)
    c.ck.array(fv.allreduce(same, op=fv.Adasum), same, "Adasum of equal vectors is their mean")
    c.ck.raises((ValueError, fv.FerrovodError),
                lambda: fv.allreduce(np.ones(3, np.int32), op=fv.Adasum),
                "Adasum of integers", contains=("floating-point",))


def sec_grouped(c):
    groups = [
        [(np.float32, (7,)), (np.float32, (3, 4)), (np.float32, ()), (np.float32, (0,))],
        [(np.int32, (5,)), (np.float64, (2, 2)), (np.float16, (9,)), (np.uint8, (1023,))],
    ]
    if T.BF16 is not None:
        groups[1].append((T.BF16, (6,)))
    for gi, group in enumerate(groups):
        for opn in T.REDUCE_OPS:
            for mode in MODES:
                ks = [c.key() for _ in group]
                xss = [c.inputs(k, dt, sh, T.input_mode(opn, dt)) for k, (dt, sh) in zip(ks, group)]
                exps = [T.ref_reduce(xs, opn, dt, c.n) for xs, (dt, _) in zip(xss, group)]
                mine = [xs[c.rank].copy() for xs in xss]
                what = f"grouped_allreduce[{mode}] group={gi} op={opn}"
                name = f"g.{gi}.{opn}.{mode}" if mode != "out" else None
                if mode == "out":
                    res = fv.grouped_allreduce(mine, op=OPS[opn], name=name)
                elif mode == "inplace":
                    res = fv.grouped_allreduce_(mine, op=OPS[opn], name=name)
                    c.ck.true(all(a is b for a, b in zip(res, mine)), what, "must return its arguments")
                elif mode == "async":
                    res = wait(fv.grouped_allreduce_async(mine, op=OPS[opn], name=name))
                else:
                    res = wait(fv.grouped_allreduce_async_(mine, op=OPS[opn], name=name))
                    for m, e, (dt, sh) in zip(mine, exps, group):
                        c.ck.array(m, e, f"{what} in-place target dtype={np.dtype(dt)} shape={sh}")
                c.ck.equal(len(res), len(group), what + " result count")
                for got, e, (dt, sh) in zip(res, exps, group):
                    c.ck.array(got, e, f"{what} dtype={np.dtype(dt)} shape={sh}")
    # grouped with scale factors
    ks = [c.key(), c.key()]
    xss = [c.inputs(ks[0], np.float32, (11,)), c.inputs(ks[1], np.float64, (3,))]
    res = fv.grouped_allreduce([xss[0][c.rank], xss[1][c.rank]], op=fv.Sum, prescale_factor=2.0,
                               postscale_factor=0.5)
    for got, xs, dt in zip(res, xss, (np.float32, np.float64)):
        c.ck.array(got, T.ref_reduce(xs, SUM, dt, c.n, 2.0, 0.5), "grouped_allreduce scaled")


# ---------------------------------------------------------------------------------------------
def rows_for(c, k, force_zero):
    rows = list(T.rng_for(*k, 777).integers(0, 5, size=c.n))
    if force_zero is not None:
        rows[force_zero % c.n] = 0
    return rows


def do_allgather(c, dt, trailing, rows, mode):
    k = c.key()
    xs = [T.gen(k, j, dt, (rows[j],) + tuple(trailing)) for j in range(c.n)]
    exp = np.concatenate(xs, axis=0)
    what = f"allgather[{mode}] dtype={np.dtype(dt)} rows={rows} trailing={trailing}"
    if mode == "async":
        res = wait(fv.allgather_async(xs[c.rank]))
    else:
        res = fv.allgather(xs[c.rank], name=f"ag.{c.case}" if c.case % 2 else None)
    c.ck.array(res, exp, what)


def sec_allgather(c):
    i = 0
    for dt in T.ALL_DTYPES:
        for trailing in [(), (3,), (2, 3), (0, 2)]:
            for fz in (None, i, "all"):
                i += 1
                k = (c.seed, 5000 + i)
                rows = [0] * c.n if fz == "all" else rows_for(c, k, fz)
                do_allgather(c, dt, trailing, rows, "async" if i % 3 == 0 else "sync")
    big = [(BIG_BYTES // 4) // 16 + j for j in range(c.n)]
    do_allgather(c, np.float32, (16,), big, "sync")
    # grouped
    for mode in ("sync", "async"):
        spec = [(np.float32, (3,)), (np.int16, ()), (np.bool_, (2, 2)), (np.float64, (0,))]
        ks = [c.key() for _ in spec]
        rowss = [rows_for(c, k, j) for j, k in enumerate(ks)]
        xss = [[T.gen(k, j, dt, (rows[j],) + tr) for j in range(c.n)]
               for k, rows, (dt, tr) in zip(ks, rowss, spec)]
        mine = [xs[c.rank] for xs in xss]
        if mode == "sync":
            res = fv.grouped_allgather(mine)
        else:
            res = wait(fv.grouped_allgather_async(mine, name="gag.async"))
        c.ck.equal(len(res), len(spec), "grouped_allgather result count")
        for got, xs, (dt, tr) in zip(res, xss, spec):
            c.ck.array(got, np.concatenate(xs), f"grouped_allgather[{mode}] dtype={np.dtype(dt)} trailing={tr}")


# ---------------------------------------------------------------------------------------------
def sec_broadcast(c):
    i = 0
    for dt in T.ALL_DTYPES:
        for shape in [(), (0,), (7,), (3, 4), big_shape(dt) if dt == np.float32 else (1023,)]:
            for root in range(c.n):
                i += 1
                mode = MODES[i % 4]
                k = c.key()
                xs = c.inputs(k, dt, shape)
                x = xs[c.rank].copy()
                exp = xs[root]
                what = f"broadcast[{mode}] root={root} dtype={np.dtype(dt)} shape={shape}"
                name = f"bc.{i}" if i % 2 else None
                if mode == "out":
                    res = fv.broadcast(x, root, name=name)
                    c.ck.array(x, xs[c.rank], what + " (input must be left untouched)")
                elif mode == "inplace":
                    res = fv.broadcast_(x, root_rank=root, name=name)
                    c.ck.true(res is x, what, "broadcast_ must return its argument")
                elif mode == "async":
                    res = wait(fv.broadcast_async(x, root, name=name))
                else:
                    res = wait(fv.broadcast_async_(x, root, name=name))
                    c.ck.array(x, exp, what + " (in-place target)")
                c.ck.array(res, exp, what)


# ---------------------------------------------------------------------------------------------
def sec_alltoall(c):
    n, r = c.n, c.rank
    for dt in T.ALL_DTYPES:
        for trailing in [(), (3,)]:
            # default equal split, including zero rows per destination
            for per in (2, 0):
                k = c.key()
                xs = c.inputs(k, dt, (n * per,) + trailing)
                exp = np.concatenate([xs[j][r * per:(r + 1) * per] for j in range(n)])
                res = fv.alltoall(xs[r])
                c.ck.array(res, exp, f"alltoall equal split per={per} dtype={np.dtype(dt)} trailing={trailing}")
            # explicit splits with zeros; list and int32-array forms
            for form in ("list", "array"):
                k = c.key()
                splits = [list(T.rng_for(*k, 99, j).integers(0, 4, size=n)) for j in range(n)]
                for j in range(n):
                    splits[j][(j + k[1]) % n] = 0
                xs = [T.gen(k, j, dt, (sum(splits[j]),) + trailing) for j in range(n)]
                offs = [np.concatenate([[0], np.cumsum(s)]).astype(int) for s in splits]
                exp = np.concatenate([xs[j][offs[j][r]:offs[j][r] + splits[j][r]] for j in range(n)])
                exp_recv = [int(splits[j][r]) for j in range(n)]
                arg = [int(s) for s in splits[r]] if form == "list" else np.array(splits[r], dtype=np.int32)
                what = f"alltoall splits={splits} form={form} dtype={np.dtype(dt)} trailing={trailing}"
                out = fv.alltoall(xs[r], splits=arg, name=f"a2a.{c.case}")
                c.ck.true(isinstance(out, tuple) and len(out) == 2, what, f"returned {type(out).__name__}")
                res, recv = out
                c.ck.array(res, exp, what)
                c.ck.equal([int(v) for v in np.asarray(recv).ravel()], exp_recv, what + " received_splits")
    # async, with and without splits
    k = c.key()
    xs = c.inputs(k, np.float64, (n * 3, 2))
    res = wait(fv.alltoall_async(xs[r], name="a2a.async"))
    if isinstance(res, tuple):
        res = res[0]
    c.ck.array(res, np.concatenate([xs[j][r * 3:(r + 1) * 3] for j in range(n)]), "alltoall_async")
    k = c.key()
    splits = [[(i + j) % 3 for i in range(n)] for j in range(n)]
    xs = [T.gen(k, j, np.int32, (sum(splits[j]),)) for j in range(n)]
    offs = [np.concatenate([[0], np.cumsum(s)]).astype(int) for s in splits]
    exp = np.concatenate([xs[j][offs[j][r]:offs[j][r] + splits[j][r]] for j in range(n)])
    res = wait(fv.alltoall_async(xs[r], splits=splits[r], name="a2a.async.splits"))
    if isinstance(res, tuple):
        c.ck.equal([int(v) for v in np.asarray(res[1]).ravel()], [splits[j][r] for j in range(n)],
                   "alltoall_async received_splits")
        res = res[0]
    c.ck.array(res, exp, "alltoall_async with splits")


# ---------------------------------------------------------------------------------------------
def do_reducescatter(c, dt, shape, opn, mode, pre=1.0, post=1.0, vmode=None):
    k = c.key()
    xs = c.inputs(k, dt, shape, vmode or T.input_mode(opn, dt))
    full = T.ref_reduce(xs, opn, dt, c.n, pre, post)
    start, cnt = T.split_rows(shape[0], c.n)[c.rank]
    exp = full[start:start + cnt]
    what = f"reducescatter[{mode}] op={opn} dtype={np.dtype(dt)} shape={shape} pre={pre} post={post}"
    kw = dict(op=OPS[opn], prescale_factor=pre, postscale_factor=post)
    if mode == "async":
        res = wait(fv.reducescatter_async(xs[c.rank], name=f"rs.{c.case}", **kw))
    else:
        res = fv.reducescatter(xs[c.rank], **kw)
    c.ck.array(res, exp, what)


def sec_reducescatter(c):
    n = c.n
    i = 0
    shapes = [(2 * n + 1,), (3 * n, 2), (n + n // 2 + 1, 3, 2), (1,), (2,), (0,), (0, 4)]
    for dt in T.REDUCE_DTYPES:
        for opn in (SUM, AVERAGE):
            for shape in shapes:
                i += 1
                do_reducescatter(c, dt, shape, opn, "async" if i % 3 == 0 else "sync")
        if T.is_float(dt):
            do_reducescatter(c, dt, (2 * n + 1, 2), AVERAGE, "sync", pre=2.0, post=0.5)
        else:
            do_reducescatter(c, dt, (2 * n + 1, 2), SUM, "sync", pre=3.0, post=0.5, vmode="tiny")
    do_reducescatter(c, np.float32, (BIG_BYTES // 4 // 64 + 1, 64), SUM, "sync")
    c.ck.raises(ValueError, lambda: fv.reducescatter(np.ones(4, np.float32), op=fv.Min), "reducescatter Min")
    # grouped
    for mode in ("sync", "async"):
        for opn in (SUM, AVERAGE):
            spec = [(np.float32, (2 * n + 1,)), (np.int32, (n, 3)), (np.float64, (1, 2))]
            ks = [c.key() for _ in spec]
            xss = [c.inputs(k, dt, sh, T.input_mode(opn, dt)) for k, (dt, sh) in zip(ks, spec)]
            mine = [xs[c.rank] for xs in xss]
            if mode == "sync":
                res = fv.grouped_reducescatter(mine, op=OPS[opn])
            else:
                res = wait(fv.grouped_reducescatter_async(mine, op=OPS[opn], name=f"grs.{opn}"))
            c.ck.equal(len(res), len(spec), "grouped_reducescatter result count")
            for got, xs, (dt, sh) in zip(res, xss, spec):
                start, cnt = T.split_rows(sh[0], n)[c.rank]
                exp = T.ref_reduce(xs, opn, dt, n)[start:start + cnt]
                c.ck.array(got, exp, f"grouped_reducescatter[{mode}] op={opn} dtype={np.dtype(dt)} shape={sh}")


# ---------------------------------------------------------------------------------------------
def sec_misc(c):
    n, r, ck = c.n, c.rank, c.ck
    # barrier: nobody leaves before the last one arrived (all ranks share one clock: one host)
    time.sleep(0.15 * r)
    arrived = time.time()
    fv.barrier()
    left = time.time()
    times = fv.allgather_object((arrived, left))
    ck.equal(len(times), n, "allgather_object length")
    latest_arrival = max(a for a, _ in times)
    ck.true(all(lv >= latest_arrival for _, lv in times), "barrier",
            f"a rank left before the last one arrived: {times}")
    # objects, including a closure only cloudpickle can carry
    for root in range(n):
        obj = {"root": root, "arr": np.arange(root + 3), "fn": (lambda v, _root=root: v * 10 + _root)}
        got = fv.broadcast_object(obj if r == root else None, root_rank=root)
        ck.equal(got["root"], root, "broadcast_object root")
        ck.array(got["arr"], np.arange(root + 3), "broadcast_object array")
        ck.equal(got["fn"](4), 40 + root, "broadcast_object closure")
    got = fv.broadcast_object(("default root", r))
    ck.equal(got, ("default root", 0), "broadcast_object default root")
    objs = fv.allgather_object({"r": r, "data": list(range(r))}, name="ago")
    ck.equal(objs, [{"r": j, "data": list(range(j))} for j in range(n)], "allgather_object")

    # DLPack-only inputs
    k = c.key()
    xs = c.inputs(k, np.float32, (4, 5))
    res = fv.allreduce(T.DLPackOnly(xs[r].copy()), op=fv.Sum)
    ck.array(res, T.ref_reduce(xs, SUM, np.float32, n), "allreduce of a DLPack-only object")
    res = fv.allgather(T.DLPackOnly(xs[r]))
    ck.array(res, np.concatenate(xs), "allgather of a DLPack-only object")
    res = fv.broadcast(T.DLPackOnly(xs[r]), n - 1)
    ck.array(res, xs[n - 1], "broadcast of a DLPack-only object")
    x = xs[r].copy()
    wrapped = T.DLPackOnly(x)
    out = fv.allreduce_(wrapped, op=fv.Max)
    ck.true(out is wrapped, "allreduce_ of a DLPack-only object", "must return its argument")
    ck.array(x, T.ref_reduce(xs, MAX, np.float32, n), "allreduce_ of a DLPack-only object writes in place")
    ck.array(np.from_dlpack(out), T.ref_reduce(xs, MAX, np.float32, n), "allreduce_ DLPack result")

    # non-contiguous inputs
    k = c.key()
    bases = c.inputs(k, np.float64, (8, 6))
    views = [b[::2, 1::2] for b in bases]
    ck.true(not views[r].flags.c_contiguous, "setup", "view should be non-contiguous")
    ck.array(fv.allreduce(views[r], op=fv.Sum), T.ref_reduce([v.copy() for v in views], SUM, np.float64, n),
             "allreduce of a strided view")
    ck.array(fv.allreduce(bases[r].T, op=fv.Sum), T.ref_reduce([b.T.copy() for b in bases], SUM, np.float64, n),
             "allreduce of a transposed array")
    # byte-swapped arrays are reduced by value, not by their raw bytes
    other = ">" if np.little_endian else "<"
    swapped = [b.astype(b.dtype.newbyteorder(other)) for b in bases]
    ck.true(not swapped[r].dtype.isnative, "setup", "array should be byte-swapped")
    ref = T.ref_reduce([b.copy() for b in bases], SUM, np.float64, n)
    ck.array(fv.allreduce(swapped[r], op=fv.Sum), ref, "allreduce of a byte-swapped array")
    y = swapped[r].copy()
    ck.true(fv.allreduce_(y, op=fv.Sum) is y, "allreduce_ of a byte-swapped array", "must return its argument")
    ck.array(y.astype(np.float64), ref, "allreduce_ of a byte-swapped array writes in place")
    ck.array(fv.allgather(bases[r][:, ::3]), np.concatenate([b[:, ::3] for b in bases]), "allgather of a view")
    ck.array(fv.broadcast(bases[r].T, 0), bases[0].T.copy(), "broadcast of a transposed array")
    k = c.key()
    tall = c.inputs(k, np.int32, (4 * n, 6))
    views = [t[::2, ::2] for t in tall]  # 2n rows, 2 per destination
    ck.array(fv.alltoall(views[r]), np.concatenate([views[j][2 * r:2 * r + 2] for j in range(n)]),
             "alltoall of a view")

    # unnamed async ops match by call order, whatever the order they are waited on
    ks = [c.key() for _ in range(6)]
    shapes = [(i + 1, 2) for i in range(6)]
    xss = [c.inputs(k, np.float32, s) for k, s in zip(ks, shapes)]
    hs = [fv.allreduce_async(xs[r], op=fv.Sum) for xs in xss]
    for i in reversed(range(6)):
        ck.array(fv.synchronize(hs[i]), T.ref_reduce(xss[i], SUM, np.float32, n), f"unnamed async #{i}")

    # named ops of every kind, submitted in a different order on each rank
    cases = []
    for i in range(16):
        k = c.key()
        kind = ["allreduce", "allgather", "broadcast", "alltoall", "reducescatter"][i % 5]
        dt = [np.float32, np.int64, np.float16, np.uint8][i % 4]
        if kind == "allgather":
            xs = [T.gen(k, j, dt, (j + i % 3, 2)) for j in range(n)]
            exp = np.concatenate(xs)
        elif kind == "alltoall":
            xs = c.inputs(k, dt, (n * 2, 3))
            exp = np.concatenate([xs[j][r * 2:(r + 1) * 2] for j in range(n)])
        elif kind == "broadcast":
            xs = c.inputs(k, dt, (5,))
            exp = xs[i % n]
        else:
            xs = c.inputs(k, dt, (2 * n + 1,), T.input_mode(SUM, dt))
            exp = T.ref_reduce(xs, SUM, dt, n)
            if kind == "reducescatter":
                s, cnt = T.split_rows(2 * n + 1, n)[r]
                exp = exp[s:s + cnt]
        cases.append((f"perm.{i}.{kind}", kind, xs[r], exp, i % n))
    order = list(T.rng_for(c.seed, 4242, r).permutation(len(cases)))
    handles = {}
    for i in order:
        name, kind, x, _, root = cases[i]
        if kind == "allreduce":
            handles[i] = fv.allreduce_async(x, op=fv.Sum, name=name)
        elif kind == "allgather":
            handles[i] = fv.allgather_async(x, name=name)
        elif kind == "broadcast":
            handles[i] = fv.broadcast_async(x, root, name=name)
        elif kind == "alltoall":
            handles[i] = fv.alltoall_async(x, name=name)
        else:
            handles[i] = fv.reducescatter_async(x, op=fv.Sum, name=name)
    for i in reversed(order):
        res = fv.synchronize(handles[i])
        if isinstance(res, tuple):
            res = res[0]
        ck.array(res, cases[i][3], f"permuted async {cases[i][0]}")

    # poll() never blocks: rank 0 polls its op before any other rank has submitted it (they
    # wait for rank 0's broadcast, sent after the poll), so a poll that waited for the op to
    # complete would never return, and one that returned must say "not done".
    x = np.full(3, r + 1, np.float32)
    polled = np.zeros(1, np.int32)
    if r == 0:
        h = fv.allreduce_async(x, op=fv.Sum, name="late")
        done = fv.poll(h)
        if n > 1:
            ck.true(not done, "poll", "op finished although peers had not submitted it")
        fv.broadcast(polled, 0, name="late_polled")
    else:
        fv.broadcast(polled, 0, name="late_polled")
        h = fv.allreduce_async(x, op=fv.Sum, name="late")
    ck.array(fv.synchronize(h), np.full(3, n * (n + 1) / 2, np.float32), "late allreduce")


SECTIONS = {
    "allreduce": sec_allreduce,
    "grouped": sec_grouped,
    "allgather": sec_allgather,
    "broadcast": sec_broadcast,
    "alltoall": sec_alltoall,
    "reducescatter": sec_reducescatter,
    "misc": sec_misc,
}


def main():
    T.require_bf16()
    seed = int(sys.argv[1])
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SECTIONS)
    fv.init()
    c = Ctx(seed)
    for s in names:
        t0 = time.monotonic()
        SECTIONS[s](c)
        print(f"section {s}: {time.monotonic() - t0:.2f} s, {c.ck.count} checks so far", flush=True)
    return c.ck.count


if __name__ == "__main__":
    T.run_main(main)
