"""The fast path of blocking allreduces (ranks agree through shared memory, no coordinator),
checked against NumPy and against the engine's own counts of what took it.

usage: fast_path_worker.py SEED SECTION[,SECTION...]

Sections:
  reduce    every dtype x op x shape class, in place and not, scale factors, both sides of the
            size limit: every result against the NumPy reference, and every op that should
            take the fast path did (no offer went to the engine: all ranks ran in lock-step)
  orders    ranks submit in different orders, mixing async ops with blocking ones, so that
            offers meet declines; every result checked, and the fast path works again after
  mismatch  ranks offer one name with different shapes: the error names the tensor on every
            rank, and the next op is fast again
  threads   two threads per rank submit blocking ops concurrently (their slots interleave
            differently on each rank)
  join      a rank joins: the fast path is off for the rest of the job, results stay right
  broadcast blocking broadcasts from every root, every dtype (bool included), in place and
            not, both sides of the size limit, against the root's tensor
  allgather blocking allgathers with a different first dimension on every rank (zero rows
            included), every dtype, against NumPy's concatenation; allgather_object
  torch     ferrovod.torch's blocking allreduce (and its autograd form) of CPU tensors of
            several dtypes, bfloat16 included, against NumPy, all on the fast path
  scatter   blocking reducescatters (Sum and Average, scale factors, first dimensions that
            do not divide, zero rows) and evenly split alltoalls (every dtype), NumPy and
            torch, against NumPy; each on the fast path, and one over the size limit not
"""

import sys
import threading

import numpy as np

import fvtest as T
from fvtest import AVERAGE, MAX, MIN, PRODUCT, SUM

import ferrovod as fv
from ferrovod import _core

OPS = {SUM: fv.Sum, AVERAGE: fv.Average, MIN: fv.Min, MAX: fv.Max, PRODUCT: fv.Product}
SHAPES = [(), (0,), (1,), (7,), (3, 5, 7), (1023,)]
LIMIT = 64 * 1024


class Ctx(T.Cases):
    def __init__(self, seed):
        super().__init__(seed, fv.rank(), fv.size())

    def stats(self):
        return _core.fast_path_stats()

    def fast_ops_in_one_more(self, name, dt, shape):
        """One more blocking allreduce, checked against NumPy; how many ops took the fast path
        meanwhile (0 or 1)."""
        before = self.stats()
        xs = self.inputs(self.key(), dt, shape)
        got = fv.allreduce(xs[self.rank], name=name, op=fv.Sum)
        self.ck.array(got, T.ref_reduce(xs, SUM, dt, self.n), f"allreduce {name}")
        return self.stats()[0] - before[0]


