"""Soak test: mixed allreduce / allgather / broadcast with random sizes for a fixed time.

Run on several ranks through the launcher, e.g.::

    ferrovodrun -np 3 python scripts/soak.py --minutes 10

Every rank derives every rank's input from a shared seed, so each result is checked against a
NumPy reference computed without ferrovod. Each rank prints its resident memory (VmRSS) after
the first minute and at the end, and its open file descriptors at the start and the end. The
exit status is non-zero on a wrong result, when VmRSS grew more than ``--max-rss-growth``
percent after the first minute, or when the number of open descriptors changed.

VmRSS is compared after glibc's ``malloc_trim(0)`` has returned the C heap's free pages to the
OS: without it, samples of an unchanged workload differ by several percent depending on what
the allocator happens to keep cached from the last step. The untrimmed figures are printed too.

Not part of the default test run: it takes as long as ``--minutes`` says.
"""

import argparse
import ctypes
import gc
import os
import sys
import time

import numpy as np

import ferrovod as fv

# Element types exercised; integer inputs stay small so sums over the ranks cannot wrap.
DTYPES = [np.dtype(t) for t in ("float32", "float64", "int32", "int64", "float16")]
KINDS = ("allreduce", "allgather", "broadcast")
# Named ops reuse a small pool of names (the response-cache path, with shapes that change
# between uses); the rest are unnamed, so every one is new to the coordinator.
NAME_POOL = 24


def vm_rss_kib():
    """Resident set size of this process in KiB, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS line in /proc/self/status")


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


MALLOC_TRIM = _malloc_trim()


def live_rss_kib():
    """(VmRSS as found, VmRSS after returning the C heap's free pages to the OS).

    The first fluctuates by several percent from sample to sample: the allocator keeps pages
    freed by the last step's large arrays cached. The second measures what is still in use,
    so a leak shows in it and allocator caching does not.
    """
    raw = vm_rss_kib()
    if MALLOC_TRIM is None:
        return raw, raw
    MALLOC_TRIM(0)
    return raw, vm_rss_kib()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


MALLINFO2 = _mallinfo2()


def heap_in_use_kib():
    """Bytes the C heap has handed out and not got back (glibc's mallinfo2: in-use chunks of
    every arena plus mmapped blocks), in KiB; None without glibc. Unlike VmRSS it does not
    move with fragmentation or the allocator's caching, so a leak of C-heap memory (the
    engine's Rust allocations, NumPy's array data) shows here, and growth of VmRSS alone
    does not mean one."""
    if MALLINFO2 is None:
        return None
    m = MALLINFO2()
    return (m.uordblks + m.hblkhd) // 1024


def python_objects():
    """Objects the garbage collector tracks: grows if Python-level objects leak."""
    return len(gc.get_objects())


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def log_uniform_int(rng, lo, hi):
    """An integer in [lo, hi], log-uniformly distributed (small and large sizes alike)."""
    return int(np.exp(rng.uniform(np.log(lo), np.log(hi + 1)))) if hi > lo else lo


def rank_input(seed, step, idx, r, dt, shape):
    """Rank ``r``'s input for op ``idx`` of ``step``: the same on every rank that computes it."""
    rng = np.random.default_rng([seed, step, idx, r])
    if dt.kind == "f":
        return rng.standard_normal(size=shape).astype(dt)
    return rng.integers(-1000, 1000, size=shape, dtype=dt)


