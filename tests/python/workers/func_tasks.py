"""Functions that test_ray.py and test_spark.py run on every rank (``ferrovod.ray``'s
executor, ``ferrovod.spark.run``).

They live in a module of their own, on the ranks' ``PYTHONPATH``, so that they travel by
reference, as a user's own module's functions would.
"""

import os

import numpy as np

DTYPES = ("float32", "float64", "int32", "int64", "float16")
SHAPES = ((1,), (7,), (3, 5), (2, 3, 3))


def rank_input(rank, dtype, shape, salt=0):
    """What ``rank`` contributes (the test recomputes it for its reference)."""
    rng = np.random.default_rng([rank, DTYPES.index(dtype), len(shape), salt])
    return (rng.integers(-20, 20, size=shape)).astype(dtype)


def collectives():
    """Allreduce (sum, average, min, max), a ragged allgather and a broadcast from the last
    rank, over every dtype and shape; returns this rank's outputs by (op, dtype, shape)."""
    import ferrovod as fv

    fv.init()
    rank, size = fv.rank(), fv.size()
    out = {}
    for dtype in DTYPES:
        for shape in SHAPES:
            x = rank_input(rank, dtype, shape)
            out["sum", dtype, shape] = fv.allreduce(x, op=fv.Sum)
            if dtype.startswith("float"):
                out["average", dtype, shape] = fv.allreduce(x, op=fv.Average)
            out["min", dtype, shape] = fv.allreduce(x, op=fv.Min)
            out["max", dtype, shape] = fv.allreduce(x, op=fv.Max)
            ragged = np.concatenate([rank_input(rank, dtype, shape, salt=1)] * (rank + 1))
            out["allgather", dtype, shape] = fv.allgather(ragged)
            out["broadcast", dtype, shape] = fv.broadcast(x, root_rank=size - 1)
    return rank, size, out


def topology():
    """This rank's place in the job, as ferrovod and its environment say."""
    import ferrovod as fv

    fv.init()
    return {
        "rank": fv.rank(), "size": fv.size(), "local_rank": fv.local_rank(),
        "local_size": fv.local_size(), "cross_rank": fv.cross_rank(),
        "cross_size": fv.cross_size(), "hostname": os.environ.get("FERROVOD_HOSTNAME"),
        "pid": os.getpid(), "extra": os.environ.get("FUNC_TEST_EXTRA"),
        "omp": os.environ.get("OMP_NUM_THREADS"), "launcher": os.environ.get("FERROVOD_LAUNCHER"),
    }


class Counter:
    """An ``executable_cls``: state that lives in the actor between calls."""

    def __init__(self, start, step=1):
        self.value = start
        self.step = step

    def bump(self):
        import ferrovod as fv

        fv.init()
        self.value += self.step
        return int(fv.allreduce(np.array([self.value]), op=fv.Sum)[0])


def raise_on(bad_rank):
    """Every rank joins an allreduce, except ``bad_rank``, which raises first."""
    import ferrovod as fv

    fv.init()
    if fv.rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} refuses its batch")
    return fv.allreduce(np.ones(3), op=fv.Sum).tolist()


def raise_before_init_on(bad_rank):
    """``bad_rank`` raises before it ever calls init(): the others wait for it in init()."""
    import ferrovod as fv

    if int(os.environ["FERROVOD_RANK"]) == bad_rank:
        raise KeyError("no such dataset")
    fv.init()
    return fv.allreduce(np.ones(3), op=fv.Sum).tolist()


def say_hello():
    """One line on stdout and one on stderr from every rank."""
    import sys

    import ferrovod as fv

    fv.init()
    print(f"hello from rank {fv.rank()}")
    print(f"warning from rank {fv.rank()}", file=sys.stderr)
    return fv.rank()


def exit_on(bad_rank):
    """``bad_rank``'s process ends (an OOM kill, a segfault) while the others reduce."""
    import ferrovod as fv

    fv.init()
    if fv.rank() == bad_rank:
        os._exit(3)
    return fv.allreduce(np.ones(3), op=fv.Sum).tolist()


def torch_train(steps, batch):
    """``steps`` of SGD on this rank's shard of one fixed global batch through
    ``DistributedOptimizer``; returns the final weights (rank 0's broadcast at the start)."""
    import torch

    import ferrovod.torch as hvd

    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # different on purpose: broadcast must fix it
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = global_batch(batch)
    mine = slice(hvd.rank() * batch // hvd.size(), (hvd.rank() + 1) * batch // hvd.size())
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def global_batch(batch):
    import torch

    g = torch.Generator().manual_seed(99)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 2, generator=g)


def ray_train_torch_loop(config):
    """A Ray Train ``TorchTrainer`` worker loop that uses ferrovod.torch and no settings:
    ``torch_train``'s steps, its weights saved under ``config["out"]`` by rank."""
    import ferrovod.torch as hvd

    weights = torch_train(config["steps"], config["batch"])
    np.savez(os.path.join(config["out"], f"torch-{hvd.rank()}-of-{hvd.size()}.npz"), **weights)


