"""One rank of a job on torch.distributed's ``backend="ferrovod"``, started by torchrun (see
test_process_group.py). Every check compares the ferrovod group's result with a reference
computed here from every rank's inputs (each rank can make any rank's inputs: they are a
function of the rank), and, where gloo has the op, with a gloo group over the same ranks in the
same process. Each rank prints ``rank <r> OK <checks>`` at the end.

Sections (argv[1:], all by default): collectives, subgroups, p2p, objects, ddp, hooks, fsdp, join, lifecycle.
"""

import os
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import ferrovod.torch  # noqa: F401 - registers the backend
from ferrovod.torch import _front

CHECKS = 0
R = dist.ReduceOp


def check(ok, what):
    global CHECKS
    if not ok:
        raise AssertionError(f"rank {dist.get_rank()}: {what}")
    CHECKS += 1


def same(a, b, what, tol=0.0):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    check(a.shape == b.shape and a.dtype == b.dtype,
          f"{what}: {tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}")
    if tol:
        ok = torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(a, b)
    check(ok, f"{what}: got {a.flatten()[:8].tolist()}, want {b.flatten()[:8].tolist()}")


def make(rank, shape, dtype, salt, small=False):
    """Rank ``rank``'s input: small integers (halves for floats), exact in every dtype, so
    sums of 2-3 ranks are exact too; ``small``: values in {1, 2} for products."""
    g = torch.Generator().manual_seed(7919 * salt + rank)
    if small:
        return torch.randint(1, 3, shape, generator=g).to(dtype)
    if dtype == torch.uint8:
        return torch.randint(0, 60, shape, generator=g).to(dtype)
    x = torch.randint(-40, 41, shape, generator=g)
    return (x.to(dtype) / 2) if dtype.is_floating_point else x.to(dtype)


FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]
SHAPES = [(), (1,), (7,), (1023,), (3, 5)]


def np_reduce(xs, op):
    arr = np.stack([x.double().numpy() if x.dtype.is_floating_point else x.numpy().astype(np.int64)
                    for x in xs])
    if op == R.SUM:
        return arr.sum(0)
    if op == R.AVG:
        return arr.mean(0)
    if op == R.MIN:
        return arr.min(0)
    if op == R.MAX:
        return arr.max(0)
    if op == R.PRODUCT:
        return arr.prod(0)
    fn = {R.BAND: np.bitwise_and, R.BOR: np.bitwise_or, R.BXOR: np.bitwise_xor}[op]
    out = arr[0]
    for a in arr[1:]:
        out = fn(out, a)
    return out


def ref(arr, dtype, shape=None):
    """A NumPy result as a tensor of ``dtype`` (0-d results included)."""
    t = torch.from_numpy(np.array(arr, dtype=np.float64 if dtype.is_floating_point else np.int64))
    t = t.to(dtype)
    return t if shape is None else t.reshape(shape)


def tol_of(dtype):
    return {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}.get(
        dtype, 1e-12 if dtype.is_floating_point else 0.0)


