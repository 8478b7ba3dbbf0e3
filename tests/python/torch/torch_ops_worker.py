"""ferrovod.torch ops and their gradients against NumPy references, in one launch.

usage: torch_ops_worker.py SEED [DEVICE]

DEVICE (default ``cpu``) is where every input lives: ``cuda`` puts each rank's tensors on GPU
``local_rank % device_count`` (scripts/gpu_tests.sh runs it so); the references stay NumPy on
the host. Every rank regenerates every rank's input from the seed (fvtest.gen), so the expected values
never go through ferrovod. Sections: allreduce, grouped, allgather, broadcast, alltoall,
reducescatter, misc, autograd. Prints ``OK <n_checks>``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fvtest as T  # noqa: E402
from fvtest import AVERAGE, MAX, MIN, PRODUCT, SUM  # noqa: E402

import ferrovod.torch as hvd  # noqa: E402
from ferrovod.torch import ops  # noqa: E402

OPS = {SUM: hvd.Sum, AVERAGE: hvd.Average, MIN: hvd.Min, MAX: hvd.Max, PRODUCT: hvd.Product}
SHAPES = [(), (0,), (7,), (3, 5)]
DEVICE = torch.device("cpu")  # set by main() from the command line


def to_torch(a):
    """A torch tensor with ``a``'s dtype (bfloat16 through its bits: torch cannot import it)."""
    a = np.ascontiguousarray(a).reshape(np.shape(a))
    if a.dtype == T.BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(a.copy()).to(DEVICE)


def to_numpy(t, dt):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(T.BF16)
    out = t.numpy()
    if out.dtype != dt:
        raise AssertionError(f"result dtype {t.dtype} does not match {dt}")
    return out


class Ctx(T.Cases):
    def __init__(self, seed):
        super().__init__(seed, hvd.rank(), hvd.size())

    def tensor(self, got, exp, what, like=None):
        """``got`` must be a torch tensor equal to the NumPy ``exp`` (dtype, shape, values)."""
        self.ck.true(isinstance(got, torch.Tensor), what, f"result is {type(got).__name__}")
        if isinstance(got, torch.Tensor):
            self.ck.equal(got.device, DEVICE, f"{what}: device")
        if like is not None:
            self.ck.equal(got.dtype, like.dtype, f"{what}: dtype")
        self.ck.array(to_numpy(got, np.dtype(exp.dtype)), exp, what)


