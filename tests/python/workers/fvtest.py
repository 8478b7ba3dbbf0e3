"""Shared helpers for the worker scripts that the pytest suite launches.

Every worker builds *every* rank's input from a seed, so each rank can compute the expected
result with NumPy on its own: the reference never goes through ferrovod. A worker prints
``OK <n_checks>`` as its last line, or a ``FAIL`` line and exits non-zero on the first
mismatch.
"""

import os
import sys
import tempfile
import time
import traceback

import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # a missing test dependency must fail loudly, never skip
    BF16 = None

INT_DTYPES = [np.dtype(t) for t in ("uint8", "int8", "int16", "int32", "int64")]
FLOAT_DTYPES = [np.dtype(t) for t in ("float16", "float32", "float64")]
if BF16 is not None:
    FLOAT_DTYPES.insert(1, BF16)
REDUCE_DTYPES = INT_DTYPES + FLOAT_DTYPES
ALL_DTYPES = REDUCE_DTYPES + [np.dtype(bool)]

SUM, AVERAGE, MIN, MAX, PRODUCT = "Sum", "Average", "Min", "Max", "Product"
REDUCE_OPS = [SUM, AVERAGE, MIN, MAX, PRODUCT]


def require_bf16():
    if BF16 is None:
        raise RuntimeError("ml_dtypes is not installed in this interpreter: bfloat16 cannot be tested")


def is_float(dt):
    return dt.kind == "f" or dt == BF16


def tol(dt):
    """(rtol, atol) for comparing a reduced result with a float64 reference."""
    if dt == np.float16:
        return 1e-2, 1e-2
    if dt == BF16:
        return 4e-2, 4e-2
    if dt == np.float32:
        return 1e-5, 1e-5
    if dt == np.float64:
        return 1e-12, 1e-12
    return 0.0, 0.0


def rng_for(*key):
    """One generator per (case, rank): identical on every rank that asks for it."""
    return np.random.default_rng([abs(int(k)) for k in key])


