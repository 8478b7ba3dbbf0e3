"""CUDA tensors through ferrovod.torch on a real GPU, against host references.

usage: gpu_worker.py MODE

Every rank uses GPU ``local_rank % device_count`` (on a one-GPU machine all ranks share it).

MODE ``ops``:
- which path CUDA tensors take (``PATH usable=… why=…``), and, where the NCCL path is usable and
  asked for, that every op takes it (no staging warning) while
  ranks sharing one GPU are told so once and staged;
- allreduce (every op, pre/post scale), grouped allreduce, allgather (ragged rows, a rank with
  none, grouped), broadcast, alltoall (splits, equal split) and reducescatter on the global set
  and on every one-rank process set; a 0-d allgather and splits that exceed the rows refused on
  every rank
  (one-rank sets get NCCL communicators of their own even where ranks share a GPU);
- a DistributedOptimizer step on a CUDA model equal to one process training on the
  concatenated batch;
- stream ordering: an input written on a busy non-default stream right before the op and the
  result read on that stream right after it.

MODE ``kill``: rank 1 kills itself in the middle of a loop of CUDA allreduces; the others
must raise within bounded time (prints ``RANKFAIL elapsed=S``).

Prints ``OK <n_checks>``.
"""

import os
import signal
import sys
import time
import warnings
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.torch as hvd  # noqa: E402
from ferrovod.exceptions import FerrovodError, HorovodInternalError  # noqa: E402
from ferrovod.torch import _cuda  # noqa: E402

TORCH_DTYPES = [torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64]
OPS = [("Sum", hvd.Sum), ("Average", hvd.Average), ("Min", hvd.Min), ("Max", hvd.Max),
       ("Product", hvd.Product)]


def tol(dt):
    return {torch.float16: 1e-2, torch.bfloat16: 4e-2, torch.float32: 1e-5,
            torch.float64: 1e-12}.get(dt, 0.0)


def close(got, want, dt):
    """``got`` (any device) equals the float64 host reference ``want`` cast to ``dt``."""
    g = got.detach().cpu().to(torch.float64)
    w = want.to(dt).to(torch.float64)
    if g.shape != w.shape:
        return False
    return torch.allclose(g, w, rtol=tol(dt), atol=tol(dt))


def inputs(key, n, dt, shape, op_name="Sum"):
    """Every rank's input for case ``key`` as float64 host tensors holding ``dt``'s values
    (small integers for integer and Product cases, so nothing overflows or rounds)."""
    out = []
    for r in range(n):
        g = torch.Generator().manual_seed(zlib.crc32(repr((key, r)).encode()))
        if dt.is_floating_point and op_name != "Product":
            x = torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            lo = 0 if dt == torch.uint8 else -2
            x = torch.randint(lo, 3, shape, generator=g).to(torch.float64)
        out.append(x.to(dt).to(torch.float64))
    return out


def reduce_ref(xs, op_name, dt, n, pre=1.0, post=1.0):
    if op_name in ("Sum", "Average"):
        acc = sum(x * pre for x in xs) * post
        if op_name == "Average":
            acc = acc / n
        if not dt.is_floating_point:
            acc = torch.trunc(acc)
        return acc
    stack = torch.stack(xs)
    return {"Min": stack.min(0).values, "Max": stack.max(0).values,
            "Product": stack.prod(0)}[op_name]


class Run:
    def __init__(self):
        self.rank, self.n = hvd.rank(), hvd.size()
        self.ck = T.Checker(self.rank)
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.case = 0

    def key(self, *parts):
        self.case += 1
        return (self.case,) + parts

    def on_dev(self, x, dt):
        return x.to(dt).to(self.dev)