def noncontig(t):
    """A non-contiguous tensor with ``t``'s values and shape (a strided view of a larger one)."""
    if t.dim() == 0:
        return t.clone()
    big = torch.zeros((t.shape[0] * 2,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    v = big[::2]
    v.copy_(t)
    return v


# ---------------------------------------------------------------------------------------------
def sec_allreduce(c):
    for dt in T.REDUCE_DTYPES:
        for opn in T.REDUCE_OPS:
            for shape in SHAPES:
                k = c.key()
                xs = c.inputs(k, dt, shape, T.input_mode(opn, dt))
                exp = T.ref_reduce(xs, opn, dt, c.n)
                x = to_torch(xs[c.rank])
                what = f"allreduce {dt} {opn} {shape}"
                out = hvd.allreduce(x, op=OPS[opn], name=f"ar.{k[1]}")
                c.tensor(out, exp, what, like=x)
                c.tensor(x, xs[c.rank], f"{what}: input untouched")
                # in place, zero-copy: the same tensor object and storage come back
                ptr = x.data_ptr()
                got = hvd.allreduce_(x, op=OPS[opn])
                c.ck.true(got is x and x.data_ptr() == ptr, f"{what} in place: same tensor")
                c.tensor(x, exp, f"{what} in place")
                if opn == SUM:
                    # non-contiguous, blocking in place: the general path, written back
                    v = noncontig(to_torch(xs[c.rank]))
                    c.ck.true(hvd.allreduce_(v, op=hvd.Sum) is v,
                              f"{what} non-contiguous in place: same tensor")
                    c.tensor(v, exp, f"{what} non-contiguous in place")
                # non-contiguous, async in place: written back through the strided view
                v = noncontig(to_torch(xs[c.rank]))
                h = hvd.allreduce_async_(v, op=OPS[opn])
                c.ck.true(isinstance(h, int), f"{what}: handle is an int")
                c.ck.true(hvd.synchronize(h) is v, f"{what}: async_ returns the tensor")
                c.tensor(v, exp, f"{what} non-contiguous async_")
    # deprecated average=, scale factors
    for dt in (np.float32, np.float64, T.BF16):
        k = c.key()
        xs = c.inputs(k, dt, (9,))
        exp = T.ref_reduce(xs, SUM, dt, c.n, pre=0.5, post=3.0)
        c.tensor(hvd.allreduce(to_torch(xs[c.rank]), average=False, prescale_factor=0.5,
                               postscale_factor=3.0), exp, f"allreduce {dt} scaled")
        exp = T.ref_reduce(xs, AVERAGE, dt, c.n)
        c.tensor(hvd.synchronize(hvd.allreduce_async(to_torch(xs[c.rank]), average=True)), exp,
                 f"allreduce_async {dt} average=True")
    c.ck.raises(ValueError, lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum),
                "average and op together")
    # in place into a leaf that requires grad, unnamed, with the factors and average= given
    # as NumPy scalars; then the arguments the engine declines, refused by name
    k = c.key()
    xs = c.inputs(k, np.float32, (6,))
    w = torch.tensor(xs[c.rank], requires_grad=True)
    got = hvd.allreduce_(w, average=np.bool_(False), prescale_factor=np.float32(0.5),
                         postscale_factor=np.float64(3.0))
    c.ck.true(got is w, "allreduce_ of a leaf that requires grad: same tensor")
    c.tensor(w.detach(), T.ref_reduce(xs, SUM, np.float32, c.n, pre=0.5, post=3.0),
             "allreduce_ of a leaf that requires grad, scaled")
    for bad in (True, "sum", 99):
        c.ck.raises(ValueError, lambda: hvd.allreduce_(torch.ones(2), op=bad),
                    f"allreduce_ op={bad!r}", contains=("not a reduction",))
    c.ck.raises(ValueError, lambda: hvd.allreduce_(torch.ones(2), average=True, op=hvd.Sum),
                "allreduce_ with average and op together")


def sec_grouped(c):
    for dt in (np.int32, np.float16, T.BF16, np.float32, np.float64):
        k = c.key()
        shapes = [(5,), (2, 3), (), (0,)]
        xs = [[T.gen(k + (i,), j, dt, s, T.input_mode(SUM, dt), c.n) for j in range(c.n)]
              for i, s in enumerate(shapes)]
        exps = [T.ref_reduce(x, SUM, dt, c.n) for x in xs]
        ts = [to_torch(x[c.rank]) for x in xs]
        outs = hvd.grouped_allreduce(ts, op=hvd.Sum)
        for i, (o, e) in enumerate(zip(outs, exps)):
            c.tensor(o, e, f"grouped_allreduce {dt} #{i}")
        ts2 = [noncontig(t) for t in ts]
        got = hvd.synchronize(hvd.grouped_allreduce_async_(ts2, op=hvd.Sum))
        for i, (g, t, e) in enumerate(zip(got, ts2, exps)):
            c.ck.true(g is t, f"grouped_allreduce_async_ {dt} #{i}: same tensor")
            c.tensor(t, e, f"grouped_allreduce_async_ {dt} #{i}")
        got = hvd.grouped_allreduce_([to_torch(x[c.rank]) for x in xs], op=hvd.Sum)
        for i, (g, e) in enumerate(zip(got, exps)):
            c.tensor(g, e, f"grouped_allreduce_ {dt} #{i}")


def gather_inputs(c, k, dt, tail):
    return [T.gen(k, j, dt, (j + 1,) + tail) for j in range(c.n)]


def sec_allgather(c):
    for dt in T.ALL_DTYPES:
        for tail in [(), (3, 2)]:
            k = c.key()
            xs = gather_inputs(c, k, dt, tail)
            exp = np.concatenate(xs)
            x = to_torch(xs[c.rank])
            c.tensor(hvd.allgather(x), exp, f"allgather {dt} {tail}", like=x)
            c.tensor(hvd.synchronize(hvd.allgather_async(noncontig(x))), exp,
                     f"allgather_async non-contiguous {dt} {tail}")
        k = c.key()
        a, b = gather_inputs(c, k, dt, (2,)), gather_inputs(c, k + (1,), dt, ())
        outs = hvd.grouped_allgather([to_torch(a[c.rank]), to_torch(b[c.rank])])
        c.tensor(outs[0], np.concatenate(a), f"grouped_allgather {dt} #0")
        c.tensor(outs[1], np.concatenate(b), f"grouped_allgather {dt} #1")
    c.ck.raises(ValueError, lambda: hvd.allgather(torch.tensor(1.0)), "allgather of a 0-d tensor")


def sec_broadcast(c):
    for dt in T.ALL_DTYPES:
        for root in range(c.n):
            k = c.key()
            xs = c.inputs(k, dt, (4, 3))
            x = to_torch(xs[c.rank])
            c.tensor(hvd.broadcast(x, root), xs[root], f"broadcast {dt} root {root}", like=x)
            c.tensor(x, xs[c.rank], f"broadcast {dt}: input untouched")
            v = to_torch(xs[c.rank]).t()  # non-contiguous in-place
            c.ck.true(hvd.broadcast_(v, root) is v, f"broadcast_ {dt}: same tensor")
            c.tensor(v, xs[root].T, f"broadcast_ non-contiguous {dt} root {root}")
            h = hvd.broadcast_async_(x, root)
            hvd.synchronize(h)
            c.tensor(x, xs[root], f"broadcast_async_ {dt} root {root}")
    c.ck.raises(ValueError, lambda: hvd.broadcast(torch.ones(1), c.n), "broadcast root out of range")


def sec_alltoall(c):
    n = c.n
    for dt in T.ALL_DTYPES:
        k = c.key()
        sp = [[(i + 2 * j + k[1]) % 3 for j in range(n)] for i in range(n)]  # rank i -> rank j
        xs = [T.gen(k, i, dt, (sum(sp[i]), 2)) for i in range(n)]
        offs = [np.concatenate([[0], np.cumsum(s)]) for s in sp]
        exp = np.concatenate([xs[i][offs[i][c.rank]:offs[i][c.rank] + sp[i][c.rank]]
                              for i in range(n)])
        x = to_torch(xs[c.rank])
        out, received = hvd.alltoall(x, splits=torch.tensor(sp[c.rank], dtype=torch.int32))
        c.tensor(out, exp, f"alltoall {dt}", like=x)
        c.ck.equal(received.tolist(), [sp[i][c.rank] for i in range(n)], f"alltoall {dt} received")
        c.ck.equal(received.dtype, torch.int32, "received splits dtype")
        out, _ = hvd.synchronize(hvd.alltoall_async(x, splits=sp[c.rank]))
        c.tensor(out, exp, f"alltoall_async {dt} list splits")
        k = c.key()
        xs = c.inputs(k, dt, (2 * n, 3))
        exp = np.concatenate([xs[i][2 * c.rank:2 * c.rank + 2] for i in range(n)])
        c.tensor(hvd.alltoall(to_torch(xs[c.rank])), exp, f"alltoall {dt} equal split")


def sec_reducescatter(c):
    n = c.n
    for dt in T.REDUCE_DTYPES:
        for opn in (SUM, AVERAGE):
            for d0 in (2 * n + 1, n):
                k = c.key()
                xs = c.inputs(k, dt, (d0, 3), T.input_mode(opn, dt))
                full = T.ref_reduce(xs, opn, dt, n)
                s, cnt = T.split_rows(d0, n)[c.rank]
                x = to_torch(xs[c.rank])
                out = hvd.reducescatter(x, op=OPS[opn])
                c.tensor(out, full[s:s + cnt], f"reducescatter {dt} {opn} {d0}", like=x)
                out = hvd.synchronize(hvd.reducescatter_async(noncontig(x), op=OPS[opn]))
                c.tensor(out, full[s:s + cnt], f"reducescatter_async non-contiguous {dt} {opn}")
    for dt in (np.float32, T.BF16):
        k = c.key()
        xs = c.inputs(k, dt, (2 * n, 2))
        ys = c.inputs(k + (1,), dt, (n + 1,))
        ex = T.ref_reduce(xs, SUM, dt, n, pre=2.0, post=0.25)
        ey = T.ref_reduce(ys, SUM, dt, n, pre=2.0, post=0.25)
        outs = hvd.grouped_reducescatter([to_torch(xs[c.rank]), to_torch(ys[c.rank])],
                                         op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
        s, cnt = T.split_rows(2 * n, n)[c.rank]
        c.tensor(outs[0], ex[s:s + cnt], f"grouped_reducescatter {dt} #0")
        s, cnt = T.split_rows(n + 1, n)[c.rank]
        c.tensor(outs[1], ey[s:s + cnt], f"grouped_reducescatter {dt} #1")
    c.ck.raises(ValueError, lambda: hvd.reducescatter(torch.ones(n), op=hvd.Max),
                "reducescatter Max", contains=("AVERAGE",))


def sec_inplace(c):
    """The sharded optimizer's in-place reducescatter and allgather (``ops._*_in_place_async``):
    the share lands in the caller's tensor, the gathered rows too, every dtype, odd and tiny
    row counts (fewer rows than ranks: empty shares), rows of several elements, large enough
    for the ring as well as the direct exchange. They take host tensors only (the sharded
    optimizer keeps its shards in host memory): a CUDA tensor is a clear error."""
    n = c.n
    if DEVICE.type == "cuda":
        for fn in (lambda: ops._reducescatter_in_place_async(to_torch(np.ones((n, 2))), "x", hvd.Sum),
                   lambda: ops._allgather_in_place_async(to_torch(np.ones((n, 2))), "y")):
            c.ck.raises(ValueError, fn, "in-place op of a CUDA tensor", contains=("CPU tensor",))
        return
    for dt in T.REDUCE_DTYPES + [T.BF16]:
        # Scale factors on floats (integers truncate at each scaling: see fvtest.ref_reduce).
        pre, post = (2.0, 0.5) if T.is_float(np.dtype(dt)) else (1.0, 1.0)
        for opn in (SUM, AVERAGE):
            for shape in ((2 * n + 1, 3), (n - 1 if n > 1 else 1,), (300_001,)):
                k = c.key()
                xs = c.inputs(k, dt, shape, T.input_mode(opn, dt))
                full = T.ref_reduce(xs, opn, dt, n, pre=pre, post=post)
                s, cnt = T.split_rows(shape[0], n)[c.rank]
                x = to_torch(xs[c.rank]).clone()
                share = hvd.synchronize(ops._reducescatter_in_place_async(
                    x, f"inplace.rs.{k}", OPS[opn], prescale_factor=pre, postscale_factor=post))
                what = f"in-place reducescatter {dt} {opn} {shape}"
                c.tensor(share, full[s:s + cnt], what, like=x)
                c.ck.true(cnt == 0 or share.data_ptr() == x[s:].data_ptr(), what,
                          "the share is not a view of the input")
                c.tensor(x[s:s + cnt], full[s:s + cnt], f"{what}: in the input's rows")
    for dt in T.ALL_DTYPES + [T.BF16]:
        for shape in ((2 * n + 1, 2), (n - 1 if n > 1 else 1,), (1_000_003,)):
            k = c.key()
            xs = c.inputs(k, dt, shape)
            exp = np.concatenate([xs[r][a:a + m] for r, (a, m) in enumerate(T.split_rows(shape[0], n))])
            s, cnt = T.split_rows(shape[0], n)[c.rank]
            x = torch.zeros(shape, dtype=to_torch(xs[c.rank]).dtype, device=DEVICE)
            x[s:s + cnt] = to_torch(xs[c.rank])[s:s + cnt]
            got = hvd.synchronize(ops._allgather_in_place_async(x, f"inplace.ag.{k}"))
            c.ck.true(got is x, f"in-place allgather {dt} {shape}", "result is not the tensor")
            c.tensor(x, exp, f"in-place allgather {dt} {shape}")
    c.ck.raises(ValueError, lambda: ops._reducescatter_in_place_async(torch.ones(3)[::2], "x", hvd.Sum),
                "in-place reducescatter of a strided view", contains=("contiguous",))
    c.ck.raises(ValueError, lambda: ops._allgather_in_place_async(torch.tensor(1.0), "x"),
                "in-place allgather of a 0-d tensor", contains=("dimension",))


def sec_misc(c):
    ck = c.ck
    ck.raises(ValueError, lambda: hvd.allreduce(torch.ones(2, dtype=torch.complex64)),
              "complex dtype", contains=("complex64",))
    ck.raises(ValueError, lambda: hvd.allreduce(torch.ones(2).to_sparse()), "sparse input")
    h = hvd.allreduce_async(torch.full((3,), float(c.rank)), op=hvd.Max)
    import time
    while not hvd.poll(h):
        time.sleep(0.0005)
    ck.array(hvd.synchronize(h).numpy(), np.full(3, c.n - 1, np.float32), "poll then synchronize")
    ck.raises(ValueError, lambda: hvd.synchronize(h), "synchronize twice")
    hvd.barrier()
    obj = hvd.broadcast_object({"r": c.rank, "t": torch.arange(3)}, root_rank=c.n - 1)
    ck.equal(obj["r"], c.n - 1, "broadcast_object")
    ck.equal(hvd.allgather_object(c.rank * 10), [r * 10 for r in range(c.n)], "allgather_object")
    # sparse allreduce: duplicates across ranks are summed, Average divides by the set size
    k = c.key()
    dense = [T.gen(k, j, np.float32, (6, 2)) * (T.gen(k + (1,), j, np.int32, (6, 1), "tiny") > 0)
             for j in range(c.n)]
    sp = to_torch(dense[c.rank]).to_sparse()
    got = hvd.synchronize(hvd.sparse_allreduce_async(sp, name="sparse.k", op=hvd.Average))
    ck.true(got.is_sparse, "sparse allreduce returns a sparse tensor")
    ck.array(got.to_dense().cpu().numpy(), (np.sum(dense, 0) / c.n).astype(np.float32),
             "sparse allreduce Average")
    import ferrovod.torch.mpi_ops as mpi_ops
    ck.equal(mpi_ops.allreduce_async_ is hvd.allreduce_async_, True, "mpi_ops alias")
    ck.equal(mpi_ops.is_homogeneous(), True, "mpi_ops.is_homogeneous")


# ----------------------------------------------------------------------------- autograd
def sec_autograd(c):
    n, r = c.n, c.rank
    f64 = np.float64

    def leaf(a):
        return torch.tensor(a, dtype=torch.float64, device=DEVICE, requires_grad=True)

    # allreduce: L_j = sum(w_j * out_j); d(sum_j L_j)/dx = pre*post*sum_j w_j (/n for Average)
    for opn, scale in ((SUM, 1.0), (AVERAGE, 1.0 / n)):
        k = c.key()
        xs, ws = c.inputs(k, f64, (4, 3)), c.inputs(k + (1,), f64, (4, 3))
        x = leaf(xs[r])
        out = hvd.allreduce(x, op=OPS[opn], prescale_factor=2.0, postscale_factor=0.5)
        (out * to_torch(ws[r])).sum().backward()
        c.ck.array(x.grad.cpu().numpy(), np.sum(ws, 0) * scale, f"allreduce grad {opn}")
    k = c.key()
    xs = [c.inputs(k + (i,), f64, (3,)) for i in range(2)]
    ws = [c.inputs(k + (5 + i,), f64, (3,)) for i in range(2)]
    leaves = [leaf(x[r]) for x in xs]
    outs = hvd.grouped_allreduce(leaves, op=hvd.Sum)
    sum(((o * to_torch(w[r])).sum() for o, w in zip(outs, ws))).backward()
    for i in range(2):
        c.ck.array(leaves[i].grad.cpu().numpy(), np.sum(ws[i], 0), f"grouped_allreduce grad #{i}")
    # allgather: rank j has j+1 rows; grad = mean over ranks of w, rows of this rank
    k = c.key()
    xs = gather_inputs(c, k, f64, (2,))
    tot = sum(j + 1 for j in range(n))
    ws = [T.gen(k + (1,), j, f64, (tot, 2)) for j in range(n)]
    x = leaf(xs[r])
    (hvd.allgather(x) * to_torch(ws[r])).sum().backward()
    start = sum(j + 1 for j in range(r))
    c.ck.array(x.grad.cpu().numpy(), (np.sum(ws, 0) / n)[start:start + r + 1], "allgather grad")
    leaves = [leaf(xs[r]), leaf(xs[r][:, 0].copy())]
    outs = hvd.grouped_allgather(leaves)
    (outs[0] * to_torch(ws[r])).sum().backward()
    (outs[1] * to_torch(ws[r][:, 1].copy())).sum().backward()
    c.ck.array(leaves[0].grad.cpu().numpy(), (np.sum(ws, 0) / n)[start:start + r + 1],
               "grouped_allgather grad #0")
    c.ck.array(leaves[1].grad.cpu().numpy(), (np.sum(ws, 0) / n)[start:start + r + 1, 1],
               "grouped_allgather grad #1")
    # broadcast: the root gets the mean of w, the others zeros
    for root in range(n):
        k = c.key()
        xs, ws = c.inputs(k, f64, (5,)), c.inputs(k + (1,), f64, (5,))
        x = leaf(xs[r])
        (hvd.broadcast(x, root) * to_torch(ws[r])).sum().backward()
        exp = np.sum(ws, 0) / n if r == root else np.zeros(5)
        c.ck.array(x.grad.cpu().numpy(), exp, f"broadcast grad root {root}")
    # alltoall: each row's gradient is the weight where that row landed
    k = c.key()
    sp = [[(i + j + 1) % 3 for j in range(n)] for i in range(n)]
    xs = [T.gen(k, i, f64, (sum(sp[i]), 2)) for i in range(n)]
    recv_rows = [sum(sp[i][j] for i in range(n)) for j in range(n)]
    ws = [T.gen(k + (1,), j, f64, (recv_rows[j], 2)) for j in range(n)]
    x = leaf(xs[r])
    out, _ = hvd.alltoall(x, splits=sp[r])
    (out * to_torch(ws[r])).sum().backward()
    exp = np.concatenate([ws[j][sum(sp[i][j] for i in range(r)):][:sp[r][j]] for j in range(n)])
    c.ck.array(x.grad.cpu().numpy(), exp, "alltoall grad")
    reducescatter_grads(c)
    # compression: the fp16 round trip keeps the input dtype and is differentiable
    x = leaf(np.full(3, 1.0 + r))
    out = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    c.ck.equal(out.dtype, torch.float64, "fp16-compressed allreduce keeps the dtype")
    out.sum().backward()
    c.ck.array(x.grad.cpu().numpy(), np.full(3, float(n)), "fp16-compressed allreduce grad")


def reducescatter_grads(c):
    """Horovod's convention: the gradient of a reducescatter is the allgather of the incoming
    gradients times pre*post and, for Sum, the set size (Average: 1), the counterpart of
    allgather's averaging. Reference: every rank's weights w_j concatenated in NumPy. Odd and
    even row counts, 1-3 dims, every float dtype, with and without scale factors."""
    n, r = c.n, c.rank
    for dt in T.FLOAT_DTYPES:
        for opn, pre, post in ((SUM, 1.0, 1.0), (AVERAGE, 1.0, 1.0), (SUM, 3.0, 0.5),
                               (AVERAGE, 3.0, 0.5)):
            factor = pre * post * (n if opn == SUM else 1)
            for shape in ((2 * n + 1,), (2 * n, 3), (n + 1, 2, 3)):
                k = c.key()
                xs = c.inputs(k, dt, shape)
                ws = [T.gen(k + (1,), j, dt, (T.split_rows(shape[0], n)[j][1],) + shape[1:])
                      for j in range(n)]
                x = to_torch(xs[r]).requires_grad_()
                out = hvd.reducescatter(x, op=OPS[opn], prescale_factor=pre,
                                        postscale_factor=post)
                (out * to_torch(ws[r])).sum().backward()
                exp = (np.concatenate(ws).astype(np.float64) * factor).astype(dt)
                c.tensor(x.grad, exp, f"reducescatter grad {dt} {opn} x{pre * post} {shape}")
        # grouped: two tensors of different shapes in one op
        for opn in (SUM, AVERAGE):
            k = c.key()
            shapes = ((2 * n + 1, 2), (n,))
            xs = [c.inputs(k + (i,), dt, sh) for i, sh in enumerate(shapes)]
            ws = [[T.gen(k + (5 + i,), j, dt, (T.split_rows(sh[0], n)[j][1],) + sh[1:])
                   for j in range(n)] for i, sh in enumerate(shapes)]
            leaves = [to_torch(x[r]).requires_grad_() for x in xs]
            outs = hvd.grouped_reducescatter(leaves, op=OPS[opn], prescale_factor=2.0,
                                             postscale_factor=0.25)
            sum(((o * to_torch(w[r])).sum() for o, w in zip(outs, ws))).backward()
            factor = 0.5 * (n if opn == SUM else 1)
            for i in range(2):
                exp = (np.concatenate(ws[i]).astype(np.float64) * factor).astype(dt)
                c.tensor(leaves[i].grad, exp, f"grouped_reducescatter grad {dt} {opn} #{i}")


SECTIONS = {"allreduce": sec_allreduce, "grouped": sec_grouped, "allgather": sec_allgather,
            "broadcast": sec_broadcast, "alltoall": sec_alltoall,
            "reducescatter": sec_reducescatter, "inplace": sec_inplace, "misc": sec_misc,
            "autograd": sec_autograd}


def main():
    T.require_bf16()
    global DEVICE
    seed = int(sys.argv[1])
    hvd.init()
    if len(sys.argv) > 2 and sys.argv[2] == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    c = Ctx(seed)
    for name, fn in SECTIONS.items():
        before = c.ck.count
        fn(c)
        print(f"section {name}: {c.ck.count - before} checks", flush=True)
    hvd.shutdown()
    return c.ck.count


if __name__ == "__main__":
    T.run_main(main)
