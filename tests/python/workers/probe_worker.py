"""The hostile-input probe as a matrix: every collective crossed with every way ranks can
disagree about it, small (the fast path's size) and large, blocking and async, with the
coordinator or another rank as the odd one out. Each case must raise a ferrovod error on every
rank within LIMIT seconds, naming the tensor and the odd rank, and must leave the job working.

usage: probe_worker.py numpy|torch    the disagreement matrix through that API
       probe_worker.py lifecycle      handles, shutdown and init misused
"""

import re
import sys
import time

import numpy as np

import fvtest as T

import ferrovod as fv

LIMIT = 10.0
SMALL, LARGE = 12, 70_000  # elements: under the fast path's 64 KiB, and over it


def names_rank(msg, rank):
    return re.search(rf"rank[s]?\b[^\n]{{0,80}}?(?<![\d.]){rank}(?![\d.])", msg, re.I) is not None


def cases(n, odd, r, numel):
    """(what, kind of submission, builder) where builder(rank is odd) gives the call's
    arguments. Every case disagrees about one thing only."""
    f32, f64, i32 = np.float32, np.float64, np.int32
    rows = 2 * n
    cols = max(1, numel // rows)

    def arr(shape, dt=f32):
        return np.ones(shape, dt)

    def pick(a, b):
        return b if r == odd else a

    return [
        ("allreduce dtype", lambda: ("allreduce", dict(tensor=arr(numel, pick(f32, f64))))),
        ("allreduce int/float", lambda: ("allreduce", dict(tensor=arr(numel, pick(f32, i32))))),
        ("allreduce count", lambda: ("allreduce", dict(tensor=arr(pick(numel, numel + 1))))),
        ("allreduce shape", lambda: ("allreduce", dict(tensor=arr(pick((rows, cols), (cols, rows)))))),
        ("allreduce op", lambda: ("allreduce", dict(tensor=arr(numel), op=pick(fv.Sum, fv.Max)))),
        ("allreduce average/sum", lambda: ("allreduce", dict(tensor=arr(numel), op=pick(fv.Average, fv.Sum)))),
        ("allreduce postscale", lambda: ("allreduce", dict(tensor=arr(numel), op=fv.Sum,
                                                          postscale_factor=pick(1.0, 0.5)))),
        ("allgather trailing", lambda: ("allgather", dict(tensor=arr((rows, pick(cols, cols + 1)))))),
        ("allgather ndim", lambda: ("allgather", dict(tensor=arr(pick((rows, cols), (rows, cols, 1)))))),
        ("allgather dtype", lambda: ("allgather", dict(tensor=arr((rows, cols), pick(f32, f64))))),
        ("allgather signedness", lambda: ("allgather", dict(tensor=arr((rows, cols), pick(np.int8, np.uint8))))),
        ("broadcast count", lambda: ("broadcast", dict(tensor=arr(pick(numel, numel - 1)), root_rank=0))),
        ("broadcast dtype", lambda: ("broadcast", dict(tensor=arr(numel, pick(i32, np.int64)), root_rank=0))),
        ("broadcast signedness", lambda: ("broadcast", dict(tensor=arr(numel, pick(np.int16, np.uint16)),
                                                            root_rank=0))),
        ("broadcast root", lambda: ("broadcast", dict(tensor=arr(numel), root_rank=pick(0, 1)))),
        ("alltoall trailing", lambda: ("alltoall", dict(tensor=arr((rows, pick(cols, cols + 2)))))),
        ("alltoall dtype", lambda: ("alltoall", dict(tensor=arr((rows, cols), pick(f32, f64))))),
        ("reducescatter rows", lambda: ("reducescatter", dict(tensor=arr((pick(rows, rows + n), cols)),
                                                              op=fv.Sum))),
        ("reducescatter dtype", lambda: ("reducescatter", dict(tensor=arr((rows, cols), pick(f32, f64)),
                                                               op=fv.Sum))),
        ("reducescatter op", lambda: ("reducescatter", dict(tensor=arr((rows, cols)),
                                                            op=pick(fv.Sum, fv.Average)))),
        ("kind allreduce/allgather", lambda: (pick("allreduce", "allgather"), dict(tensor=arr((rows, cols))))),
        ("kind broadcast/allreduce", lambda: (pick("broadcast", "allreduce"),
                                              dict(tensor=arr(numel), **pick({"root_rank": 0}, {})))),
        ("kind alltoall/reducescatter", lambda: (pick("alltoall", "reducescatter"),
                                                 dict(tensor=arr((rows, cols))))),
        ("grouped count", lambda: ("grouped_allreduce", dict(tensors=[arr(numel)] * pick(2, 3)))),
        ("grouped member shape", lambda: ("grouped_allreduce", dict(tensors=[arr(numel), arr(pick(5, 6))]))),
        ("grouped member dtype", lambda: ("grouped_allreduce", dict(tensors=[arr(numel), arr(5, pick(f32, f64))]))),
        ("grouped op", lambda: ("grouped_allreduce", dict(tensors=[arr(numel), arr(5)],
                                                           op=pick(fv.Sum, fv.Min)))),
        ("grouped allgather member", lambda: ("grouped_allgather", dict(
            tensors=[arr((rows, cols)), arr((2, pick(3, 4)))]))),
        ("grouped reducescatter member", lambda: ("grouped_reducescatter", dict(
            tensors=[arr((rows, cols)), arr((pick(rows, rows + n), 2))], op=fv.Sum))),
    ]


class NumpyApi:
    def __init__(self):
        fv.init()
        self.rank, self.size = fv.rank(), fv.size()

    def call(self, kind, name, blocking, args):
        fn = getattr(fv, kind if blocking else f"{kind}_async")
        if blocking:
            return lambda: fn(name=name, **args)
        h = fn(name=name, **args)
        return lambda: fv.synchronize(h)

    def sum_check(self, name):
        n = self.size
        x = np.full(5, self.rank + 1.0)
        got = fv.allreduce(x, op=fv.Sum, name=name)
        return np.array_equal(got, np.full(5, n * (n + 1) / 2))


class TorchApi:
    def __init__(self):
        import torch

        import ferrovod.torch as hvd

        self.torch, self.hvd = torch, hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()

    def _t(self, a):
        return self.torch.from_numpy(a)

    def call(self, kind, name, blocking, args):
        hvd = self.hvd
        args = dict(args)
        if "tensor" in args:
            args["tensor"] = self._t(args["tensor"])
        if "tensors" in args:
            args["tensors"] = [self._t(a) for a in args["tensors"]]
        if kind == "broadcast" and not blocking:
            kind = "broadcast_"  # torch's async broadcast is in place
            args["tensor"] = args["tensor"].clone()
        fn = getattr(hvd, kind if blocking else (f"{kind}_async" if kind != "broadcast_" else "broadcast_async_"))
        if blocking:
            return lambda: fn(name=name, **args)
        h = fn(name=name, **args)
        return lambda: hvd.synchronize(h)

    def sum_check(self, name):
        n = self.size
        x = self.torch.full((5,), self.rank + 1.0, dtype=self.torch.float64)
        got = self.hvd.allreduce(x, op=self.hvd.Sum, name=name)
        return bool((got == n * (n + 1) / 2).all())


def lifecycle():
    """Misused handles and lifecycle calls are clear local errors; a rank that shuts down
    with an op pending fails that op, and its peers' next op names it; both ranks can start
    again."""
    fv.init()
    r = fv.rank()
    ck = T.Checker(r)
    h = fv.allreduce_async(np.ones(3), name="lc.a")
    fv.synchronize(h)
    for what, fn in [("synchronize twice", lambda: fv.synchronize(h)), ("poll after synchronize", lambda: fv.poll(h)),
                     ("poll of a made-up handle", lambda: fv.poll(12345)),
                     ("synchronize of None", lambda: fv.synchronize(None))]:
        ck.raises(ValueError, fn, what, contains=("handle",))
    fv.init()  # a second init() is a no-op, as in Horovod
    ck.true(fv.is_initialized() and fv.rank() == r, "init twice", "state changed")
    ck.raises(fv.InvalidArgumentError, lambda: fv.allreduce(np.ones(2), process_set=fv.ProcessSet([0])),
              "unregistered process set", contains=("registered",))
    if r == 0:
        pending = fv.allreduce_async(np.ones(3), name="lc.only0")
        fv.barrier()
        t0 = time.monotonic()
        fv.shutdown()
        ck.true(time.monotonic() - t0 < LIMIT, "shutdown with an op pending", "slow")
        ck.raises(fv.ShutdownError, lambda: fv.synchronize(pending), "pending op after shutdown",
                  contains=("shut down",))
        ck.raises(fv.NotInitializedError, lambda: fv.allreduce(np.ones(2)), "op after shutdown")
        ck.raises(fv.NotInitializedError, fv.rank, "rank() after shutdown")
        fv.init()
        ck.raises(ValueError, lambda: fv.synchronize(pending), "a handle from before init")
    else:
        fv.barrier()
        time.sleep(0.5)
        e = ck.raises(fv.ShutdownError, lambda: fv.allreduce(np.ones(2), name="lc.x"),
                      "an op after rank 0 shut down", contains=("shut down",))
        ck.true(names_rank(str(e), 0), "an op after rank 0 shut down", f"message: {e}")
        fv.shutdown()
        fv.init()
    ck.true(NumpyApi().sum_check("lc.after"), "after a new init", "the job does not work")
    return ck.count


def main():
    if sys.argv[1] == "lifecycle":
        return lifecycle()
    api = NumpyApi() if sys.argv[1] == "numpy" else TorchApi()
    r, n = api.rank, api.size
    ck = T.Checker(r)
    ran = 0
    failed = []
    for odd in sorted({0, n // 2, n - 1}):
        for numel in (SMALL, LARGE):
            for blocking in (True, False):
                for what, build in cases(n, odd, r, numel):
                    if "signedness" in what and sys.argv[1] == "torch":
                        continue  # torch has no uint16; uint8/int8 is covered by the NumPy API
                    label = f"{what} [odd {odd}, {numel}, {'blocking' if blocking else 'async'}]"
                    name = f"probe.{ran}"
                    try:
                        probe(api, ck, label, f"probe.{ran}", odd, blocking, build)
                    except T.CheckFailure as e:
                        failed.append(str(e))
                    ck.true(api.sum_check(f"probe.after.{ran}"), label, "the job no longer works")
                    ran += 1
    for f in failed:
        print(f"finding: {f}", flush=True)
    ck.true(not failed, "probe", f"{len(failed)} of {ran} cases failed")
    print(f"probed {ran}", flush=True)
    return ck.count


def probe(api, ck, label, name, odd, blocking, build):
    kind, args = build()
    t0 = time.monotonic()
    try:
        wait = api.call(kind, name, blocking, args)
        wait()
        ck.fail(label, "no error")
    except fv.FerrovodError as e:
        msg = str(e)
        ck.true(not isinstance(e, fv.HorovodInternalError), label,
                f"a disagreement is not a lost rank: {type(e).__name__}: {msg}")
        ck.true(name in msg, label, f"message does not name {name}: {msg!r}")
        ck.true(names_rank(msg, odd), label, f"message does not name rank {odd}: {msg!r}")
    except Exception as e:  # noqa: BLE001 - any other class is a finding
        ck.fail(label, f"{type(e).__name__}: {e}")
    ck.true(time.monotonic() - t0 < LIMIT, label, f"took {time.monotonic() - t0:.1f} s")


if __name__ == "__main__":
    T.run_main(main)
