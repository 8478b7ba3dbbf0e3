"""DistributedOptimizer, broadcast helpers, SyncBatchNorm and process sets, in one launch.

usage: torch_train_worker.py SEED

The reference is single-process torch: the same model trained on the concatenation of every
rank's batch (each rank rebuilds every rank's batch from the seed), never through ferrovod.
Prints ``OK <n_checks>``.
"""

import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.torch as hvd  # noqa: E402

torch.set_default_dtype(torch.float64)
B, DIN, DOUT, STEPS = 4, 6, 3, 4
TOL = 1e-10


def make_model(seed, bn=False, sparse=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(DIN, 8)]
    if bn:
        layers.append(hvd.SyncBatchNorm(8) if bn == "sync" else torch.nn.BatchNorm1d(8))
    layers += [torch.nn.Tanh(), torch.nn.Linear(8, DOUT)]
    return torch.nn.Sequential(*layers)


def batch(seed, step, r, micro=0):
    g = torch.Generator().manual_seed(seed * 100003 + step * 101 + r * 7 + micro * 100000)
    return torch.randn(B, DIN, generator=g), torch.randn(B, DOUT, generator=g)


def global_batch(seed, step, n, micro=0):
    xs, ys = zip(*(batch(seed, step, r, micro) for r in range(n)))
    return torch.cat(xs), torch.cat(ys)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class Run:
    def __init__(self, seed):
        self.seed, self.r, self.n = seed, hvd.rank(), hvd.size()
        self.ck = T.Checker(self.r)

    def close(self, got, exp, what, tol=TOL):
        self.ck.array(got.detach().numpy(), exp.detach().numpy(), what) if tol is None else \
            self.ck.true(np.allclose(got.detach().numpy(), exp.detach().numpy(), rtol=tol, atol=tol),
                         what, f"max abs diff {float((got - exp).detach().abs().max()):.3g} > {tol}")

    def same_on_all_ranks(self, t, what, ps=hvd.global_process_set):
        rows = hvd.allgather(t.detach().reshape(1, -1), process_set=ps)
        self.ck.true(bool((rows == rows[0]).all()), what, "ranks hold different values")

    def train(self, model, opt, steps=STEPS, micro=1, clip=None, seed_off=0):
        for s in range(steps):
            for m in range(micro):
                x, y = batch(self.seed + seed_off, s, self.r, m)
                torch.nn.functional.mse_loss(model(x), y).backward()
            if clip is not None:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                with opt.skip_synchronize():
                    opt.step()
            else:
                opt.step()
            opt.zero_grad()

    def reference(self, make_opt, steps=STEPS, micro=1, clip=None, scale=1.0, n=None, bn=False,
                  seed_off=0):
        n = self.n if n is None else n
        model = make_model(0, bn=bn and "plain")
        opt = make_opt(model)
        for s in range(steps):
            for m in range(micro):
                x, y = global_batch(self.seed + seed_off, s, n, m)
                (torch.nn.functional.mse_loss(model(x), y) * scale).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        return model


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def distributed(run, make_opt=sgd, bn=False, **kw):
    """A model initialised differently on each rank, then made equal by broadcast_parameters."""
    model = make_model(run.r, bn=bn and "sync")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(make_opt(model), named_parameters=model.named_parameters(), **kw)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return model, opt


