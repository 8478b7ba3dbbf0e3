"""The training job `elastic_recovery.py` times: one model, trained three ways.

usage: elastic_train.py ferrovod|horovod|torchrun LOG_DIR STEPS

* ``ferrovod`` / ``horovod``: the framework's elastic mode (``hvd.elastic.run`` with a
  ``TorchState`` of model and optimizer, committed every 10 steps), in memory;
* ``torchrun``: DistributedDataParallel on gloo, restarted by torchrun's elastic agent, which
  reloads the checkpoint rank 0 saves every 10 steps.

Every process appends ``<unix time> <step> <size> <rank>`` to ``LOG_DIR/steps.<pid>`` after each
step and writes ``<host> <pid>`` to ``LOG_DIR/pid.<pid>`` at start, so the benchmark can kill
one host's workers and time the survivors' next step.
"""

import os
import sys
import time

import torch

COMMIT_EVERY = 10
WIDTH, DEPTH, BATCH = 512, 4, 64


def model_and_data():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(WIDTH, 1))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, 1, generator=g)
    return model, x, y


class StepLog:
    def __init__(self, log_dir, host):
        pid = os.getpid()
        with open(os.path.join(log_dir, f"pid.{pid}"), "w") as f:
            f.write(f"{host} {pid}\n")
        self.f = open(os.path.join(log_dir, f"steps.{pid}"), "a", buffering=1)

    def step(self, step, size, rank):
        self.f.write(f"{time.time():.6f} {step} {size} {rank}\n")


def elastic(kind, log_dir, steps):
    if kind == "ferrovod":
        import ferrovod.torch as hvd
        host = os.environ.get("FERROVOD_HOSTNAME", "localhost")
    else:
        import horovod.torch as hvd
        host = os.environ.get("HOROVOD_HOSTNAME", "localhost")
    hvd.init()
    torch.set_num_threads(1)
    model, x, y = model_and_data()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    log = StepLog(log_dir, host)

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state.step += 1
            log.step(state.step, hvd.size(), hvd.rank())
            if state.step % COMMIT_EVERY == 0:
                state.commit()

    train(state)


def torchrun(log_dir, steps):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    model, x, y = model_and_data()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    ckpt = os.path.join(log_dir, "checkpoint.pt")
    step = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = saved["step"]
    log = StepLog(log_dir, os.environ.get("BENCH_HOST", "localhost"))
    while step < steps:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        step += 1
        log.step(step, size, rank)
        if step % COMMIT_EVERY == 0 and rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
    dist.destroy_process_group()


if __name__ == "__main__":
    kind, log_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if kind == "torchrun":
        torchrun(log_dir, steps)
    else:
        elastic(kind, log_dir, steps)