def ray_train_ddp_loop(config):
    """A ``TorchTrainer`` worker loop whose process group Ray Train formed with
    ``TorchConfig(backend="ferrovod")`` (torch found the backend through the package's entry
    point; nothing here imports ferrovod): ``torch_train``'s model, data and steps through
    ``DistributedDataParallel``, its weights saved under ``config["out"]`` by rank."""
    import torch
    import torch.distributed as dist

    assert dist.get_backend() == "ferrovod", dist.get_backend()
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # different on purpose: DDP's start broadcasts rank 0's
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = global_batch(config["batch"])
    mine = slice(rank * config["batch"] // size, (rank + 1) * config["batch"] // size)
    for _ in range(config["steps"]):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
    weights = {k: v.detach().numpy().copy() for k, v in model.module.state_dict().items()}
    np.savez(os.path.join(config["out"], f"ddp-{rank}-of-{size}.npz"), **weights)


def ray_train_keras_loop(config):
    """A Ray Train ``TensorflowTrainer`` worker loop: Keras 3 ``fit`` with ferrovod's
    ``DistributedOptimizer`` on this rank's shard (different on every rank, as are the initial
    weights); its final weights and loss history saved under ``config["out"]`` by rank."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import ferrovod.tensorflow.keras as hvd

    hvd.init()
    keras.utils.set_random_seed(7 + hvd.rank())
    rng = np.random.default_rng(hvd.rank())
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ np.arange(8, dtype="float32") / 8.0)[:, None]
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    history = model.fit(x, y, batch_size=16, epochs=config["epochs"], verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    np.savez(os.path.join(config["out"], f"keras-{hvd.rank()}-of-{hvd.size()}.npz"),
             loss=np.array(history.history["loss"]), *model.get_weights())


def allreduce_until(seconds, mark_dir):
    """Allreduces for ``seconds`` after ``init()``, leaving ``<mark_dir>/started-<rank>`` (its
    host's name inside) once the job has formed, so that a test can fail a host mid-run;
    returns how many it did."""
    import time

    import ferrovod as fv

    fv.init()
    with open(os.path.join(mark_dir, f"started-{fv.rank()}"), "w") as f:
        f.write(os.environ.get("FERROVOD_HOSTNAME", ""))
    end, done = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        fv.allreduce(np.ones(1024, dtype=np.float32), op=fv.Sum)
        done += 1
    return done


def elastic_count(steps, fail=None, mark_dir=None, pause_s=0.0, until_file=None):
    """Elastic training without a framework: an ``ObjectState`` counts ``steps`` steps (or
    until any rank sees ``until_file``), committed every 2, each step an allreduce of ones
    (the job's size). ``fail`` =
    ``{"epoch", "local_rank", "step", "how", "host"}``: the worker started for that epoch in that
    slot (on that host, if given) raises (``how="raise"``) or kills its process (``"kill"``)
    when the count reaches ``step``. With ``mark_dir``, each worker leaves
    ``<mark_dir>/at-<host>-<local rank>`` holding its count and the job's size, and
    ``pid-<host>-<local rank>`` its process id and its parent's. Returns this rank's rank, size,
    count, the sizes it saw, its host, and a final sum of ``rank_input`` over the ranks."""
    import signal
    import time

    import ferrovod as fv

    started_for = int(os.environ["FERROVOD_ELASTIC_EPOCH"])
    slot_lr = int(os.environ["FERROVOD_ELASTIC_LOCAL_RANK"])
    host = os.environ["FERROVOD_HOSTNAME"]
    fv.init()
    state = fv.elastic.ObjectState(step=0, counted=0, sizes=[])

    @fv.elastic.run
    def train(state):
        while state.step < steps:
            if (fail and state.step == fail["step"] and started_for == fail["epoch"]
                    and slot_lr == fail["local_rank"] and fail.get("host", host) == host):
                if fail["how"] == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise ValueError(f"worker {host}[{slot_lr}] fails at step {state.step}")
            stop = float(until_file is not None and os.path.exists(until_file))
            n = fv.allreduce(np.array([1.0, stop]), op=fv.Sum, name="elastic.step")
            state.counted += 1
            state.sizes.append(int(n[0]))
            state.step += 1
            if mark_dir:
                _mark(mark_dir, f"at-{host}-{slot_lr}", f"{state.step} {int(n[0])}")
                _mark(mark_dir, f"pid-{host}-{slot_lr}", f"{os.getpid()} {os.getppid()}")
            if state.step % 2 == 0 or n[1] > 0:
                state.commit()
            if n[1] > 0:
                break
            time.sleep(pause_s)

    train(state)
    total = fv.allreduce(rank_input(fv.rank(), "float64", (7,)), op=fv.Sum, name="elastic.end")
    return {"rank": fv.rank(), "size": fv.size(), "counted": state.counted,
            "sizes": state.sizes, "host": host, "sum": total.tolist(),
            "started_for": started_for}


def _mark(mark_dir, name, text):
    """Writes ``<mark_dir>/<name>`` whole at once: a test reading it never sees it empty."""
    tmp = os.path.join(mark_dir, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(mark_dir, name))


def gpu_view():
    """What a rank of a ``use_gpu`` Ray job sees: its local rank, its ``CUDA_VISIBLE_DEVICES``
    and the GPU ids Ray gave its actor (logical GPUs: no device is touched)."""
    import ray

    import ferrovod as fv

    fv.init()
    return {"rank": fv.rank(), "local_rank": fv.local_rank(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            "mine": [str(g) for g in ray.get_gpu_ids()]}


def torch_reference(steps, batch):
    """What ``torch_train`` must end with on every rank: one process, rank 0's initial
    weights, the whole batch each step. Plain torch, no ferrovod."""
    import torch

    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = global_batch(batch)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def in_fresh_python(name, *args):
    """``name(*args)`` from this module, called in a new interpreter (test processes keep
    torch, TensorFlow and Ray's libraries out of one address space: together they abort)."""
    import pickle
    import subprocess
    import sys

    code = ("import pickle, sys, func_tasks; "
            "sys.stdout.buffer.write(pickle.dumps(getattr(func_tasks, sys.argv[1])"
            "(*pickle.loads(bytes.fromhex(sys.argv[2])))))")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (here, os.environ.get("PYTHONPATH", "")) if p))
    res = subprocess.run([sys.executable, "-c", code, name, pickle.dumps(args).hex()],
                         capture_output=True, env=env, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"{name}{args} failed:\n{res.stderr.decode(errors='replace')}")
    return pickle.loads(res.stdout)


def ray_train_fit(address, kind, config):
    """Runs a Ray Train trainer (``kind`` "torch": ``TorchTrainer`` with
    ``ray_train_torch_loop``; "ddp": ``TorchTrainer`` with ``ray_train_ddp_loop`` on the
    backend ``"ferrovod"``; "keras": ``TensorflowTrainer`` with ``ray_train_keras_loop``) of
    2 workers on the cluster at ``address``, as a driver of its own."""
    import ray
    from ray.train import RunConfig, ScalingConfig

    ray.init(address=address, log_to_driver=False)
    extra = {}
    if kind == "torch":
        from ray.train.torch import TorchTrainer as Trainer
        loop = ray_train_torch_loop
    elif kind == "ddp":
        from ray.train.torch import TorchConfig
        from ray.train.torch import TorchTrainer as Trainer
        loop = ray_train_ddp_loop
        extra = {"torch_config": TorchConfig(backend="ferrovod")}
    else:
        from ray.train.tensorflow import TensorflowTrainer as Trainer
        loop = ray_train_keras_loop
    Trainer(loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
            run_config=RunConfig(storage_path=os.path.join(config["out"], "ray_train"),
                                 name=kind), **extra).fit()
    ray.shutdown()


def check_collectives(results, size):
    """Asserts that ``collectives()``' results from ``size`` ranks are what NumPy computes
    from the ranks' inputs: every op, dtype and shape, the dtype kept."""
    assert [r[:2] for r in results] == [(r, size) for r in range(size)]
    for rank, _, out in results:
        for dtype in DTYPES:
            for shape in SHAPES:
                xs = [rank_input(r, dtype, shape).astype(np.float64) for r in range(size)]
                want = {
                    "sum": np.sum(xs, axis=0), "min": np.min(xs, axis=0),
                    "max": np.max(xs, axis=0), "average": np.mean(xs, axis=0),
                    "allgather": np.concatenate(
                        [np.concatenate([rank_input(r, dtype, shape, salt=1)] * (r + 1))
                         for r in range(size)]),
                    "broadcast": xs[size - 1],
                }
                for op, expected in want.items():
                    if (op, dtype, shape) not in out:
                        assert op == "average" and not dtype.startswith("float")
                        continue
                    got = out[op, dtype, shape]
                    assert got.dtype == np.dtype(dtype), (rank, op, dtype, shape)
                    tol = 1e-2 if dtype == "float16" else 1e-6
                    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol,
                                               err_msg=f"rank {rank} {op} {dtype} {shape}")


def check_against_reference(weights_by_rank, steps, batch):
    """Asserts that each rank's ``torch_train`` weights equal ``torch_reference``'s (computed
    in a fresh interpreter)."""
    reference = in_fresh_python("torch_reference", steps, batch)
    for rank, w in enumerate(weights_by_rank):
        for name, ref in reference.items():
            np.testing.assert_allclose(w[name], ref, rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} {name}")


def check_elastic(results, size=None, steps=None):
    """The results of an elastic run of ``elastic_count``: ranks 0..size-1 (``size``: as many
    as returned), each counted every step once (``steps`` of them, when given), all agree on
    the sizes they trained at, and the final sum matches NumPy's over the ranks' inputs."""
    size = len(results) if size is None else size
    assert [r["rank"] for r in results] == list(range(size))
    assert all(r["size"] == size for r in results)
    assert all(r["counted"] == len(r["sizes"]) for r in results)
    if steps is not None:
        assert all(r["counted"] == steps for r in results)
    assert all(r["sizes"] == results[0]["sizes"] for r in results)
    want = np.sum([rank_input(r, "float64", (7,)) for r in range(size)], axis=0)
    for r in results:
        np.testing.assert_allclose(r["sum"], want)