# ---------------------------------------------------------------------------------------------
def sec_optimizer(run):
    for make_opt in (sgd, adam):
        model, opt = distributed(run, make_opt)
        run.ck.equal(type(opt).__name__, make_opt(make_model(0)).__class__.__name__, "class name")
        run.close(flat(model), flat(make_model(0)), "broadcast_parameters from rank 0")
        run.train(model, opt)
        run.same_on_all_ranks(flat(model), f"{make_opt.__name__}: parameters identical")
        run.close(flat(model), flat(run.reference(make_opt)), f"{make_opt.__name__}: equals "
                  "one process on the global batch")
    # groups (int and explicit lists), buckets (240 bytes: the last layer's bias and weight,
    # 216 bytes in float64, share one and the first layer's go alone; or none: one allreduce per
    # gradient), gradient_predivide_factor, Sum
    for kw in ({"groups": 2}, {"num_groups": 3}, {"bucket_cap_mb": 240 / 2**20},
               {"bucket_cap_mb": 0}, {"groups": 0}, {"gradient_predivide_factor": 2.0}):
        model, opt = distributed(run, **kw) if "num_groups" not in kw else \
            _quiet(lambda: distributed(run, **kw))
        if "bucket_cap_mb" in kw:
            made = [len(g) for g in opt._groups]
            run.ck.equal(made, [2] if kw["bucket_cap_mb"] else [], f"{kw}: bucket sizes")
        run.train(model, opt)
        run.close(flat(model), flat(run.reference(sgd)), f"{kw}: equals the reference")
    model = make_model(0)
    params = list(model.parameters())
    opt = hvd.DistributedOptimizer(sgd(model), groups=[params[:2], params[3:]])
    run.train(model, opt)
    run.close(flat(model), flat(run.reference(sgd)), "explicit groups: equal the reference")
    model, opt = distributed(run, op=hvd.Sum)
    run.train(model, opt)
    run.close(flat(model), flat(run.reference(sgd, scale=run.n)), "op=Sum: n x the mean gradient")
    # gradient clipping between synchronize() and step()
    model, opt = distributed(run)
    run.train(model, opt, clip=0.05)
    run.close(flat(model), flat(run.reference(sgd, clip=0.05)), "synchronize + clip + skip")
    # backward_passes_per_step: micro-batches accumulate locally, one allreduce per step
    model, opt = distributed(run, backward_passes_per_step=3)
    run.train(model, opt, micro=3)
    run.close(flat(model), flat(run.reference(sgd, micro=3)), "backward_passes_per_step=3")
    # fp16 and bf16 compression: close to the exact reference, identical on all ranks
    for comp, tol in ((hvd.Compression.fp16, 3e-3), (hvd.Compression.bf16, 3e-2)):
        model, opt = distributed(run, compression=comp)
        run.train(model, opt)
        run.same_on_all_ranks(flat(model), f"{comp.__name__}: parameters identical")
        run.close(flat(model), flat(run.reference(sgd)), f"{comp.__name__}: near reference", tol)
    _half_precision_gradients(run)


def _half_precision_gradients(run):
    """Parameters in float16 and bfloat16 (NumPy has no bfloat16): the flat buffer, in host
    memory when the ranks share it, holds the gathered gradients' mean to within rounding
    (the paths sum in different orders), the same bits on every rank."""
    for dtype, tol in ((torch.float16, 5e-3), (torch.bfloat16, 2e-2)):
        torch.manual_seed(3)
        model = torch.nn.Linear(37, 5).to(dtype)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        x = torch.arange(3 * 37, dtype=torch.float32).reshape(3, 37).div(50).add(run.r)
        # This rank's gradients from a copy the optimizer does not hook: with overlap, the
        # model's own are reduced in place while backward still runs.
        ref = torch.nn.Linear(37, 5).to(dtype)
        ref.load_state_dict(model.state_dict())
        ref(x.to(dtype)).pow(2).sum().backward()
        local = [p.grad.float() for p in ref.parameters()]
        model(x.to(dtype)).pow(2).sum().backward()
        opt.synchronize()
        for p, g in zip(model.parameters(), local):
            every = hvd.allgather(g.unsqueeze(0), name=f"half.{dtype}.{tuple(g.shape)}")
            run.close(p.grad.float(), every.mean(0), f"{dtype}: averaged gradient of shape "
                      f"{tuple(g.shape)}", tol)
            run.same_on_all_ranks(p.grad.float(), f"{dtype}: gradient identical on all ranks")
        with opt.skip_synchronize():
            opt.step()


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return fn()


def sec_semantics(run):
    ck = run.ck
    if run.n > 1:  # one rank: no hooks and nothing in flight (as in Horovod)
        _in_flight_checks(run)
    _other_semantics(run)


