"""How many objects the garbage collector tracks for each pending async allreduce.

A training step submits one allreduce per gradient and waits for them all in ``step()``, so
every pending op's Python objects outlive the collector's young generations. Promoted to the
oldest one, they trigger its full collections, which walk every object of the process (95 ms
each with torch loaded): at 16-17 tracked objects per op, one every dozen steps of a
500-tensor model, two-thirds of the Python time per op. Each path must stay at two per op (the
handle's record and its result holder), plus the new output tensor where it makes one (torch
tensors are tracked; NumPy arrays are not). Results are checked too.
"""

import gc

import numpy as np
import torch

import fvtest as T

import ferrovod as fv
import ferrovod.torch as hvd

K = 300
SLACK = 0.5  # the few objects of the measuring itself, spread over K ops


def per_op(submit):
    """Tracked objects per pending op while ``K`` submissions wait, and their handles."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        handles = [submit(i) for i in range(K)]
        grown = (len(gc.get_objects()) - before) / K
    finally:
        gc.enable()
    return grown, handles


def main():
    fv.init()
    r, n = fv.rank(), fv.size()
    ck = T.Checker(r)
    arrays = [np.full(5, i + r, np.float32) for i in range(K)]
    tensors = [torch.full((5,), float(i + r)) for i in range(K)]
    want = [np.full(5, n * i + n * (n - 1) / 2, np.float32) for i in range(K)]
    # (allowed per op, fresh inputs, submit input i, wait): in-place ops get fresh copies,
    # made before counting.
    paths = {
        "numpy allreduce_async": (2, lambda: arrays, lambda xs, i: fv.allreduce_async(xs[i], name=f"np.{i}", op=fv.Sum), fv.synchronize),
        "numpy allreduce_async_": (2, lambda: [a.copy() for a in arrays], lambda xs, i: fv.allreduce_async_(xs[i], name=f"npi.{i}", op=fv.Sum), fv.synchronize),
        "torch allreduce_async": (3, lambda: tensors, lambda xs, i: hvd.allreduce_async(xs[i], name=f"t.{i}", op=hvd.Sum), hvd.synchronize),
        "torch allreduce_async_": (2, lambda: [t.clone() for t in tensors], lambda xs, i: hvd.allreduce_async_(xs[i], name=f"ti.{i}", op=hvd.Sum), hvd.synchronize),
    }
    for what, (allowed, fresh, submit, sync) in paths.items():
        for _ in range(2):  # warm: the first round fills caches (names, dtype codes)
            xs = fresh()
            grown, handles = per_op(lambda i: submit(xs, i))
            for i, h in enumerate(handles):
                ck.array(np.asarray(sync(h)), want[i], f"{what} #{i}")
        print(f"PENDING {what}: {grown:.2f} tracked objects per op", flush=True)
        ck.true(grown <= allowed + SLACK, what,
                f"{grown:.2f} tracked objects per pending op (at most {allowed})")
    fv.shutdown()
    return ck.count


if __name__ == "__main__":
    T.run_main(main)