def plan_step(seed, step, n, max_elems):
    """The ops of one step, identical on every rank: list of dicts."""
    rng = np.random.default_rng([seed, step, 1 << 30])
    ops = []
    for idx in range(int(rng.integers(1, 5))):
        kind = KINDS[int(rng.integers(len(KINDS)))]
        dt = DTYPES[int(rng.integers(len(DTYPES)))]
        elems = log_uniform_int(rng, 1, max_elems)
        cols = int(rng.choice([1, 3, 16]))
        rows = max(1, elems // cols)
        op = {"kind": kind, "dt": dt, "idx": idx}
        if rng.random() < 0.5:
            # Distinct within the step: ops submitted together need distinct names.
            op["name"] = f"soak.{kind}.{(int(rng.integers(NAME_POOL)) * 4 + idx) % (NAME_POOL * 4)}"
        else:
            op["name"] = None
        if kind == "allgather":
            # First dimension differs per rank (0 allowed).
            op["shapes"] = [(int(rng.integers(0, rows + 1)), cols) for _ in range(n)]
        else:
            op["shape"] = (rows, cols)
        if kind == "broadcast":
            op["root"] = int(rng.integers(n))
        if kind == "allreduce":
            op["reduce"] = [fv.Sum, fv.Average, fv.Min, fv.Max][int(rng.integers(4))]
        ops.append(op)
    return ops


def reference(op, inputs, n):
    kind, dt = op["kind"], op["dt"]
    if kind == "allgather":
        return np.concatenate(inputs, axis=0)
    if kind == "broadcast":
        return inputs[op["root"]]
    stack = np.stack(inputs)
    red = op["reduce"]
    if red == fv.Min:
        return stack.min(0)
    if red == fv.Max:
        return stack.max(0)
    if dt.kind == "f":
        s = stack.astype(np.float64).sum(0)
        return (s / n if red == fv.Average else s).astype(dt)
    s = stack.astype(np.int64).sum(0)
    if red == fv.Average:
        s = (np.abs(s) // n) * np.sign(s)  # integer average truncates toward zero
    return s.astype(dt)


def check(got, exp, what):
    if not isinstance(got, np.ndarray) or got.dtype != exp.dtype or got.shape != exp.shape:
        raise AssertionError(f"{what}: got {type(got).__name__} "
                             f"{getattr(got, 'dtype', None)} {getattr(got, 'shape', None)}, "
                             f"expected {exp.dtype} {exp.shape}")
    if exp.dtype.kind == "f":
        tol = 2e-2 if exp.dtype == np.float16 else 1e-5
        ok = np.allclose(got.astype(np.float64), exp.astype(np.float64), rtol=tol, atol=tol)
    else:
        ok = np.array_equal(got, exp)
    if not ok:
        raise AssertionError(f"{what}: values differ from the NumPy reference")


CONTROL = False  # set by --control


def submit(op, mine, rank):
    kind = op["kind"]
    if kind == "allreduce":
        return fv.allreduce_async(mine, name=op["name"], op=op["reduce"])
    if kind == "allgather":
        return fv.allgather_async(mine, name=op["name"])
    return fv.broadcast_async(mine, op["root"], name=op["name"])


# Allreduce tensors from this size up are reduced in place, not copied into the fusion buffer
# (the engine's FUSION_COPY_LIMIT).
FUSION_BYPASS_BYTES = 1 << 20


def priming_ops(n, max_elems):
    """One step with the largest op of every kind, so that buffers and allocator pools that
    keep their high-water mark reach it during the warm-up rather than whenever the random plan
    first draws its largest sizes: four allreduces of the largest size (reduced in place), four
    of the largest size that still goes through the fusion buffer (fused together, the most a
    step of at most four ops can put there), an allgather and a broadcast."""
    f64 = np.dtype("float64")
    fusable = min(max_elems, FUSION_BYPASS_BYTES // f64.itemsize - 1)
    ops = [{"kind": "allreduce", "dt": f64, "idx": i, "name": f"soak.prime.ar{i}",
            "shape": (elems, 1), "reduce": fv.Sum}
           for i, elems in enumerate([max_elems] * 4 + [fusable] * 4)]
    ops.append({"kind": "allgather", "dt": f64, "idx": 8, "name": "soak.prime.ag",
                "shapes": [(max_elems, 1)] * n})
    ops.append({"kind": "broadcast", "dt": f64, "idx": 9, "name": "soak.prime.bc",
                "shape": (max_elems, 1), "root": n - 1})
    return ops


PRIMING_STEP = 1 << 40  # the seed key of the priming step's inputs, far from any real step


def run_step(args, step, rank, n, counts, ops=None):
    """Runs (submits together, then checks) one step's ops (by default the random plan's);
    returns them with their result sizes."""
    if ops is None:
        ops = plan_step(args.seed, step, n, args.max_elems)
    handles, expected = [], []
    for op in ops:
        dt = op["dt"]
        shapes = op["shapes"] if op["kind"] == "allgather" else [op["shape"]] * n
        inputs = [rank_input(args.seed, step, op["idx"], r, dt, shapes[r]) for r in range(n)]
        if CONTROL:
            # Same allocations as a real op's output, no ferrovod: the allocator's share.
            handles.append(reference(op, inputs, n).copy())
        else:
            handles.append(submit(op, inputs[rank], rank))
        expected.append(reference(op, inputs, n))
    for op, h, exp in zip(ops, handles, expected):
        got = h if CONTROL else fv.synchronize(h)
        check(got, exp, f"rank {rank} step {step} {op['kind']} {op['dt']} {exp.shape}")
        counts[op["kind"]] += 1
        op["nbytes"] = exp.nbytes
    return ops


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    ap.add_argument("--warmup-minutes", type=float, default=1.0,
                    help="when the baseline VmRSS is taken (default 1)")
    ap.add_argument("--max-elems", type=int, default=1 << 18,
                    help="largest tensor, in elements (default 262144)")
    ap.add_argument("--max-rss-growth", type=float, default=5.0,
                    help="allowed VmRSS growth after the warm-up, percent (default 5)")
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--control", action="store_true",
                    help="control run: every op's result is computed locally (same sizes, same "
                         "allocations, no collective), to tell ferrovod's memory growth from the "
                         "allocator's behaviour under this workload")
    ap.add_argument("--no-priming", action="store_true",
                    help="skip the first step that runs the largest size of every op")
    args = ap.parse_args()
    global CONTROL
    CONTROL = args.control

    fv.init()
    rank, n = fv.rank(), fv.size()
    fds_start = open_fds()
    rss_start = live_rss_kib()[1]
    t0 = time.monotonic()
    end_at = args.minutes * 60.0
    rss_warm = None
    step = ops_done = checks = 0
    nbytes = 0
    counts = dict.fromkeys(KINDS, 0)
    next_report = 60.0
    if not args.no_priming:
        for op in run_step(args, PRIMING_STEP, rank, n, counts, priming_ops(n, args.max_elems)):
            checks += 1
            ops_done += 1
            nbytes += op["nbytes"]
    stop = False
    while not stop:
        # In a function, so the step's arrays are freed before memory is measured.
        ops = run_step(args, step, rank, n, counts)
        checks += len(ops)
        nbytes += sum(o["nbytes"] for o in ops)
        ops_done += len(ops)
        step += 1
        elapsed = time.monotonic() - t0
        if rss_warm is None and elapsed >= args.warmup_minutes * 60.0:
            raw, rss_warm = live_rss_kib()
            print(f"rank {rank}: warm-up over after {elapsed:.0f} s: VmRSS {rss_warm} KiB "
                  f"({raw} KiB before trimming the C heap)", flush=True)
        if elapsed >= next_report:
            next_report += 60.0
            raw, live = live_rss_kib()
            print(f"rank {rank}: {elapsed:.0f} s: VmRSS {live} KiB ({raw} untrimmed), "
                  f"C heap in use {heap_in_use_kib()} KiB, {python_objects()} Python objects, "
                  f"{open_fds()} fds, {ops_done} ops", flush=True)
        if step % 16 == 0:
            # Rank 0's clock decides, so every rank stops after the same step.
            flag = np.array([1 if elapsed >= end_at else 0], dtype=np.int32)
            stop = bool(fv.broadcast(flag, 0, name="soak.stop")[0])

    elapsed = time.monotonic() - t0
    rss_end_raw, rss_end = live_rss_kib()
    fds_end = open_fds()
    if rss_warm is None:
        rss_warm = rss_start
    growth = 100.0 * (rss_end - rss_warm) / rss_warm
    print(f"rank {rank}: {elapsed:.0f} s, {step} steps, {ops_done} ops "
          f"({counts['allreduce']} allreduce, {counts['allgather']} allgather, "
          f"{counts['broadcast']} broadcast), {nbytes / 2**30:.2f} GiB of results, "
          f"{checks} results checked", flush=True)
    print(f"rank {rank}: VmRSS after init {rss_start} KiB, after warm-up {rss_warm} KiB, "
          f"end {rss_end} KiB ({rss_end_raw} untrimmed; growth {growth:+.2f} %); "
          f"fds start {fds_start}, end {fds_end}",
          flush=True)
    # No rank may shut down before every rank has measured: a departing rank's control
    # connection closes on rank 0 (the coordinator), which would change its descriptor count.
    fv.barrier()
    fv.shutdown()
    failed = []
    if growth > args.max_rss_growth:
        failed.append(f"VmRSS grew {growth:.2f} % (> {args.max_rss_growth} %)")
    if fds_end != fds_start:
        failed.append(f"open fds changed {fds_start} -> {fds_end}")
    if failed:
        print(f"rank {rank}: FAIL: " + "; ".join(failed), flush=True)
        sys.exit(1)
    print(f"rank {rank}: OK", flush=True)


if __name__ == "__main__":
    main()
