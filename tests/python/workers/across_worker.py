"""A job of one rank per host: blocking allreduces of several dtypes, shapes and reductions
against NumPy, which the fast path across hosts agrees without the coordinator (the
``fast_path_stats`` testing hook says how many it took). Every rank can compute every rank's
input (a function of the rank and the op), so each checks its result against NumPy's
reduction of all of them in rank order, and the ranks compare their results' bytes."""

import hashlib
import os
import sys

import numpy as np

import ferrovod as fv
from ferrovod import _core

fv.init()
rank, size = fv.rank(), fv.size()


def inputs(i, dtype, n):
    """Every rank's input to op ``i``: small integers, so float sums are exact in any order."""
    return [((np.arange(n) * (r + 3) + i) % 23 - 7).astype(dtype) for r in range(size)]


digest = hashlib.sha256()
checks = 0
i = 0
for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16):
    # Up to 16 KiB per rank: what the fast path across hosts takes.
    for n in (1, 7, 1000, 2047):
        for op, ref in ((fv.Sum, np.sum), (fv.Min, np.min), (fv.Max, np.max)):
            xs = inputs(i, dtype, n)
            expect = ref(np.stack(xs), axis=0).astype(dtype)
            got = fv.allreduce(xs[rank], op=op, name=f"across.{i}")
            assert got.dtype == dtype and np.array_equal(got, expect), (i, dtype, n, op)
            # In place, unnamed, as a training loop calls it.
            buf = xs[rank].copy()
            fv.allreduce_(buf, op=op)
            assert np.array_equal(buf, expect), (i, dtype, n, op, "in place")
            digest.update(got.tobytes())
            checks += 2
            i += 1
        if np.issubdtype(dtype, np.floating):
            xs = inputs(i, dtype, n)
            expect = np.stack([x.astype(np.float64) for x in xs]).sum(axis=0) / size
            got = fv.allreduce(xs[rank], op=fv.Average, name=f"across.{i}")
            tol = 1e-3 if dtype == np.float16 else 1e-6
            assert np.allclose(got, expect, rtol=tol, atol=tol), (i, dtype, n, "average")
            digest.update(got.tobytes())
            checks += 1
            i += 1

# The fast path took every one: no rank has an engine op in flight here.
taken, declined = _core.fast_path_stats()
print(f"FAST taken={taken} declined={declined} ops={checks}", flush=True)
if os.environ.get("FERROVOD_FAST_PATH_BYTES") != "0":
    assert (taken, declined) == (checks, 0), (taken, declined, checks)
else:
    assert taken == 0, (taken, declined)

# Every rank computed the same bits.
mine = np.frombuffer(digest.digest(), dtype=np.uint8)
every = fv.allgather(mine.reshape(1, -1), name="across.digest")
assert all(np.array_equal(every[r], mine) for r in range(size)), "ranks differ"
print(f"OK {checks}", flush=True)
fv.shutdown()
sys.exit(0)