def _in_flight_checks(run):
    ck = run.ck
    model, opt = distributed(run)
    x, y = batch(run.seed, 0, run.r)
    torch.nn.functional.mse_loss(model(x), y).backward()
    # FERROVOD_OVERLAP (the test sets 1 or 0): submitted during backward, or only at step()
    submitted = sum(1 for h, _ in opt._handles.values() if h is not None)
    mode = os.environ.get("FERROVOD_OVERLAP")
    if mode in ("1", "0"):
        ck.equal((opt.overlap, submitted > 0), (mode == "1",) * 2,
                 f"FERROVOD_OVERLAP={mode}: (overlap, allreduces submitted during backward)")
        # at step(): every gradient lives in the flat buffer, reduced by one allreduce
        ck.equal(opt.flat_gradients, mode == "0", f"FERROVOD_OVERLAP={mode}: flat gradients")
        # ranks on one host reduce the flat buffer in shared memory unless it is turned off
        shared = mode == "0" and run.n > 1 and os.environ.get("FERROVOD_SHM_DISABLE") != "1"
        ck.equal(opt._step is not None and opt._step.shared, shared,
                 "flat gradients in host memory")
    ck.raises(AssertionError, opt.zero_grad, "zero_grad with allreduces in flight",
              contains=("zero_grad",))
    e = ck.raises(Exception, lambda: torch.nn.functional.mse_loss(model(x), y).backward(),
                  "a second backward before step", contains=("backward_passes_per_step",))
    opt.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.step()
    ck.true(any("skip_synchronize" in str(x.message) for x in w), "warning: step after synchronize")
    del e
    if opt.flat_gradients:
        base = opt._flat.data_ptr()
        end = base + opt._flat.numel() * opt._flat.element_size()
        ck.true(all(base <= p.grad.data_ptr() < end for p in model.parameters()),
                "flat gradients: every p.grad is a view of the flat buffer after step()")
        for comp in (hvd.Compression.fp16, hvd.Compression.bf16):
            ck.equal(hvd.DistributedOptimizer(sgd(make_model(0)), compression=comp)
                     .flat_gradients, False, f"{comp.__name__}: no flat buffer (casts copy)")
    opt.zero_grad()


def _other_semantics(run):
    ck = run.ck
    # the overlap argument wins over FERROVOD_OVERLAP; a bad value is refused on every rank
    for want in (True, False):
        ck.equal(hvd.DistributedOptimizer(sgd(make_model(0)), overlap=want).overlap, want,
                 f"overlap={want}")
    saved = os.environ.get("FERROVOD_OVERLAP")
    os.environ["FERROVOD_OVERLAP"] = "sometimes"
    try:
        ck.raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(make_model(0))),
                  "FERROVOD_OVERLAP=sometimes", contains=("FERROVOD_OVERLAP",))
    finally:
        if saved is None:
            del os.environ["FERROVOD_OVERLAP"]
        else:
            os.environ["FERROVOD_OVERLAP"] = saved
    # a parameter only rank 0 uses: the others submit zeros, nothing hangs
    model = make_model(0)
    extra = torch.nn.Linear(DOUT, DOUT)
    params = list(model.named_parameters()) + [("extra." + k, v) for k, v in extra.named_parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in params], lr=0.1),
                                   named_parameters=params)
    before = flat(extra).clone()
    for s in range(2):
        out = model(batch(run.seed, s, run.r)[0])
        if run.r == 0:
            out = extra(out)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    run.same_on_all_ranks(flat(extra), "unused-on-some-ranks parameter identical")
    ck.true(not torch.equal(flat(extra), before) or run.n == 1, "it was updated")
    # one process: the mean of every rank's loss, only rank 0's through `extra` (so the other
    # ranks' zeros count in its average)
    ref, ref_extra = make_model(0), torch.nn.Linear(DOUT, DOUT)
    ref_extra.weight.data.copy_(before[:DOUT * DOUT].view(DOUT, DOUT))
    ref_extra.bias.data.copy_(before[DOUT * DOUT:])
    ref_params = list(ref.parameters()) + list(ref_extra.parameters())
    ref_opt = torch.optim.SGD(ref_params, lr=0.1)
    for s in range(2):
        losses = []
        for r in range(run.n):
            out = ref(batch(run.seed, s, r)[0])
            losses.append((ref_extra(out) if r == 0 else out).pow(2).mean())
        (sum(losses) / run.n).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    run.close(flat(extra), flat(ref_extra), "unused-on-some-ranks parameter equals the reference")
    run.close(flat(model), flat(ref), "the used parameters equal the reference")
    # named_parameters checks
    m = make_model(0)
    ck.raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(m), named_parameters=[
        ("a", p) for p in m.parameters()]), "duplicate names", contains=("unique",))
    ck.raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(m), named_parameters=list(
        m.named_parameters())[:1]), "unnamed parameters", contains=("not named",))
    ck.raises(ValueError, lambda: hvd.DistributedOptimizer(sgd(m), op=hvd.Sum,
                                                           gradient_predivide_factor=2.0),
              "predivide with Sum")