def reduce_section(c):
    before = c.stats()
    fast = 0
    for dt in T.REDUCE_DTYPES:
        for opname, op in OPS.items():
            for shape in SHAPES:
                for inplace in (False, True):
                    key = c.key()
                    xs = c.inputs(key, dt, shape, T.input_mode(opname, dt))
                    exp = T.ref_reduce(xs, opname, dt, c.n)
                    what = f"allreduce {opname} {dt} {shape} inplace={inplace}"
                    name = f"fp.{dt}.{opname}.{len(shape)}.{inplace}"
                    if inplace:
                        x = xs[c.rank].copy()
                        got = fv.allreduce_(x, name=name, op=op)
                        c.ck.true(got is x, what, "in-place result is not the input")
                    else:
                        got = fv.allreduce(xs[c.rank], name=name, op=op)
                    c.ck.array(got, exp, what)
                    fast += 1
    # Scale factors: float sum with pre/post factors, integers with small inputs.
    for dt in (np.dtype("float32"), np.dtype("float64"), np.dtype("int32"), T.BF16):
        key = c.key()
        mode = "tiny" if not T.is_float(dt) else "normal"
        xs = c.inputs(key, dt, (5, 3), mode)
        exp = T.ref_reduce(xs, SUM, dt, c.n, pre=2.0, post=0.5)
        got = fv.allreduce(xs[c.rank], name=f"fp.scaled.{dt}", op=fv.Sum,
                           prescale_factor=2.0, postscale_factor=0.5)
        c.ck.array(got, exp, f"scaled allreduce {dt}")
        fast += 1
    # The size limit: exactly LIMIT bytes is fast, one element more goes through the engine.
    for count, is_fast in ((LIMIT // 4, True), (LIMIT // 4 + 1, False), (LIMIT // 4 - 3, True)):
        key = c.key()
        xs = c.inputs(key, "float32", (count,))
        got = fv.allreduce(xs[c.rank], name=f"fp.limit.{count}", op=fv.Sum)
        c.ck.array(got, T.ref_reduce(xs, SUM, "float32", c.n), f"allreduce of {count} float32")
        fast += is_fast
    # Repeating one name many times (the benchmark's pattern): every call is fast.
    x = np.arange(5, dtype=np.float64) + c.rank
    for i in range(2000):
        got = fv.allreduce(x, name="fp.repeat", op=fv.Sum)
        fast += 1
    exp = sum(np.arange(5, dtype=np.float64) + r for r in range(c.n))
    c.ck.array(got, exp, "repeated allreduce")
    after = c.stats()
    c.ck.equal(after[0] - before[0], fast, "ops reduced on the fast path")
    c.ck.equal(after[1] - before[1], 0, "offers that went to the engine")


def orders_section(c):
    before = c.stats()

    def check(name, got, key, dt="float32", shape=(6,)):
        xs = c.inputs(key, dt, shape)
        c.ck.array(got, T.ref_reduce(xs, SUM, dt, c.n), f"{name} (orders)")

    def mine(key, dt="float32", shape=(6,)):
        return c.inputs(key, dt, shape)[c.rank]

    for rnd in range(20):
        ka, kb, kc = c.key(), c.key(), c.key()
        a, b, cc = f"ord.a.{rnd}", f"ord.b.{rnd}", f"ord.c.{rnd}"
        if c.rank % 2 == 0:
            # async a, then blocking b while a is pending, then blocking c
            h = fv.allreduce_async(mine(ka), name=a, op=fv.Sum)
            check(b, fv.allreduce(mine(kb), name=b, op=fv.Sum), kb)
            check(a, fv.synchronize(h), ka)
            check(cc, fv.allreduce(mine(kc), name=cc, op=fv.Sum), kc)
        else:
            # blocking b first (its offer meets the other ranks' async a), then a, then c
            hb = None
            if rnd % 2:
                check(b, fv.allreduce(mine(kb), name=b, op=fv.Sum), kb)
            else:
                hb = fv.allreduce_async(mine(kb), name=b, op=fv.Sum)
            check(a, fv.allreduce(mine(ka), name=a, op=fv.Sum), ka)
            if hb is not None:
                check(b, fv.synchronize(hb), kb)
            check(cc, fv.allreduce(mine(kc), name=cc, op=fv.Sum), kc)
    # In lock-step again: the next op is fast on every rank.
    mid = c.stats()
    key = c.key()
    check("ord.after", fv.allreduce(mine(key), name="ord.after", op=fv.Sum), key)
    after = c.stats()
    c.ck.equal(after[0] - mid[0], 1, "fast ops after the mixed orders")
    met = fv.allreduce(np.array([mid[1] - before[1]], np.int64), name="ord.met", op=fv.Sum)[0]
    c.ck.true(met > 0, "mixed orders",
              "no offer met a decline on any rank: the section did not exercise the fallback")


def mismatch_section(c):
    shape = (3 + c.rank,)
    c.ck.raises(Exception, lambda: fv.allreduce(np.ones(shape, np.float32), name="fp.mismatch"),
                "allreduce with a different shape on every rank", contains=("fp.mismatch",))
    c.ck.equal(c.fast_ops_in_one_more("fp.after_mismatch", "float64", (4,)), 1,
               "fast ops after a mismatch")


def threads_section(c):
    errors = []

    def run(tag):
        try:
            for i in range(200):
                x = np.full(3, float(c.rank + i), np.float64)
                got = fv.allreduce(x, name=f"thr.{tag}.{i}", op=fv.Sum)
                exp = np.full(3, float(sum(r + i for r in range(c.n))))
                if not np.array_equal(got, exp):
                    errors.append(f"thread {tag} op {i}: got {got}, expected {exp}")
        except Exception as e:  # noqa: BLE001 - reported below, on this rank
            errors.append(f"thread {tag}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
        c.ck.true(not t.is_alive(), "threads", "a submitting thread never finished")
    c.ck.equal(errors, [], "concurrent blocking allreduces")


def join_section(c):
    # Rank 0 joins at once; the others reduce one more tensor, to which it adds zeros.
    if c.rank == 0:
        fv.join()
    else:
        x = np.full(4, float(c.rank), np.float32)
        got = fv.allreduce(x, name="join.extra", op=fv.Sum)
        c.ck.array(got, np.full(4, float(sum(range(1, c.n))), np.float32), "allreduce beside a join")
        fv.join()
    c.ck.equal(c.fast_ops_in_one_more("join.after", "float32", (9,)), 0,
               "fast ops after a join (the path is off)")


def torch_section(c):
    import torch

    import ferrovod.torch as hvd

    before = c.stats()
    fast = 0
    for tdt in (torch.float32, torch.float64, torch.int32, torch.float16, torch.bfloat16):
        for shape in ((), (5,), (4, 3)):
            key = c.key()
            xs = [torch.from_numpy(T.gen(key, r, "float32", shape)) * 8 for r in range(c.n)]
            xs = [x.to(tdt) for x in xs]
            exp = torch.stack([x.to(torch.float64) for x in xs]).sum(0)
            got = hvd.allreduce(xs[c.rank], name=f"t.{tdt}.{len(shape)}", op=hvd.Sum)
            mine = xs[c.rank].clone()
            got_ = hvd.allreduce_(mine, name=f"t_.{tdt}.{len(shape)}", op=hvd.Sum)
            fast += 2
            for g, what in ((got, "allreduce"), (got_, "allreduce_")):
                c.ck.equal((g.dtype, tuple(g.shape)), (tdt, shape), f"torch {what} {tdt} {shape}")
                rtol = 2e-2 if tdt in (torch.float16, torch.bfloat16) else 1e-6
                c.ck.true(torch.allclose(g.to(torch.float64), exp, rtol=rtol, atol=rtol),
                          f"torch {what} {tdt} {shape}", f"got {g}, expected {exp}")
            c.ck.true(got_ is mine, f"torch allreduce_ {tdt}", "in-place result is not the input")
    # The differentiable form: forward and backward are both blocking allreduces.
    w = torch.full((3,), float(c.rank + 1), requires_grad=True)
    y = hvd.allreduce(w, name="t.grad", op=hvd.Sum)
    y.sum().backward()
    fast += 2
    c.ck.true(torch.equal(y.detach(), torch.full((3,), float(sum(range(1, c.n + 1))))),
              "autograd allreduce forward", f"got {y}")
    c.ck.true(torch.equal(w.grad, torch.full((3,), float(c.n))), "autograd allreduce backward",
              f"got {w.grad}")
    c.ck.equal(c.stats()[0] - before[0], fast, "torch ops reduced on the fast path")


def broadcast_section(c):
    before = c.stats()
    fast = 0
    for dt in T.ALL_DTYPES:
        for shape in ((), (1,), (7,), (3, 5)):
            for root in range(c.n):
                key = c.key()
                xs = c.inputs(key, dt, shape)
                name = f"fpb.{dt}.{len(shape)}.{root}"
                got = fv.broadcast(xs[c.rank], root, name=name)
                c.ck.array(got, xs[root], f"broadcast {dt} {shape} from {root}")
                mine = xs[c.rank].copy()
                got_ = fv.broadcast_(mine, root, name=name + "_")
                c.ck.true(got_ is mine, f"broadcast_ {dt}", "in-place result is not the input")
                c.ck.array(got_, xs[root], f"broadcast_ {dt} {shape} from {root}")
                fast += 2
    for count, is_fast in ((LIMIT // 8, True), (LIMIT // 8 + 1, False)):
        key = c.key()
        xs = c.inputs(key, "float64", (count,))
        got = fv.broadcast(xs[c.rank], c.n - 1, name=f"fpb.limit.{count}")
        c.ck.array(got, xs[c.n - 1], f"broadcast of {count} float64")
        fast += is_fast
    obj = fv.broadcast_object({"rank": c.rank, "list": list(range(c.rank + 3))}, c.n - 1)
    c.ck.equal(obj, {"rank": c.n - 1, "list": list(range(c.n + 2))}, "broadcast_object")
    fast += 2
    after = c.stats()
    c.ck.equal(after[0] - before[0], fast, "broadcasts done on the fast path")
    c.ck.equal(after[1] - before[1], 0, "broadcast offers that went to the engine")


def allgather_section(c):
    before = c.stats()
    fast = 0
    for dt in T.ALL_DTYPES:
        for trailing in ((), (3,), (2, 5), (0,)):
            key = c.key()
            parts = [T.gen(key, r, dt, ((r + len(trailing)) % 3,) + trailing) for r in range(c.n)]
            got = fv.allgather(parts[c.rank], name=f"fpg.{dt}.{len(trailing)}.{trailing[:1]}")
            c.ck.array(got, np.concatenate(parts), f"allgather {dt} {trailing}")
            fast += 1
    # The limit is per rank's part: one rank over it sends the op through the engine.
    key = c.key()
    rows = [LIMIT // 8 + (1 if r == 0 else 0) for r in range(c.n)]
    parts = [T.gen(key, r, "float64", (rows[r],)) for r in range(c.n)]
    got = fv.allgather(parts[c.rank], name="fpg.limit")
    c.ck.array(got, np.concatenate(parts), "allgather beside the limit")
    objs = fv.allgather_object({"r": c.rank, "pad": "x" * c.rank})
    c.ck.equal(objs, [{"r": r, "pad": "x" * r} for r in range(c.n)], "allgather_object")
    after = c.stats()
    c.ck.true(after[0] - before[0] >= fast, "allgathers done on the fast path",
              f"{after[0] - before[0]} of at least {fast}")
    declined = fv.allreduce(np.array([after[1] - before[1]], np.int64), name="fpg.declined",
                            op=fv.Sum)[0]
    # Only the op over the limit can meet a decline (rank 0 declines it; the others offer).
    c.ck.true(declined <= c.n - 1, "allgather offers that went to the engine", str(declined))


def scatter_section(c):
    import torch

    import ferrovod.torch as hvd

    before = c.stats()
    fast = 0
    for dt in T.REDUCE_DTYPES:
        for opname, op in ((SUM, fv.Sum), (AVERAGE, fv.Average)):
            for shape in ((0,), (1,), (c.n + 1,), (7, 3), (2 * c.n, 5)):
                for pre, post in ((1.0, 1.0), (2.0, 0.5)):
                    if pre != 1.0 and not T.is_float(np.dtype(dt)):
                        continue
                    key = c.key()
                    xs = c.inputs(key, dt, shape, T.input_mode(opname, dt))
                    start, count = T.split_rows(shape[0], c.n)[c.rank]
                    exp = T.ref_reduce(xs, opname, dt, c.n, pre, post)[start:start + count]
                    got = fv.reducescatter(xs[c.rank], op=op, prescale_factor=pre,
                                           postscale_factor=post,
                                           name=f"fps.{dt}.{opname}.{shape}.{pre}")
                    c.ck.array(got, exp, f"reducescatter {opname} {dt} {shape} x{pre}x{post}")
                    fast += 1
    for dt in T.ALL_DTYPES:
        for shape in ((0,), (c.n,), (3 * c.n, 2), (c.n, 0)):
            key = c.key()
            xs = c.inputs(key, dt, shape)
            block = shape[0] // c.n
            exp = np.concatenate([x[c.rank * block:(c.rank + 1) * block] for x in xs])
            got = fv.alltoall(xs[c.rank], name=f"fpa.{dt}.{shape}")
            c.ck.array(got, exp, f"alltoall {dt} {shape}")
            fast += 1
    # torch's forms (autograd functions whose forward is blocking) and its received splits.
    key = c.key()
    xs = [torch.from_numpy(x) for x in c.inputs(key, "float32", (2 * c.n + 1, 3))]
    start, count = T.split_rows(2 * c.n + 1, c.n)[c.rank]
    got = hvd.reducescatter(xs[c.rank], op=hvd.Sum, name="fpt.rs")
    exp = torch.stack([x.double() for x in xs]).sum(0)[start:start + count]
    c.ck.true(torch.allclose(got.double(), exp, rtol=1e-6, atol=1e-6), "torch reducescatter",
              f"got {got}, expected {exp}")
    xs = [torch.from_numpy(x) for x in c.inputs(c.key(), "int64", (2 * c.n, 2))]
    got = hvd.alltoall(xs[c.rank], name="fpt.a2a")
    exp = torch.cat([x[2 * c.rank:2 * c.rank + 2] for x in xs])
    c.ck.true(torch.equal(got, exp), "torch alltoall", f"got {got}, expected {exp}")
    y = hvd.allgather(xs[c.rank], name="fpt.ag")
    c.ck.true(torch.equal(y, torch.cat(xs)), "torch allgather", f"got {y}")
    fast += 3
    # Over the limit (every rank's input): through the engine, still right.
    key = c.key()
    xs = c.inputs(key, "float64", (LIMIT // 8 + c.n,))
    start, count = T.split_rows(LIMIT // 8 + c.n, c.n)[c.rank]
    got = fv.reducescatter(xs[c.rank], op=fv.Sum, name="fps.limit")
    c.ck.array(got, T.ref_reduce(xs, SUM, "float64", c.n)[start:start + count],
               "reducescatter over the limit")
    after = c.stats()
    c.ck.equal(after[0] - before[0], fast, "reducescatters and alltoalls on the fast path")
    c.ck.equal(after[1] - before[1], 0, "their offers that went to the engine")


SECTIONS = {"reduce": reduce_section, "orders": orders_section, "mismatch": mismatch_section,
            "threads": threads_section, "join": join_section, "torch": torch_section,
            "broadcast": broadcast_section, "allgather": allgather_section,
            "scatter": scatter_section}


def main():
    seed = int(sys.argv[1])
    sections = sys.argv[2].split(",")
    fv.init()
    c = Ctx(seed)
    for s in sections:
        SECTIONS[s](c)
        print(f"section {s}: {c.ck.count} checks", flush=True)
    fv.shutdown()
    return c.ck.count


if __name__ == "__main__":
    T.run_main(main)