def gen(key, r, dt, shape, mode="normal", n=1):
    """Rank ``r``'s input for case ``key``.

    Modes: ``normal`` (floats N(0,1); ints over their full range, so sums/products wrap),
    ``pos`` (floats in [0.5, 1.5), for Product), ``nowrap`` (ints small enough that the sum over
    ``n`` ranks fits the dtype), ``tiny`` (ints in [-8, 8], for scale factors).
    """
    rng = rng_for(*key, r)
    dt = np.dtype(dt)
    shape = tuple(shape)
    if dt == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if is_float(dt):
        if mode == "pos":
            return rng.uniform(0.5, 1.5, size=shape).astype(dt)
        return rng.standard_normal(size=shape).astype(dt)
    info = np.iinfo(dt)
    if mode == "tiny":
        lo, hi = (0, 8) if info.min == 0 else (-8, 8)
    elif mode == "nowrap":
        lo, hi = (0, info.max // n) if info.min == 0 else (-(info.max // n), info.max // n)
        # keep int64 inside the range a float64 represents exactly
        lo, hi = max(lo, -(2**40)), min(hi, 2**40)
    else:
        lo, hi = int(info.min), int(info.max)
    return rng.integers(lo, hi, size=shape, endpoint=True, dtype=dt)


def ref_adasum(xs, dt, pre=1.0, post=1.0):
    """NumPy reference of Adasum over every rank's input ``xs`` (a power-of-two count), by the
    recurrence: adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b (a coefficient is 1
    for a vector of squared norm below sqrt(DBL_MIN)), combined as a binary tree in rank order
    (pairs (0, 1), (2, 3), ..., then pairs of those), each level rounded to ``dt``."""
    dt = np.dtype(dt)
    shape = np.shape(xs[0])
    tiny = np.sqrt(np.finfo(np.float64).tiny)
    vs = [(np.asarray(x).astype(np.float64) * pre).astype(dt).ravel() for x in xs]
    while len(vs) > 1:
        nxt = []
        for a, b in zip(vs[0::2], vs[1::2]):
            a, b = a.astype(np.float64), b.astype(np.float64)
            dot, a2, b2 = float(a @ b), float(a @ a), float(b @ b)
            ca = 1.0 - dot / a2 * 0.5 if a2 >= tiny else 1.0
            cb = 1.0 - dot / b2 * 0.5 if b2 >= tiny else 1.0
            nxt.append((ca * a + cb * b).astype(dt))
        vs = nxt
    return (vs[0].astype(np.float64) * post).astype(dt).reshape(shape)


def ref_reduce(xs, op, dt, n, pre=1.0, post=1.0):
    """NumPy reference of a reduction over the list of every rank's input ``xs``."""
    dt = np.dtype(dt)
    stack = np.stack(xs) if xs else None
    if is_float(dt):
        a = stack.astype(np.float64) * pre
        if op == SUM:
            r = a.sum(0)
        elif op == AVERAGE:
            r = a.sum(0) / n
        elif op == MIN:
            r = a.min(0)
        elif op == MAX:
            r = a.max(0)
        elif op == PRODUCT:
            r = a.prod(0)
        else:
            raise ValueError(op)
        return (r * post).astype(dt)
    if pre != 1.0 or post != 1.0:
        # scale factors on integers round toward zero; the inputs are kept small so nothing wraps
        assert op in (SUM, AVERAGE)
        s = np.trunc(stack.astype(np.float64) * pre).sum(0)
        if op == AVERAGE:
            s = s / n
        return np.trunc(s * post).astype(dt)
    if op == SUM:
        return np.sum(stack, axis=0, dtype=dt)  # wraps as NumPy does
    if op == PRODUCT:
        return np.prod(stack, axis=0, dtype=dt)
    if op == MIN:
        return stack.min(0)
    if op == MAX:
        return stack.max(0)
    if op == AVERAGE:
        s = stack.astype(np.int64).sum(0)  # exact: inputs are generated with mode="nowrap"
        q = (np.abs(s) // n) * np.sign(s)  # truncation toward zero
        return q.astype(dt)
    raise ValueError(op)


def input_mode(op, dt):
    if op == PRODUCT and is_float(np.dtype(dt)):
        return "pos"
    if op == AVERAGE and not is_float(np.dtype(dt)):
        return "nowrap"
    return "normal"


def split_rows(d0, n):
    """(start, count) of each rank's reducescatter slice: lowest ranks get the extra rows."""
    base, extra = divmod(d0, n)
    out, start = [], 0
    for r in range(n):
        c = base + (1 if r < extra else 0)
        out.append((start, c))
        start += c
    return out


class CheckFailure(AssertionError):
    pass


class Checker:
    def __init__(self, rank):
        self.rank = rank
        self.count = 0

    def fail(self, what, msg):
        raise CheckFailure(f"rank {self.rank}: {what}: {msg}")

    def true(self, cond, what, msg="condition is false"):
        if not cond:
            self.fail(what, msg)
        self.count += 1

    def equal(self, got, exp, what):
        if got != exp:
            self.fail(what, f"got {got!r}, expected {exp!r}")
        self.count += 1

    def array(self, got, exp, what):
        """``got`` must be a NumPy array with ``exp``'s dtype, shape and (within tolerance) values."""
        exp = np.asarray(exp)
        if not isinstance(got, np.ndarray):
            self.fail(what, f"result is {type(got).__name__}, expected numpy.ndarray")
        if got.dtype != exp.dtype:
            self.fail(what, f"dtype {got.dtype}, expected {exp.dtype}")
        if got.shape != exp.shape:
            self.fail(what, f"shape {got.shape}, expected {exp.shape}")
        if is_float(exp.dtype):
            rtol, atol = tol(exp.dtype)
            g, e = got.astype(np.float64), exp.astype(np.float64)
            bad = ~np.isclose(g, e, rtol=rtol, atol=atol)
        else:
            g, e = got, exp
            bad = g != e
        if np.any(bad):
            idx = np.argwhere(bad)[:3]
            shown = ", ".join(f"{tuple(i)}: got {g[tuple(i)]!r} expected {e[tuple(i)]!r}" for i in idx)
            self.fail(what, f"{int(np.sum(bad))} of {exp.size} elements differ ({shown})")
        self.count += 1

    def raises(self, excs, fn, what, contains=()):
        try:
            fn()
        except excs as e:
            msg = str(e)
            for s in contains:
                if s.lower() not in msg.lower():
                    self.fail(what, f"{type(e).__name__} message {msg!r} does not mention {s!r}")
            self.count += 1
            return e
        except Exception as e:  # noqa: BLE001 - the wrong class is the failure we report
            self.fail(what, f"raised {type(e).__name__}({e}), expected {excs}")
        self.fail(what, f"did not raise {excs}")


class Cases:
    """A worker's sequence of cases: a fresh key per case (the same on every rank, since every
    rank runs the same cases in the same order), every rank's input for a case, and the
    checker. Workers subclass it with their framework's rank and size."""

    def __init__(self, seed, rank, n):
        self.seed, self.case = seed, 0
        self.rank, self.n = rank, n
        self.ck = Checker(rank)

    def key(self):
        self.case += 1
        return (self.seed, self.case)

    def inputs(self, key, dt, shape, mode="normal"):
        return [gen(key, j, dt, shape, mode, self.n) for j in range(self.n)]


def run_main(body):
    """Run ``body() -> n_checks``; print ``OK n`` or a FAIL line and exit non-zero."""
    rank = os.environ.get("FERROVOD_RANK", "?")
    try:
        n = body()
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, SystemExit) and not e.code:
            raise
        traceback.print_exc()
        print(f"FAIL rank {rank}: {type(e).__name__}: {e}", flush=True)
        sys.stderr.flush()
        os._exit(1)  # do not hang in an atexit shutdown while peers wait for us
    print(f"OK {n}", flush=True)


class DLPackOnly:
    """An object that offers its data only through the DLPack protocol (no buffer, no array API)."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, *args, **kwargs):
        return self._arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class HostUpdates:
    """The launcher's host updates as an elastic worker sees them (its watcher thread reports
    each one), so that a worker that edits the hosts file can train on once the change is
    published instead of sleeping for it."""

    def __init__(self, timeout_s=120):
        import threading

        from ferrovod.elastic import membership as _elastic

        self.timeout_s = timeout_s
        self._event = threading.Event()
        _elastic.on_hosts_updated(lambda epoch, update: self._event.set())

    def expect(self):
        """Forgets earlier updates: call before making the change to wait for."""
        self._event.clear()

    def wait(self, what):
        """Returns once an update came after :meth:`expect`; raises after the timeout."""
        if not self._event.wait(self.timeout_s):
            raise RuntimeError(f"no host update came within {self.timeout_s} s of {what}")


def wait_until(done, what, timeout_s=60):
    """Returns once ``done()`` is true, looking every 10 ms; raises after ``timeout_s``
    (``what()`` says what was missing)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what()} in {timeout_s} s")
        time.sleep(0.01)


class Marks:
    """Files by which the ranks of one job tell each other that they have reached a point the
    engine cannot report (about to block in an op, done reporting an error): one per rank,
    named by the job (rank 0's pid, which every rank learns from ``allgather_object``) and a
    tag, and removed by the rank that waited for them."""

    def __init__(self, job, tag):
        self.base = os.path.join(tempfile.gettempdir(), f"ferrovod-{tag}-{job}")

    def set(self, rank):
        """This rank has reached the point."""
        open(f"{self.base}-{rank}", "w").close()

    def wait(self, ranks, timeout_s=60):
        """Returns once each of ``ranks`` has reached the point; raises after ``timeout_s``."""
        paths = [f"{self.base}-{r}" for r in ranks]
        wait_until(lambda: all(map(os.path.exists, paths)),
                   lambda: (f"ranks {[r for r, p in zip(ranks, paths) if not os.path.exists(p)]}"
                            f" did not reach {self.base}"),
                   timeout_s)
        for p in paths:
            os.unlink(p)