def sec_sparse(run):
    def make(seed, sparse):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.EmbeddingBag(20, 4, mode="sum", sparse=sparse),
                                   torch.nn.Linear(4, 2))

    def idx(s, r):
        g = torch.Generator().manual_seed(run.seed + 17 * s + 1000 * r)
        return torch.randint(0, 20, (B, 3), generator=g), torch.randn(B, 2, generator=g)

    ref = make(0, False)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for s in range(3):
        xs, ys = zip(*(idx(s, r) for r in range(run.n)))
        torch.nn.functional.mse_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
        ropt.step()
        ropt.zero_grad()
    for as_dense in (False, True):
        model = make(0, True)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(),
                                       sparse_as_dense=as_dense)
        for s in range(3):
            x, y = idx(s, run.r)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        run.close(flat(model), flat(ref), f"sparse gradients (sparse_as_dense={as_dense})")
    _sparse_adam(run)


def _sparse_adam(run):
    """SparseAdam takes only sparse gradients: with sparse_as_dense the reduced gradients go
    back to sparse before the update, as in Horovod. Two sparse embeddings (one bucket when
    gradients go out during backward, the flat buffer when they wait for step()), float64 and
    float32, one or two backward passes per step; the reference is one process on the global
    batch, gradients (layout and values) and parameters."""
    proj = torch.randn(4, 2, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def make(dtype):
        torch.manual_seed(3)
        return torch.nn.ModuleList([torch.nn.Embedding(20, 4, sparse=True, dtype=dtype),
                                    torch.nn.Embedding(9, 4, sparse=True, dtype=dtype)])

    def loss(model, s, rs, m):
        xs, ys = [], []
        for r in rs:
            g = torch.Generator().manual_seed(run.seed + 31 * s + 1000 * r + 7 * m)
            xs.append((torch.randint(0, 20, (B, 3), generator=g),
                       torch.randint(0, 9, (B, 2), generator=g)))
            ys.append(torch.randn(B, 2, generator=g))
        h = model[0](torch.cat([x[0] for x in xs])).sum(1) + model[1](
            torch.cat([x[1] for x in xs])).sum(1)
        return torch.nn.functional.mse_loss(h @ proj.to(h.dtype), torch.cat(ys).to(h.dtype))

    for dtype, tol, micro in ((torch.float64, TOL, 1), (torch.float32, 1e-5, 2)):
        ref = make(dtype)
        ropt = torch.optim.SparseAdam(list(ref.parameters()), lr=0.05)
        ref_grads = []
        for s in range(3):
            for m in range(micro):
                loss(ref, s, range(run.n), m).backward()
            ref_grads.append([q.grad.to_dense() for q in ref.parameters()])
            ropt.step()
            ropt.zero_grad()
        for as_dense in (True, False):
            model = make(dtype)
            opt = hvd.DistributedOptimizer(
                torch.optim.SparseAdam(list(model.parameters()), lr=0.05),
                named_parameters=model.named_parameters(), sparse_as_dense=as_dense,
                backward_passes_per_step=micro)
            what = f"SparseAdam {dtype} micro={micro} sparse_as_dense={as_dense}"
            if run.n > 1:  # both ways to reduce: buckets during backward, flat at step()
                run.ck.equal(opt.flat_gradients, not opt.overlap, f"{what}: flat iff no overlap")
            for s in range(3):
                for m in range(micro):
                    loss(model, s, [run.r], m).backward()
                opt.synchronize()
                for p, exp in zip(model.parameters(), ref_grads[s]):
                    run.ck.true(p.grad.is_sparse and p.grad.sparse_dim() == 1,
                                f"{what}: reduced gradient sparse in its rows",
                                f"layout {p.grad.layout}, sparse_dim "
                                f"{p.grad.sparse_dim() if p.grad.is_sparse else '-'}")
                    run.close(p.grad.to_dense(), exp, f"{what}: gradient step {s}", tol)
                with opt.skip_synchronize():
                    opt.step()
                opt.zero_grad()
            run.close(flat(model), flat(ref), f"{what}: parameters", tol)


def sec_syncbn(run):
    r, n = run.r, run.n
    # one layer: outputs, input gradients, weight gradients, running statistics, eval mode
    for shape in ((B, 5), (B, 5, 3)):
        sync, plain = hvd.SyncBatchNorm(5, momentum=0.3), torch.nn.BatchNorm1d(5, momentum=0.3)
        for s in range(2):
            g = [torch.Generator().manual_seed(run.seed + 31 * j + s) for j in range(n)]
            xs = [torch.randn(shape, generator=gj) * 2 + 1 for gj in g]
            ws = [torch.randn(shape, generator=gj) for gj in g]
            x = xs[r].clone().requires_grad_()
            out = sync(x)
            (out * ws[r]).sum().backward()
            xr = torch.cat(xs).requires_grad_()
            outr = plain(xr)
            (outr * torch.cat(ws)).sum().backward()
            sl = slice(r * B, (r + 1) * B)
            run.close(out, outr[sl], f"SyncBatchNorm {shape} output step {s}")
            run.close(x.grad, xr.grad[sl], f"SyncBatchNorm {shape} input grad")
            wsum = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
            run.close(wsum, plain.weight.grad, f"SyncBatchNorm {shape} weight grad (summed)")
            run.close(hvd.allreduce(sync.bias.grad, op=hvd.Sum), plain.bias.grad, "bias grad")
            sync.zero_grad()
            plain.zero_grad()
        run.close(sync.running_mean, plain.running_mean, "running_mean")
        run.close(sync.running_var, plain.running_var, "running_var")
        sync.eval()
        plain.eval()
        run.close(sync(xs[r]), plain(xs[r]), "eval mode")
    # in a model trained with DistributedOptimizer: equals BatchNorm on the global batch
    model, opt = distributed(run, bn=True)
    run.train(model, opt)
    ref = run.reference(sgd, bn=True)
    run.close(flat(model), flat(ref), "SyncBatchNorm model equals BatchNorm on the global batch")
    run.close(model[1].running_var, ref[1].running_var, "trained running_var")


def sec_state(run):
    # rank 0 trains alone for two steps; the others are fresh: afterwards all have rank 0's
    model = make_model(run.r)
    opt = adam(model)
    if run.r == 0:
        for s in range(2):
            x, y = batch(run.seed, s, 0)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        opt.param_groups[0]["lr"] = 0.005
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    run.ck.equal(opt.param_groups[0]["lr"], 0.005, "lr from rank 0")
    st = torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1)
                    for p in model.parameters() for _, v in sorted(opt.state[p].items())])
    run.same_on_all_ranks(st, "Adam state identical after broadcast_optimizer_state")
    run.same_on_all_ranks(flat(model), "parameters identical after broadcast_parameters")
    run.ck.equal(float(opt.state[next(model.parameters())]["step"]), 2.0, "Adam step count")
    # only the fresh ranks got zero gradients (Horovod initialises state where there is none)
    for p in model.parameters():
        if run.r == 0:
            run.ck.true(p.grad is None, "rank 0 had state: its gradients untouched")
        else:
            run.ck.true(p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)),
                        "a fresh rank's gradients are zero", f"got {p.grad}")
    _fresh_state_grads(run)


