"""A worker of a multi-host job (hosts simulated as network namespaces).

argv: the expected placement as ``host:slots,host:slots`` in rank order (what -H gives, or what
the other launcher was told), then ``key=value`` expectations on the environment (``cwd=`` is
the working directory; ``bound=0,1,...``: bound to this local rank's share of those CPUs).

Checks, each against a reference computed without ferrovod: rank, size and the local/cross
ranks against the placement; the host each rank runs on; allreduce (several dtypes, odd sizes)
against NumPy on every rank's input regenerated from seeds; allgather with a different first
dimension per rank; broadcast from the last rank. Prints ``OK <checks>``.
"""

import os
import socket
import sys

import numpy as np

from fvtest import REDUCE_DTYPES, SUM, gen, ref_reduce, tol

import ferrovod as fv

placement = [(h, int(n)) for h, n in (item.split(":") for item in sys.argv[1].split(","))]
expect_env = dict(a.split("=", 1) for a in sys.argv[2:])

fv.init()
r, n = fv.rank(), fv.size()
checks = 0

# The placement as horovodrun assigns it: hosts in order, slot by slot.
where = [(h, lr, slots) for h, slots in placement for lr in range(slots)]
assert n == len(where), f"size {n}, placement has {len(where)} slots"
host, local_rank, local_size = where[r]
hosts_with = [h for h, slots in placement if slots > local_rank]
expected = (local_rank, local_size, hosts_with.index(host), len(hosts_with))
got = (fv.local_rank(), fv.local_size(), fv.cross_rank(), fv.cross_size())
assert got == expected, f"rank {r}: local/cross {got}, expected {expected}"
# A pod's hostname is the first label of the name its peers resolve.
assert socket.gethostname() == host.split(".")[0], \
    f"rank {r} runs on {socket.gethostname()}, expected {host}"
checks += 2

for key, value in expect_env.items():
    if key == "bound":
        from ferrovod.runner.cpus import physical_cores, share_of

        cores = physical_cores([int(c) for c in value.split(",")])
        actual, value = sorted(os.sched_getaffinity(0)), sorted(share_of(cores, *got[:2]))
    else:
        actual = os.getcwd() if key == "cwd" else os.environ.get(key)
    assert actual == value, f"rank {r}: {key}={actual!r}, expected {value!r}"
    checks += 1

for i, dt in enumerate(REDUCE_DTYPES):
    for size in (1, 1000, 70001):
        key = (7, i, size)
        xs = [gen(key, q, dt, (size,), mode="nowrap", n=n) for q in range(n)]
        out = fv.allreduce(xs[r], op=fv.Sum, name=f"ar.{i}.{size}")
        want = ref_reduce(xs, SUM, dt, n)
        rtol, atol = tol(dt)
        np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64),
                                   rtol=rtol, atol=atol, err_msg=f"allreduce {dt} {size}")
        checks += 1

parts = [gen((8, q), q, np.float32, (q + 1, 3)) for q in range(n)]
got = fv.allgather(parts[r], name="gather")
np.testing.assert_array_equal(got, np.concatenate(parts))
checks += 1

x = gen((9,), n - 1, np.int64, (257,))
got = fv.broadcast(x if r == n - 1 else np.zeros_like(x), root_rank=n - 1, name="bcast")
np.testing.assert_array_equal(got, x)
checks += 1

print(f"host={socket.gethostname()} rank={r} local={fv.local_rank()}/{fv.local_size()} "
      f"cross={fv.cross_rank()}/{fv.cross_size()}", flush=True)
fv.shutdown()
print(f"OK {checks}", flush=True)