def section_collectives(gloo):
    r, n = dist.get_rank(), dist.get_world_size()
    salt = 1
    for dtype in FLOATS + INTS:
        for shape in SHAPES:
            salt += 1
            ops = [R.SUM, R.MIN, R.MAX, R.PRODUCT]
            ops += [R.AVG] if dtype.is_floating_point else [R.BAND, R.BOR, R.BXOR]
            for op in ops:
                small = op == R.PRODUCT
                xs = [make(k, shape, dtype, salt, small) for k in range(n)]
                want = ref(np_reduce(xs, op), dtype, shape)
                t = xs[r].clone()
                dist.all_reduce(t, op=op)
                what = f"all_reduce {op} {dtype} {shape}"
                same(t, want, what, tol_of(dtype) if op == R.AVG else 0.0)
                if op != R.AVG and not (dtype in (torch.float16, torch.bfloat16) and op == R.PRODUCT):
                    g = xs[r].clone()
                    dist.all_reduce(g, op=op, group=gloo)
                    same(t, g, f"{what} against gloo")
            if dtype.is_floating_point:
                # PREMUL_SUM: each rank's tensor times the factor, then summed.
                xs = [make(k, shape, dtype, salt) for k in range(n)]
                t = xs[r].clone()
                dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
                want = ref(np_reduce(xs, R.SUM) * 0.5, dtype, shape)
                same(t, want, f"all_reduce PREMUL_SUM {dtype} {shape}", tol_of(dtype))
            # broadcast from every root
            for root in range(n):
                t = make(r, shape, dtype, salt + 100)
                dist.broadcast(t, src=root)
                same(t, make(root, shape, dtype, salt + 100), f"broadcast from {root} {dtype} {shape}")
            # all_gather, all_gather_into_tensor, gather
            mine = make(r, shape, dtype, salt + 200)
            everyone = [make(k, shape, dtype, salt + 200) for k in range(n)]
            outs = [torch.empty(shape, dtype=dtype) for _ in range(n)]
            dist.all_gather(outs, mine)
            for k in range(n):
                same(outs[k], everyone[k], f"all_gather {dtype} {shape} from {k}")
            flat = torch.empty((n * max(mine.numel(), 1),), dtype=dtype)
            dist.all_gather_into_tensor(flat, mine.reshape(-1) if mine.dim() else mine.reshape(1))
            same(flat, torch.cat([e.reshape(-1) for e in everyone]), f"all_gather_into_tensor {dtype} {shape}")
            for root in range(n):
                got = [torch.empty(shape, dtype=dtype) for _ in range(n)] if r == root else None
                dist.gather(mine, got, dst=root)
                if r == root:
                    for k in range(n):
                        same(got[k], everyone[k], f"gather to {root} {dtype} {shape} from {k}")
            # reduce to each root; the others keep their tensor
            xs = [make(k, shape, dtype, salt + 300) for k in range(n)]
            for root in range(n):
                t = xs[r].clone()
                dist.reduce(t, dst=root, op=R.SUM)
                want = ref(np_reduce(xs, R.SUM), dtype, shape)
                same(t, want if r == root else xs[r], f"reduce to {root} {dtype} {shape}")
        # reduce-scatter and alltoall on a few odd sizes per dtype
        for per in (1, 5, 333):
            salt += 1
            xs = [make(k, (n * per,), dtype, salt) for k in range(n)]
            ops = [R.SUM, R.MAX] + ([R.AVG] if dtype.is_floating_point else [R.BOR])
            for op in ops:
                out = torch.empty(per, dtype=dtype)
                dist.reduce_scatter_tensor(out, xs[r].clone(), op=op)
                whole = ref(np_reduce(xs, op), dtype)
                what = f"reduce_scatter_tensor {op} {dtype} {per}"
                same(out, whole[r * per:(r + 1) * per], what, tol_of(dtype) if op == R.AVG else 0.0)
                if op == R.SUM:
                    out2 = torch.empty(per, dtype=dtype)
                    dist.reduce_scatter(out2, list(xs[r].clone().chunk(n)), op=op)
                    same(out2, out, f"reduce_scatter (list) {dtype} {per}")
                    g = torch.empty(per, dtype=dtype)
                    dist.reduce_scatter_tensor(g, xs[r].clone(), op=op, group=gloo)
                    same(out, g, f"{what} against gloo")
            # all_to_all_single, uneven: rank k sends (j + k) % 3 + per rows of 2 to rank j
            rows = lambda k, j: (j + k) % 3 + per  # noqa: E731
            sends = [rows(r, j) for j in range(n)]
            recvs = [rows(k, r) for k in range(n)]
            inp = make(r, (sum(sends), 2), dtype, salt + 50)
            out = torch.empty((sum(recvs), 2), dtype=dtype)
            dist.all_to_all_single(out, inp, recvs, sends)
            want = []
            for k in range(n):
                theirs = make(k, (sum(rows(k, j) for j in range(n)), 2), dtype, salt + 50)
                start = sum(rows(k, j) for j in range(r))
                want.append(theirs[start:start + rows(k, r)])
            same(out, torch.cat(want), f"all_to_all_single uneven {dtype} {per}")
            g = torch.empty_like(out)
            dist.all_to_all_single(g, inp, recvs, sends, group=gloo)
            same(out, g, f"all_to_all_single {dtype} {per} against gloo")
            # all_to_all of lists, scatter
            ins = [make(r * n + j, (per,), dtype, salt + 60) for j in range(n)]
            outs = [torch.empty(per, dtype=dtype) for _ in range(n)]
            dist.all_to_all(outs, ins)
            for k in range(n):
                same(outs[k], make(k * n + r, (per,), dtype, salt + 60), f"all_to_all {dtype} from {k}")
            for root in range(n):
                out = torch.empty(per, dtype=dtype)
                parts = [make(root * n + j, (per,), dtype, salt + 70) for j in range(n)]
                dist.scatter(out, parts if r == root else None, src=root)
                same(out, parts[r], f"scatter from {root} {dtype} {per}")
    # async ops: work.wait() and the future's value
    t = torch.full((10,), float(r + 1))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    val = fut.wait()
    want = torch.full((10,), float(n * (n + 1) // 2))
    same(val[0], want, "all_reduce future value")
    work.wait()
    same(t, want, "all_reduce async in place")
    works = [dist.all_reduce(torch.full((3,), float(k)), async_op=True) for k in range(20)]
    for w in reversed(works):
        w.wait()
    check(True, "20 async ops waited in reverse order")
    # A small blocking all_reduce of the whole job's group takes the engine's fast path (the
    # ranks share this host). An async one that its rank does not wait for still runs: rank 0
    # waits, through the store, for every other rank's blocking all_reduce of it to finish.
    from ferrovod import _core
    taken = _core.fast_path_stats()[0]
    for k in range(10):
        x = torch.full((3,), float(r + k))
        dist.all_reduce(x)
        same(x, torch.full((3,), float(n * (n - 1) // 2 + n * k)), f"small all_reduce {k}")
    # Not all ten: an op is offered only while no op of the rank's is in the engine, and a
    # peer may still be finishing one of the async ops above when the first is offered.
    check(_core.fast_path_stats()[0] >= taken + 5,
          f"fast path took {_core.fast_path_stats()[0] - taken} of 10 small all_reduces")
    store = dist.distributed_c10d._get_default_store()
    x = torch.full((2,), float(r + 1))
    if r == 0:
        held = dist.all_reduce(x, async_op=True)
        store.wait([f"held/{k}" for k in range(1, n)], timedelta(seconds=60))
        held.wait()
    else:
        dist.all_reduce(x)
        store.set(f"held/{r}", "1")
    same(x, torch.full((2,), float(n * (n + 1) // 2)), "an async all_reduce not waited for")
    chained = dist.all_reduce(torch.ones(4), async_op=True).get_future().then(
        lambda f: f.value()[0] * 2)
    same(chained.wait(), torch.full((4,), 2.0 * n), "a future's then()")
    dist.barrier()
    check(True, "barrier")
    dist.monitored_barrier(wait_all_ranks=True)
    check(True, "monitored_barrier")
    # A sparse COO tensor (as gloo reduces them): rank k has rows 0..k, a dense column each.
    for dtype in (torch.float32, torch.float64):
        def sparse(k):
            idx = torch.arange(k + 1).reshape(1, -1)
            return torch.sparse_coo_tensor(idx, torch.full((k + 1, 2), float(k + 1), dtype=dtype),
                                           (n, 2))
        t = sparse(r)
        dist.all_reduce(t)
        want = sum(sparse(k).to_dense() for k in range(n))
        check(t.is_sparse, "sparse all_reduce keeps the layout")
        same(t.to_dense(), want, f"sparse all_reduce {dtype}")
        dist.all_reduce(g := sparse(r), group=gloo)
        same(t.to_dense(), g.to_dense(), f"sparse all_reduce {dtype} against gloo")
    # torch's profiler shows the backend's ops, as it shows gloo's: one async record each,
    # named ferrovod:<op>, with its inputs' shapes.
    with torch.profiler.profile(record_shapes=True) as prof:
        dist.all_reduce(torch.ones(5, 3))
        dist.broadcast(torch.ones(7), src=0)
        dist.all_gather_into_tensor(torch.empty(2 * n), torch.ones(2))
    events = {e.name: e for e in prof.events() if e.name.startswith("ferrovod:")}
    for name, shape in [("all_reduce", [5, 3]), ("broadcast", [7]),
                        ("all_gather_into_tensor", [2])]:
        e = events.get(f"ferrovod:{name}")
        check(e is not None, f"no profiler event for {name}: {sorted(events)}")
        check(e.is_async and e.count == 1 and e.input_shapes == [shape],
              f"{name}'s event: async {e.is_async}, count {e.count}, shapes {e.input_shapes}")
    # Every time, under the autograd profiler as torch's own suite uses it: a record freed on
    # the caller's thread while the profile still ran once ended there, one op in ten not async.
    not_async = 0
    for _ in range(30):
        with torch.autograd.profiler.profile(record_shapes=True) as ctx:
            dist.broadcast(torch.ones(9), src=0)
        not_async += sum(1 for e in ctx.function_events
                         if e.name == "ferrovod:broadcast" and not e.is_async)
    check(not_async == 0, f"{not_async} of 30 profiled broadcasts recorded as not async")


def section_subgroups():
    """Groups over some ranks (new_group, new_subgroups_by_enumeration): each rank's ops on
    its groups against NumPy and a gloo group over the same ranks; a rank outside a group
    never calls it. A second group over the same ranks shares the engine's set."""
    r, n = dist.get_rank(), dist.get_world_size()
    layouts = [[0, n - 1], [r for r in range(n) if r not in (0, n - 1)] or [0]]
    ours = [dist.new_group(ranks) for ranks in layouts]
    theirs = [dist.new_group(ranks, backend="gloo") for ranks in layouts]
    again = dist.new_group(layouts[0])
    mine_sub, _ = dist.new_subgroups_by_enumeration([[k] for k in range(n)])
    for ranks, g, gl in zip(layouts, ours, theirs):
        if r not in ranks:
            continue
        m = len(ranks)
        check(dist.get_world_size(g) == m and dist.get_rank(g) == ranks.index(r), f"group {ranks}")
        for dtype in (torch.float32, torch.int64):
            salt = 900 + len(ranks)
            xs = {k: make(k, (11,), dtype, salt) for k in ranks}
            t = xs[r].clone()
            dist.all_reduce(t, group=g)
            same(t, ref(np_reduce([xs[k] for k in ranks], R.SUM), dtype), f"all_reduce on {ranks} {dtype}")
            u = xs[r].clone()
            dist.all_reduce(u, group=gl)
            same(t, u, f"all_reduce on {ranks} {dtype} against gloo")
            for src in ranks:
                b = make(r, (5,), dtype, salt + 1)
                dist.broadcast(b, src=src, group=g)
                same(b, make(src, (5,), dtype, salt + 1), f"broadcast from {src} on {ranks}")
            outs = [torch.empty(4, dtype=dtype) for _ in ranks]
            dist.all_gather(outs, make(r, (4,), dtype, salt + 2), group=g)
            for i, k in enumerate(ranks):
                same(outs[i], make(k, (4,), dtype, salt + 2), f"all_gather on {ranks} from {k}")
            full = [make(k, (3 * m,), dtype, salt + 3) for k in ranks]
            out = torch.empty(3, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[ranks.index(r)].clone(), group=g)
            whole = ref(np_reduce(full, R.SUM), dtype)
            i = ranks.index(r)
            same(out, whole[3 * i:3 * i + 3], f"reduce_scatter_tensor on {ranks}")
            dst = ranks[-1]
            red = xs[r].clone()
            dist.reduce(red, dst=dst, group=g)
            same(red, ref(np_reduce([xs[k] for k in ranks], R.SUM), dtype) if r == dst else xs[r],
                 f"reduce to {dst} on {ranks}")
    if r in layouts[0]:
        t = torch.full((2,), float(r))
        dist.all_reduce(t, group=again)
        same(t, torch.full((2,), float(sum(layouts[0]))), "a second group over the same ranks")
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t, group=mine_sub)
    same(t, torch.full((3,), float(r + 1)), "a group of one rank")
    dist.barrier()


def section_p2p():
    """send/recv, isend/irecv and batch_isend_irecv: a ring, tags received in another order
    than sent, a rank that sends before an allreduce its peer runs before receiving, and
    messages of several dtypes and shapes, each checked against what the sender made."""
    r, n = dist.get_rank(), dist.get_world_size()
    nxt, prv = (r + 1) % n, (r - 1) % n
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        out = make(r, (6, 3), dtype, 501)
        got = torch.empty((6, 3), dtype=dtype)
        ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, got, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        same(got, make(prv, (6, 3), dtype, 501), f"batch_isend_irecv ring {dtype}")
    # Ring with plain isend/irecv, several rounds; the last one of an odd size larger than a
    # shared-memory ring (1 MiB), so that it wraps and waits for its reader.
    for k, size in enumerate((1000, 1001, 1002, (1 << 20) + 3)):
        got = torch.empty(size)
        s = dist.isend(make(r, (size,), torch.float32, 510 + k), nxt)
        w = dist.irecv(got, prv)
        w.wait()
        s.wait()
        if _front.backend_class() is not None:  # torch asks a backend in Python nothing more
            check(w.is_completed() and s.is_completed(), f"is_completed after wait, round {k}")
        same(got, make(prv, (size,), torch.float32, 510 + k), f"isend/irecv ring round {k}")
    # Tags: 0 sends tag 1, then tag 2; 1 receives tag 2 first.
    if r == 0:
        a = dist.isend(torch.full((3,), 1.0), 1, tag=1)
        b = dist.isend(torch.full((5,), 2.0), 1, tag=2)
        a.wait()
        b.wait()
        check(True, "isend of two tags")
    elif r == 1:
        two, one = torch.empty(5), torch.empty(3)
        w2 = dist.irecv(two, 0, tag=2)
        w1 = dist.irecv(one, 0, tag=1)
        w2.wait()
        w1.wait()
        same(one, torch.full((3,), 1.0), "tag 1 received second")
        same(two, torch.full((5,), 2.0), "tag 2 received first")
    # The sender's isend must not wait for its peer, busy in an allreduce it needs first.
    t = torch.ones(2)
    if r == 0:
        w = dist.isend(torch.arange(4.0), n - 1, tag=7)
        dist.all_reduce(t)
        w.wait()
    elif r == n - 1:
        dist.all_reduce(t)
        got = torch.empty(4)
        dist.recv(got, 0, tag=7)
        same(got, torch.arange(4.0), "recv after the allreduce the sender ran later")
    else:
        dist.all_reduce(t)
    same(t, torch.full((2,), float(n)), "the allreduce between them")
    # Blocking send/recv from rank 0 to every other rank.
    for k in range(1, n):
        if r == 0:
            dist.send(make(k, (k + 2,), torch.int32, 520), k)
        elif r == k:
            got = torch.empty(k + 2, dtype=torch.int32)
            dist.recv(got, 0)
            same(got, make(k, (k + 2,), torch.int32, 520), f"send/recv 0 -> {k}")
    # Receives from any source need the backend's C++ half, which needs a compiler
    # (test_process_group.py checks the refusal without it).
    if _front.backend_class() is not None:
        any_source(r, n)
    dist.barrier()


def any_source(r, n):
    """Every other rank sends rank 0 two messages of tag 9 (after a receive of tag 9 from a
    named rank that rank 0 posts first), and rank 0 takes them in whatever order they come,
    recv and irecv, saying who sent each."""
    if r == 0:
        named = torch.empty(2)
        dist.recv(named, n - 1, tag=9)
        same(named, torch.full((2,), float(n - 1)), "the named receive before the any-source")
        seen = []
        for k in range(2 * (n - 1) - 1):
            got = torch.empty(2)
            if k % 2:
                w = dist.irecv(got, tag=9)
                w.wait()
                src = w._source_rank()
            else:
                src = dist.recv(got, tag=9)
            check(src in range(1, n), f"any-source receive {k}: from {src}")
            same(got, torch.full((2,), float(src)), f"any-source receive {k} from {src}")
            seen.append(src)
        expected = sorted(k for k in range(1, n) for _ in range(2))
        expected.remove(n - 1)
        check(sorted(seen) == expected, f"any-source senders {seen}, not {expected}")
    else:
        ws = [dist.isend(torch.full((2,), float(r)), 0, tag=9) for _ in range(2)]
        for w in ws:
            w.wait()


def section_objects():
    r, n = dist.get_rank(), dist.get_world_size()
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "data": list(range(r))})
    check(objs == [{"rank": k, "data": list(range(k))} for k in range(n)], f"all_gather_object {objs}")
    box = [{"from": 0, "x": [1, 2, 3]}] if r == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    check(box == [{"from": 0, "x": [1, 2, 3]}], f"broadcast_object_list {box}")
    got = [None] * n if r == n - 1 else None
    dist.gather_object(("r", r), got, dst=n - 1)
    if r == n - 1:
        check(got == [("r", k) for k in range(n)], f"gather_object {got}")
    out = [None]
    dist.scatter_object_list(out, [f"to {k}" for k in range(n)] if r == 0 else None, src=0)
    check(out == [f"to {r}"], f"scatter_object_list {out}")


class Net(nn.Module):
    """Two heads, one of them unused on odd steps (find_unused_parameters)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.body = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.head_a = nn.Linear(32, 3)
        self.head_b = nn.Linear(32, 3)

    def forward(self, x, use_b=True):
        h = self.body(x)
        return self.head_a(h) + (self.head_b(h) if use_b else 0)


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)


def train(group, steps, unused=False, accumulate=0, bucket_mb=25.0, static=False, hook=None,
          hook_state=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    r = dist.get_rank()
    model = DDP(Net(), process_group=group, find_unused_parameters=unused,
                bucket_cap_mb=bucket_mb, static_graph=static)
    if hook is not None:
        model.register_comm_hook(hook_state(group) if hook_state else group, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    grads = []
    for step in range(steps):
        x, y = batch(step, r)
        use_b = not (unused and step % 2)
        if accumulate and step % accumulate:
            with model.no_sync():
                nn.functional.cross_entropy(model(x, use_b), y).backward()
            continue
        nn.functional.cross_entropy(model(x, use_b), y).backward()
        grads.append([p.grad.clone() if p.grad is not None else None for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], grads


def compare_runs(a, b, what, tol):
    (wa, ga), (wb, gb) = a, b
    for i, (x, y) in enumerate(zip(wa, wb)):
        same(x, y, f"{what}: weight {i}", tol)
    for s, (sa, sb) in enumerate(zip(ga, gb)):
        for i, (x, y) in enumerate(zip(sa, sb)):
            check((x is None) == (y is None), f"{what}: step {s} grad {i} presence")
            if x is not None:
                same(x, y, f"{what}: step {s} grad {i}", tol)


def section_ddp(gloo):
    tol = 1e-6
    for kwargs in [dict(), dict(bucket_mb=0.001), dict(unused=True), dict(accumulate=2),
                   dict(static=True), dict(bucket_mb=0.01, unused=True, accumulate=3)]:
        ours = train(None, 6, **kwargs)
        theirs = train(gloo, 6, **kwargs)
        compare_runs(ours, theirs, f"DDP {kwargs}", tol)


def section_hooks(gloo):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    for name, hook, state in [
        ("fp16", dh.fp16_compress_hook, None),
        ("bf16", dh.bf16_compress_hook, None),
        ("allreduce", dh.allreduce_hook, None),
        ("powerSGD", ps.powerSGD_hook,
         lambda g: ps.PowerSGDState(process_group=g, matrix_approximation_rank=2,
                                    start_powerSGD_iter=2, random_seed=3)),
    ]:
        ours = train(None, 5, hook=hook, hook_state=state)
        theirs = train(gloo, 5, hook=hook, hook_state=state)
        compare_runs(ours, theirs, f"DDP with the {name} hook", 1e-3 if name != "allreduce" else 1e-6)


def section_fsdp():
    """FSDP2 (fully_shard over a 1-D device mesh on the CPU) equal to one process training the
    same model on the whole batch: parameters all-gathered, gradients reduce-scattered."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    r, n = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7), nn.ReLU(), nn.Linear(7, 4))
    ref = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 7), nn.ReLU(), nn.Linear(7, 4))
    ref.load_state_dict(model.state_dict())
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    per = 5
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(per * n, 16, generator=g), torch.randn(per * n, 4, generator=g)
        mine = slice(r * per, (r + 1) * per)
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    for k, v in ref.state_dict().items():
        same(full[k], v, f"FSDP2 {k} after 5 steps", 1e-5)


def section_join():
    """Uneven inputs with Join: rank r has 3 + r batches; DDP's joined ranks shadow the others'
    allreduces, so the weights equal one process stepping on the same batches it got (the
    ranks that still have data), computed here for every step."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    r, n = dist.get_rank(), dist.get_world_size()
    model = DDP(Net())
    ref = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with Join([model]):
        for step in range(3 + r):
            x, y = batch(step, r)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for step in range(3 + n - 1):
        live = [k for k in range(n) if step < 3 + k]
        for k in live:
            x, y = batch(step, k)
            # DDP averages over every rank, joined ones giving zeros.
            (nn.functional.cross_entropy(ref(x), y) / n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for i, (a, b) in enumerate(zip(model.parameters(), ref.parameters())):
        same(a.detach(), b.detach(), f"Join: weight {i}", 1e-5)


def section_lifecycle():
    """destroy_process_group, then a new init_process_group in the same processes."""
    r, n = dist.get_rank(), dist.get_world_size()
    for again in range(2):
        dist.destroy_process_group()
        dist.init_process_group("ferrovod")
        t = torch.full((4,), float(r))
        dist.all_reduce(t)
        same(t, torch.full((4,), float(n * (n - 1) // 2)), f"all_reduce after re-init {again}")
        ring_p2p(f"p2p after re-init {again}")
    # An engine ferrovod.init() started, which the group reuses and leaves running; then a new
    # one: point-to-point pairs registered with the first must not be used with the second.
    for again in range(2):
        dist.destroy_process_group()
        ferrovod.torch.init()
        dist.init_process_group("ferrovod")
        ring_p2p(f"p2p over ferrovod.init()'s engine {again}")
        dist.destroy_process_group()
        check(ferrovod.torch.is_initialized(), "the group left ferrovod.init()'s engine running")
        ferrovod.torch.shutdown()
        dist.init_process_group("ferrovod")


def ring_p2p(what):
    """Each rank sends its rank to the next and receives the previous one's."""
    r, n = dist.get_rank(), dist.get_world_size()
    got = torch.zeros(3)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(r)), (r + 1) % n),
                                   dist.P2POp(dist.irecv, got, (r - 1) % n)])
    for q in reqs:
        q.wait()
    same(got, torch.full((3,), float((r - 1) % n)), what)