def collectives(run, ps, label):
    """Every collective on CUDA tensors of ``ps`` (ranks ``members``), against references."""
    ck, dev = run.ck, run.dev
    members = ps.ranks if ps.ranks else list(range(run.n))
    n, me = len(members), members.index(run.rank)
    for dt in TORCH_DTYPES:
        for op_name, op in OPS:
            if op_name == "Average" and not dt.is_floating_point:
                continue
            for shape in ((1,), (1001,), (3, 70_001)):
                k = run.key(label, str(dt), op_name, shape)
                xs = inputs(k, n, dt, shape, op_name)
                x = run.on_dev(xs[me], dt)
                what = f"{label} allreduce {dt} {op_name} {shape}"
                got = hvd.allreduce(x, op=op, name=f"{label}.ar.{run.case}", process_set=ps)
                ck.true(got.device == dev, what, f"result on {got.device}")
                ck.true(close(got, reduce_ref(xs, op_name, dt, n), dt), what, "wrong values")
                ck.true(close(x, xs[me], dt), f"{what}: input untouched", "input changed")
                hvd.allreduce_(x, op=op, process_set=ps)
                ck.true(close(x, reduce_ref(xs, op_name, dt, n), dt), f"{what} in place",
                        "wrong values")
        if dt.is_floating_point:
            k = run.key(label, str(dt), "scaled")
            xs = inputs(k, n, dt, (4097,))
            got = hvd.allreduce(run.on_dev(xs[me], dt), op=hvd.Sum, prescale_factor=0.5,
                                postscale_factor=3.0, process_set=ps)
            ck.true(close(got, reduce_ref(xs, "Sum", dt, n, 0.5, 3.0), dt),
                    f"{label} allreduce {dt} pre 0.5 post 3", "wrong values")
            got = hvd.allreduce(run.on_dev(xs[me], dt), op=hvd.Average, prescale_factor=2.0,
                                process_set=ps)
            ck.true(close(got, reduce_ref(xs, "Average", dt, n, 2.0), dt),
                    f"{label} allreduce {dt} Average pre 2", "wrong values")
        # grouped allreduce: several shapes, one of them empty
        shapes = [(5,), (2, 3), (0,), (40_000,)]
        k = run.key(label, str(dt), "grouped")
        xss = [inputs(k + (i,), n, dt, s) for i, s in enumerate(shapes)]
        outs = hvd.grouped_allreduce([run.on_dev(xs[me], dt) for xs in xss], op=hvd.Sum,
                                     process_set=ps)
        for i, (o, xs) in enumerate(zip(outs, xss)):
            ck.true(close(o, reduce_ref(xs, "Sum", dt, n), dt),
                    f"{label} grouped_allreduce {dt} #{i}", "wrong values")
        # allgather, ragged: member j sends j+1 rows
        k = run.key(label, str(dt), "allgather")
        rows = [inputs(k + (j,), 1, dt, (j + 1, 3))[0] for j in range(n)]
        got = hvd.allgather(run.on_dev(rows[me], dt), process_set=ps)
        ck.true(got.device == dev and close(got, torch.cat(rows), dt),
                f"{label} allgather {dt}", f"wrong values on {got.device}")
        # member j sends j rows (member 0 none), two tensors gathered as one unit
        k = run.key(label, str(dt), "grouped_allgather")
        a = [inputs(k + (j,), 1, dt, (j, 2, 3))[0] for j in range(n)]
        b = [inputs(k + (j, "b"), 1, dt, (2,))[0] for j in range(n)]
        ga, gb = hvd.grouped_allgather([run.on_dev(a[me], dt), run.on_dev(b[me], dt)],
                                       process_set=ps)
        ck.true(ga.device == dev and close(ga, torch.cat(a), dt),
                f"{label} grouped_allgather {dt} (rank 0 sends no rows)", "wrong values")
        ck.true(close(gb, torch.cat(b), dt), f"{label} grouped_allgather {dt} #2",
                "wrong values")
        # broadcast from every root
        for root in members:
            k = run.key(label, str(dt), "broadcast", root)
            xs = inputs(k, n, dt, (3, 1001))
            x = run.on_dev(xs[me], dt)
            got = hvd.broadcast(x, root, process_set=ps)
            ck.true(close(got, xs[members.index(root)], dt),
                    f"{label} broadcast {dt} root {root}", "wrong values")
            hvd.broadcast_(x, root, process_set=ps)
            ck.true(close(x, xs[members.index(root)], dt),
                    f"{label} broadcast_ {dt} root {root}", "wrong values")
        # alltoall with splits: member i sends (i + j) % 3 rows to member j
        k = run.key(label, str(dt), "alltoall")
        sp = [[(i + j) % 3 for j in range(n)] for i in range(n)]
        xs = [inputs(k + (i,), 1, dt, (sum(sp[i]), 2))[0] for i in range(n)]
        offs = [np.concatenate([[0], np.cumsum(s)]).astype(int) for s in sp]
        want = torch.cat([xs[i][offs[i][me]:offs[i][me] + sp[i][me]] for i in range(n)])
        got, received = hvd.alltoall(run.on_dev(xs[me], dt), splits=sp[me], process_set=ps)
        ck.true(close(got, want, dt), f"{label} alltoall {dt}", "wrong values")
        ck.equal(received.tolist(), [sp[i][me] for i in range(n)], f"{label} alltoall received")
        # no splits: an equal share of 2 rows to every member
        k = run.key(label, str(dt), "alltoall_equal")
        xs = [inputs(k + (i,), 1, dt, (2 * n, 5))[0] for i in range(n)]
        got = hvd.alltoall(run.on_dev(xs[me], dt), process_set=ps)
        ck.true(got.device == dev and close(got, torch.cat([x[2 * me:2 * me + 2] for x in xs]),
                                            dt), f"{label} alltoall {dt} equal split",
                "wrong values")
        # reducescatter, rows that divide and rows that do not
        if dt in (torch.uint8, torch.int8):
            continue
        for op_name, op in (("Sum", hvd.Sum), ("Average", hvd.Average)):
            if op_name == "Average" and not dt.is_floating_point:
                continue
            for d0 in (4 * n, 2 * n + 1):
                k = run.key(label, str(dt), "reducescatter", op_name, d0)
                xs = inputs(k, n, dt, (d0, 1000))
                full = reduce_ref(xs, op_name, dt, n)
                base, extra = divmod(d0, n)
                start = me * base + min(me, extra)
                cnt = base + (1 if me < extra else 0)
                got = hvd.reducescatter(run.on_dev(xs[me], dt), op=op, process_set=ps)
                ck.true(close(got, full[start:start + cnt], dt),
                        f"{label} reducescatter {dt} {op_name} rows {d0}", "wrong values")


