"""Steps of many named allreduces, each checked, long enough for the tuner to settle."""

import numpy as np

import ferrovod as fv

fv.init()
r, n = fv.rank(), fv.size()
want_scale = sum(range(1, n + 1))
for step in range(60):
    handles = [fv.allreduce_async(np.full(100 + 37 * i, r + 1, np.float32), op=fv.Sum,
                                  name=f"g{i}") for i in range(12)]
    for i, h in enumerate(handles):
        out = fv.synchronize(h)
        assert (out == want_scale).all(), (step, i, out[:4])
print("OK")