def main():
    sections = sys.argv[1:] or ["collectives", "subgroups", "p2p", "objects", "ddp", "hooks",
                                "fsdp", "join", "lifecycle"]
    dist.init_process_group("ferrovod")
    check(dist.get_backend() == "ferrovod", f"backend {dist.get_backend()}")
    check(dist.get_rank() == int(os.environ["RANK"]), "rank from torchrun")
    if "FERROVOD_RANK" in os.environ:
        # Started by ferrovodrun: torch's env:// joined the store the launcher holds.
        check(dist.get_rank() == int(os.environ["FERROVOD_RANK"]), "rank from ferrovodrun")
        check(dist.get_world_size() == int(os.environ["FERROVOD_SIZE"]), "size from ferrovodrun")
    gloo = dist.new_group(backend="gloo")
    for s in sections:
        if s == "collectives":
            section_collectives(gloo)
        elif s == "subgroups":
            section_subgroups()
        elif s == "p2p":
            section_p2p()
        elif s == "objects":
            section_objects()
        elif s == "ddp":
            section_ddp(gloo)
        elif s == "hooks":
            section_hooks(gloo)
        elif s == "fsdp":
            section_fsdp()
        elif s == "join":
            section_join()
        elif s == "lifecycle":
            section_lifecycle()
            gloo = None
        print(f"rank {dist.get_rank()} section {s}: {CHECKS}", flush=True)
    r = dist.get_rank()
    dist.destroy_process_group()
    print(f"rank {r} OK {CHECKS}", flush=True)


if __name__ == "__main__":
    main()