def optimizer_step(run):
    """One DistributedOptimizer step on every rank's batch equals one plain step on the
    concatenated batch (float64 model on the GPU)."""
    torch.manual_seed(1234)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),  # noqa: E731
                                       torch.nn.Linear(16, 4)).to(run.dev, torch.float64)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    batches = [torch.Generator().manual_seed(77 + r) for r in range(run.n)]
    xs = [torch.randn(6, 8, generator=g, dtype=torch.float64) for g in batches]
    ys = [torch.randn(6, 4, generator=g, dtype=torch.float64) for g in batches]
    for step in range(3):
        opt.zero_grad()
        x, y = xs[run.rank].to(run.dev) * (step + 1), ys[run.rank].to(run.dev)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(torch.cat(xs).to(run.dev) * (step + 1)),
                                     torch.cat(ys).to(run.dev)).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        run.ck.true(p.device == run.dev and torch.allclose(p, q, rtol=1e-10, atol=1e-12),
                    f"DistributedOptimizer {name}", f"max diff {(p - q).abs().max().item()}")


def stream_ordering(run):
    """The op runs after the work on the caller's current stream and its result is there for
    the next work on that stream, with the stream busy and not the default one."""
    s = torch.cuda.Stream(device=run.dev)
    for count in (1 << 10, 1 << 22):
        with torch.cuda.stream(s):
            busy = torch.randn(4096, 4096, device=run.dev)
            for _ in range(30):
                busy = torch.tanh(busy @ busy)
            x = torch.full((count,), float(run.rank + 1), device=run.dev)
            x += busy[0, 0] * 0  # written only once the busy work is done
            hvd.allreduce_(x, op=hvd.Sum, name=f"order.{count}")
            y = x * 2  # read right after, on the same stream
            z = hvd.allreduce(y, op=hvd.Sum, name=f"order2.{count}")
            w = z + 1
        torch.cuda.synchronize()
        total = sum(r + 1 for r in range(run.n))
        run.ck.true(bool((y == 2 * total).all()), f"stream order {count}: written before",
                    f"got {y[:4].tolist()}")
        run.ck.true(bool((w == 2 * total * run.n + 1).all()), f"stream order {count}: read after",
                    f"got {w[:4].tolist()}")


