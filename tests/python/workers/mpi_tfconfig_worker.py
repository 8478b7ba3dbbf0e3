"""A worker started by Open MPI's mpirun or with a TF_CONFIG, with no ferrovodrun and no
FERROVOD_RENDEZVOUS_ADDR: init() must find the job from the launcher alone.

Usage: ``mpi_tfconfig_worker.py MODE SIZE LOCAL_SIZE``. MODE is ``mpi`` (``init()``),
``mpi-comm`` (``init(comm=MPI.COMM_WORLD)``), ``mpi-sets`` (``init(comm=[ranks])`` and
``ProcessSet(mpi_comm)``), ``mpi-subset`` (``init(comm=[0, 1])`` of a larger job must fail:
print the error and exit 3), ``tf`` (``init()`` under TF_CONFIG; the expected
rank is ``FVTEST_RANK``) or ``error`` (init() must fail: print the error and exit 3).
Prints ``LISTEN rank=.. <ips>`` (the addresses this process listens on) and ``OK rank=.. checks=..``.
"""

import os
import sys

import numpy as np

import ferrovod as fv

mode, want_size, want_local_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
label = os.environ.get("FVTEST_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))


def say(line):
    # One write per line: the ranks of an mpirun share one pipe, and a short write is atomic.
    os.write(1, (line + "\n").encode())


def listening_ips():
    """IPv4 addresses of this process's listening TCP sockets (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ips = set()
    with open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:
                raw = bytes.fromhex(cols[1].split(":")[0])[::-1]
                ips.add(".".join(str(b) for b in raw))
    return sorted(ips)


if mode == "error":
    try:
        fv.init()
    except fv.FerrovodError as e:
        say(f"ERR rank={label} {type(e).__name__}: {e}")
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None:
            # Every rank reports before any exits (mpirun stops the job at the first exit).
            mpi.COMM_WORLD.Barrier()
        sys.exit(3)
    say(f"FAIL rank={label}: init() succeeded")
    sys.exit(1)

if mode == "mpi-sets":
    # Horovod's init(comm=[ranks]) and ProcessSet(mpi_comm): each process gives the
    # communicator of its half of a split; both halves become process sets.
    from mpi4py import MPI

    me, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    half = fv.ProcessSet(MPI.COMM_WORLD.Split(me % 2, me))
    listed = fv.ProcessSet([0, n - 1])
    members = [q for q in range(n) if q % 2 == me % 2]
    assert half.ranks == members and half.mpi_comm is not None, (half.ranks, members)
    fv.init(comm=list(range(n)), process_sets=[half, listed])
    ids = {0: 2, 1: 3}  # the rank list first, then the communicators' sets in rank order
    assert (listed.process_set_id, half.process_set_id) == (1, ids[me % 2]), \
        (listed.process_set_id, half.process_set_id)
    assert (half.size(), half.rank(), half.included()) == (len(members), me // 2, True)
    for q, ps in ((0, half), (1, listed)):
        if me in ps.ranks:
            got = fv.allreduce(np.array([me + 1.0]), op=fv.Sum, name=f"set{q}", process_set=ps)
            assert got[0] == sum(m + 1.0 for m in ps.ranks), (q, got, ps.ranks)
    fv.shutdown()
    say(f"OK rank={me} checks=4")
    sys.exit(0)

if mode == "mpi-subset":
    try:
        fv.init(comm=[0, 1])
    except ValueError as e:
        say(f"ERR rank={label} {e}")
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()  # every rank reports before any exits
        sys.exit(3)
    say(f"FAIL rank={label}: init(comm=[0, 1]) succeeded")
    sys.exit(1)

if mode == "mpi-comm":
    from mpi4py import MPI

    fv.init(comm=MPI.COMM_WORLD)
    assert fv.rank() == MPI.COMM_WORLD.Get_rank(), (fv.rank(), MPI.COMM_WORLD.Get_rank())
else:
    fv.init()
checks = 0
r, n = fv.rank(), fv.size()
assert str(r) == label, (r, label)
assert n == want_size, (n, want_size)
# One host: local ranks follow global ranks.
assert (fv.local_rank(), fv.local_size()) == (r, want_local_size), (fv.local_rank(), fv.local_size())
assert (fv.cross_rank(), fv.cross_size()) == (0, 1), (fv.cross_rank(), fv.cross_size())
checks += 4
if mode.startswith("mpi"):
    # The exchange went over mpi4py and handed its result to the engine, not to the environment
    # (which child processes would inherit).
    assert "mpi4py.MPI" in sys.modules
    assert "FERROVOD_RENDEZVOUS_ADDR" not in os.environ and "FERROVOD_SECRET" not in os.environ
else:
    assert "mpi4py" not in sys.modules, "init() imported mpi4py outside an MPI launch"
checks += 1


def inputs(q, dtype, count):
    return np.random.default_rng(1000 + q).standard_normal(count).astype(dtype)


# A small (latency-optimal) and a large (bandwidth-optimal, above 64 KiB) payload, odd sizes.
for dtype, count in ((np.float64, 37), (np.float32, 70001)):
    mine = inputs(r, dtype, count)
    gathered = fv.allgather(mine.reshape(1, -1), name=f"gather.{count}")
    for q in range(n):
        assert np.array_equal(gathered[q], inputs(q, dtype, count)), f"row {q} of the allgather"
    total = fv.allreduce(mine, op=fv.Sum, name=f"sum.{count}")
    ref = gathered.astype(np.float64).sum(axis=0)
    assert np.allclose(total, ref, rtol=1e-5, atol=1e-4), np.abs(total - ref).max()
    biggest = fv.allreduce(mine, op=fv.Max, name=f"max.{count}")
    assert np.array_equal(biggest, gathered.max(axis=0))
    checks += 3
say(f"LISTEN rank={r} {' '.join(listening_ips())}")
fv.shutdown()
say(f"OK rank={r} checks={checks}")
