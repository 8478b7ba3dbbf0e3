"""A tiny job for the logging tests: a small allreduce and one large enough to go through the
engine's data links, checked."""

import numpy as np

import ferrovod as fv

fv.init()
out = fv.allreduce(np.full(4, fv.rank(), np.float64), op=fv.Sum, name="x")
assert (out == sum(range(fv.size()))).all(), out
out = fv.allreduce(np.full(100_003, fv.rank(), np.float64), op=fv.Sum, name="large")
assert (out == sum(range(fv.size()))).all(), out
print("OK")