def ops_mode():
    run = Run()
    ck = run.ck
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hvd.allreduce(torch.ones(3, device=run.dev), name="probe")
    usable, why = _cuda._device_path()
    staged = [str(w.message) for w in caught if "host memory" in str(w.message)]
    print(f"PATH usable={usable} why={why} dispatch={os.environ.get('FERROVOD_NCCL_DISPATCH')} "
          f"gpu={torch.cuda.get_device_name(run.dev)} staged_warnings={staged}", flush=True)
    if os.environ.get("GPU_EXPECT_NCCL") == "1":
        ck.true(usable, "NCCL path usable", why)
        ck.true(not staged, "an allreduce takes the NCCL path", f"warned: {staged}")

    sets = [hvd.global_process_set]
    if run.n > 1:
        sets += [hvd.add_process_set([r]) for r in range(run.n)]
    for ps in sets:
        members = ps.ranks if ps.ranks else list(range(run.n))
        if run.rank in members:
            label = "global" if ps is hvd.global_process_set else f"set{members}"
            t0 = time.monotonic()
            before = ck.count
            collectives(run, ps, label)
            print(f"section {label}: {ck.count - before} checks in "
                  f"{time.monotonic() - t0:.1f} s", flush=True)
        hvd.barrier()
    # Refused arguments on the device path fail on every rank, and the ops after them run.
    ck.raises(FerrovodError, lambda: hvd.allgather(torch.tensor(1.0, device=run.dev)),
              "allgather of a 0-d CUDA tensor", contains=("0-d",))
    ck.raises(FerrovodError,
              lambda: hvd.alltoall(torch.ones(3, device=run.dev), splits=[4] * run.n),
              "alltoall whose splits exceed the rows", contains=("split",))
    optimizer_step(run)
    stream_ordering(run)
    print(f"STAGING_WARNINGS {sorted(_cuda._staging_warned)}", flush=True)
    if os.environ.get("GPU_EXPECT_NCCL") == "1":
        staged_kinds = [w for w in _cuda._staging_warned if "ALLGATHER" in w or "ALLTOALL" in w]
        ck.equal(staged_kinds, [], "allgather and alltoall took the NCCL path")
    hvd.shutdown()
    return ck.count


def kill_mode():
    run = Run()
    x = torch.ones(1 << 20, device=run.dev)
    start = None
    for step in range(10_000):
        if step == 5 and run.rank == 1:
            print("killing myself", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # From the op before the kill: rank 1 may die before NCCL's proxy delivered that op's
        # last bytes, and then the survivor's copy of it fails.
        if step == 4:
            start = time.monotonic()
        try:
            hvd.allreduce_(x, op=hvd.Sum, name=f"kill.{step}")
        except HorovodInternalError as e:
            print(f"RANKFAIL elapsed={time.monotonic() - start:.2f} msg={str(e)[:200]!r}",
                  flush=True)
            return 1
    return 1


def main():
    hvd.init(process_sets="dynamic")
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    mode = sys.argv[1]
    if mode == "kill":
        return kill_mode()
    return ops_mode()


if __name__ == "__main__":
    T.run_main(main)