def _fresh_state_grads(run):
    """On fresh optimizers broadcast_optimizer_state leaves what Horovod's state-initialising
    step leaves: a zero gradient on every parameter that requires one (sparse for SparseAdam,
    and for SGD on the sparse embeddings of ``model``), None elsewhere; scripts then broadcast
    them. Nothing is stepped: the parameters stay as they were."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                            requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(4, dtype=torch.float32))
            self.emb = torch.nn.Embedding(6, 3, sparse=True)
            self.lin = torch.nn.Linear(3, 2)

    def sgd_wd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1,
                               nesterov=True)

    def sparse_adam(m):
        return torch.optim.SparseAdam([p for p in m.parameters() if p.requires_grad])

    for make_opt, give_model, wrap in ((sgd_wd, True, True), (sgd_wd, False, True),
                                       (sgd_wd, True, False), (sparse_adam, False, True),
                                       (adam, True, True)):
        torch.manual_seed(11)
        model = Net()
        opt = make_opt(model)
        if wrap:
            opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        before = [p.detach().clone() for p in model.parameters()]
        what = (f"{make_opt.__name__}{' wrapped' if wrap else ''} "
                f"model={'given' if give_model else 'not given'}")
        hvd.broadcast_optimizer_state(opt, root_rank=0, model=model if give_model else None)
        for (name, p), old in zip(model.named_parameters(), before):
            run.ck.true(torch.equal(p.detach(), old), f"{what}: {name} not stepped")
            if not p.requires_grad:
                run.ck.true(p.grad is None, f"{what}: {name} (frozen) has no gradient")
                continue
            sparse = make_opt is sparse_adam or (make_opt is sgd_wd and give_model and
                                                 name.startswith("emb."))
            run.ck.true(p.grad is not None and p.grad.is_sparse == sparse
                        and p.grad.shape == p.shape and p.grad.dtype == p.dtype,
                        f"{what}: {name} has a {'sparse' if sparse else 'dense'} gradient",
                        f"got {None if p.grad is None else (p.grad.layout, p.grad.shape)}")
            run.close(p.grad.to_dense() if sparse else p.grad, torch.zeros_like(p),
                      f"{what}: {name}'s gradient is zero")
            if not sparse:  # as Horovod's test_broadcast_state_no_grad does
                run.close(hvd.broadcast(p.grad, root_rank=0, name=f"{what}.{name}"), p.grad,
                          f"{what}: {name}'s gradient broadcast")


def two_groups(make):
    """``make(groups)`` over two parameter groups with different learning rates (each group's
    range straddles shards: 83 float64 parameters split 42/41, 28/28/27)."""
    def build(model):
        ps = list(model.parameters())
        return make([{"params": ps[:2]}, {"params": ps[2:], "lr": 0.03}])
    build.__name__ = make.__name__ if hasattr(make, "__name__") else "two_groups"
    return build


def adamw_groups(groups):
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def sgd_groups(groups):
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)


def sec_sharded(run):
    """DistributedOptimizer(sharded=True) against the unsharded one (bit for bit: the same
    sums, then the same elementwise update on a slice) and single-process torch on the global
    batch; its state_dict in the unsharded format both ways; clipping through synchronize();
    accumulation; the refusals."""
    n = run.n

    def same(got, exp, what):
        # Bit for bit on two ranks (a sum of two is the same either way round); with more,
        # the reduce-scatter ring and the allreduce add in different orders.
        if n <= 2:
            run.ck.true(torch.equal(got, exp), what, "not bitwise equal: max abs diff "
                        f"{float((got - exp).abs().max()):.3g}")
        else:
            run.close(got, exp, what)

    for make_opt in (sgd, adam, two_groups(adamw_groups), two_groups(sgd_groups)):
        name = make_opt.__name__
        model, opt = distributed(run, make_opt, sharded=True)
        run.ck.equal(opt.sharded, n > 1, f"{name}: sharded")
        plain_model, plain_opt = distributed(run, make_opt)
        run.train(model, opt)
        run.train(plain_model, plain_opt)
        run.same_on_all_ranks(flat(model), f"{name} sharded: parameters identical")
        # Bit for bit on two ranks (a sum of two is the same either way); with more, the
        # reduce-scatter ring and the allreduce add in different orders.
        same(flat(model), flat(plain_model), f"{name} sharded: equals unsharded")
        run.close(flat(model), flat(run.reference(make_opt)), f"{name} sharded: equals one "
                  "process on the global batch")
        host = n > 1 and os.environ.get("FERROVOD_SHM_DISABLE") != "1"
        run.ck.equal(opt._step.shared if n > 1 else False, host,
                     f"{name}: one copy of the parameters in host memory")
        if n > 1:
            base = opt._shards.flat
            run.ck.true(all(base.data_ptr() <= p.data_ptr() < base.data_ptr() + base.numel() * 8
                            for p in model.parameters()), f"{name}: parameters",
                        "not views of the flat buffer")
        sd, plain_sd = opt.state_dict(), plain_opt.state_dict()
        run.ck.equal(sd["param_groups"], plain_sd["param_groups"], f"{name}: state_dict groups")
        run.ck.equal(sorted(sd["state"]), sorted(plain_sd["state"]), f"{name}: state_dict keys")
        for i, st in plain_sd["state"].items():
            for k, v in st.items():
                same(torch.as_tensor(sd["state"][i][k]), torch.as_tensor(v),
                     f"{name}: state_dict[{i}][{k}]")
        # Each loads the other's state and both train on: still equal.
        m2, o2 = distributed(run, make_opt, sharded=True)
        m2.load_state_dict(plain_model.state_dict())
        o2.load_state_dict(plain_sd)
        plain_opt.load_state_dict(sd)
        run.train(m2, o2, seed_off=5)
        run.train(plain_model, plain_opt, seed_off=5)
        same(flat(m2), flat(plain_model), f"{name}: after load_state_dict")
    # clipping: synchronize() reduces whole gradients; accumulation; zero_grad to zeros
    model, opt = distributed(run, sharded=True)
    run.train(model, opt, clip=0.05)
    run.close(flat(model), flat(run.reference(sgd, clip=0.05)), "sharded with clipping")
    model, opt = distributed(run, sharded=True, backward_passes_per_step=2)
    run.train(model, opt, micro=2)
    run.close(flat(model), flat(run.reference(sgd, micro=2)), "sharded, 2 backward passes")
    model, opt = distributed(run, sharded=True)
    for s in range(STEPS):
        opt.zero_grad(set_to_none=False)
        x, y = batch(run.seed, s, run.r)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    run.close(flat(model), flat(run.reference(sgd)), "sharded, zero_grad(set_to_none=False)")
    # broadcast_optimizer_state: the root's hyper-parameters
    if run.r == 0:
        opt.param_groups[0]["lr"] = 0.007
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    run.ck.equal(opt.param_groups[0]["lr"], 0.007, "sharded: lr from rank 0")
    # what cannot be sharded is refused, naming why
    model = make_model(0)
    for what, build, kw, words in (
            ("LBFGS", lambda m: torch.optim.LBFGS(m.parameters()), {}, ("elementwise",)),
            ("compression", sgd, {"compression": hvd.Compression.fp16}, ("compress",)),
            ("overlap", sgd, {"overlap": True}, ("overlap",))):
        run.ck.raises(ValueError, lambda: hvd.DistributedOptimizer(
            build(model), named_parameters=model.named_parameters(), sharded=True, **kw),
            f"sharded with {what}", contains=words)


def sec_psets(run):
    n, r = run.n, run.r
    ps = PAIR
    # ops on the set
    x = torch.full((3,), float(r + 1))
    if ps.included():
        run.close(hvd.allreduce(x, op=hvd.Sum, process_set=ps), torch.full((3,), 3.0), "set allreduce")
        run.close(hvd.allgather(x[:1], process_set=ps), torch.tensor([1.0, 2.0]), "set allgather")
        run.close(hvd.broadcast(x, 1, process_set=ps), torch.full((3,), 2.0), "set broadcast")
        # a Sum reducescatter's gradient is the set's size (2), not the job's, times the
        # gathered incoming gradients (Horovod's convention, see ferrovod.torch.autograd)
        ws = [torch.randn(3 - j, 2, generator=torch.Generator().manual_seed(run.seed + j))
              for j in range(2)]
        for opn, factor in (("Sum", 2.0), ("Average", 1.0)):
            leaf = torch.randn(5, 2).requires_grad_()
            out = hvd.reducescatter(leaf, op=getattr(hvd, opn), process_set=ps)
            (out * ws[ps.rank()]).sum().backward()
            run.close(leaf.grad, torch.cat(ws) * factor, f"set reducescatter grad {opn}")
    else:
        run.ck.raises(ValueError, lambda: hvd.allreduce(x, process_set=ps), "foreign set")
    # training on the set: members train together, the others alone
    model = make_model(0)
    opt = hvd.DistributedOptimizer(sgd(model), named_parameters=model.named_parameters(),
                                   process_set=ps)
    run.train(model, opt, seed_off=1 if ps.included() else 1 + r)
    if ps.included():
        ref = run.reference(sgd, n=2, seed_off=1)
        run.close(flat(model), flat(ref), "DistributedOptimizer on a process set")
    else:
        model0 = make_model(0)
        o = sgd(model0)
        for s in range(STEPS):
            x, y = batch(run.seed + 1 + r, s, r)
            torch.nn.functional.mse_loss(model0(x), y).backward()
            o.step()
            o.zero_grad()
        run.close(flat(model), flat(model0), "outside the set: local training")
    # a global optimizer after one that only the set's members made active: the names of its
    # collectives must still match on every rank
    model, opt = distributed(run)
    run.train(model, opt)
    run.close(flat(model), flat(run.reference(sgd)), "a global DistributedOptimizer after one "
              "on a set equals the reference")


SECTIONS = {"optimizer": sec_optimizer, "semantics": sec_semantics, "sparse": sec_sparse,
            "syncbn": sec_syncbn, "state": sec_state, "sharded": sec_sharded,
            "psets": sec_psets}
PAIR = hvd.ProcessSet([0, 1])


def main():
    seed = int(sys.argv[1])
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SECTIONS)
    # OVERLAP_MODES=1,0: the sections once per FERROVOD_OVERLAP value (read when an optimizer
    # is made), in one job, each section's line naming the mode; psets after all the others,
    # once per mode too: a set's unnamed ops leave its members' counters of unnamed ops ahead
    # of the other ranks' (as in Horovod), so no unnamed op of the whole job may follow it,
    # and psets itself has none.
    modes = [m for m in os.environ.get("OVERLAP_MODES", "").split(",") if m]
    hvd.init(process_sets=[PAIR] if _size_hint() >= 2 else None)
    run = Run(seed)
    passes = [(m, [x for x in only if x != "psets"]) for m in modes] or [(None, only)]
    if "psets" in only:
        passes += [(m, ["psets"]) for m in modes]
    for mode, names in passes:
        if mode is not None:
            os.environ["FERROVOD_OVERLAP"] = mode
        for name in names:
            if name == "psets" and run.n < 2:
                continue
            before = run.ck.count
            SECTIONS[name](run)
            label = name if mode is None else f"{name}@{mode}"
            print(f"section {label}: {run.ck.count - before} checks", flush=True)
    hvd.shutdown()
    return run.ck.count


def _size_hint():
    """The job size before init() (a set needs two ranks to be registered)."""
    return int(os.environ.get("FERROVOD_SIZE", "1"))


if __name__ == "__main__":
    T.run_main(main)
