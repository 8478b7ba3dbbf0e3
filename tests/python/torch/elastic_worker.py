"""An elastic PyTorch training run whose membership changes under it.

usage: elastic_worker.py SCENARIO HOSTS_FILE OUT_DIR

Trains a small model with momentum SGD on a fixed dataset through ``ferrovod.torch.elastic``
(``TorchState`` with the model, the optimizer, an ``ElasticSampler`` and the record of every
committed step). Each step allgathers the sample indices every rank trained on; the state
keeps them, so after the run rank 0 checks, independently of ferrovod:

* every sample of every epoch was trained exactly once in a committed step (nothing lost,
  nothing trained twice, across the resizes);
* the weights equal a fresh replay, in one process, of the same global batches in the same
  order (each step's gradient is the mean over that step's samples);
* every rank's weights are identical.

SCENARIO says what happens at global step ``AT`` (only once, in the first membership):
  kill       the worker on host 127.0.0.1 with local rank 1 SIGKILLs itself
  first      the worker on host localhost (the first host, rank 0's) with local rank 1 does
  twice      as kill; then host 127.0.0.2's worker SIGKILLs itself during the reset
  raise      that worker raises an exception instead
  all        every worker raises an exception
  add        rank 0 writes a second host into HOSTS_FILE (the discovery script reads it)
  remove     rank 0 removes host 127.0.0.1 from HOSTS_FILE
  replace    rank 0 replaces every host in HOSTS_FILE with 127.0.0.2, where no survivor is
  none       nothing
Prints ``size S rank R epoch E step T`` at every reset and ``DONE ...`` / ``OK n`` at the end;
rank 0 appends the committed steps to ``OUT_DIR/commits`` at every commit (they must never go
back: a rank 0 without the committed state would hand every rank its empty one).
"""

import json
import os
import signal
import sys
from pathlib import Path
import time

import torch

import ferrovod.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))
import fvtest as T  # noqa: E402

N, EPOCHS, BATCH, COMMIT_EVERY, AT = 48, 3, 2, 2, 5
LR, MOMENTUM = 0.05, 0.9
# Seconds per step: long enough runs for a blacklisted host to come back mid-training.
STEP_SLEEP = float(os.environ.get("ELASTIC_STEP_SLEEP", "0"))
# "cuda": the model and the data live on the GPU (tests/python/gpu); the replay stays on the
# host.
DEVICE = os.environ.get("ELASTIC_DEVICE", "cpu")


def data():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, 6, generator=g)
    y = (x @ torch.randn(6, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(N, generator=g)
    return x, y


def make_model():
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def loss_of(model, x, y):
    return torch.nn.functional.mse_loss(model(x).squeeze(1), y)


def main():
    scenario, hosts_file, out_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    hvd.init()
    x, y = data()
    model = make_model()
    if DEVICE == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        x, y, model = x.cuda(), y.cuda(), model.cuda()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(N), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0,
                                   steps=[])
    host = os.environ["FERROVOD_HOSTNAME"]
    slot_lr = int(os.environ["FERROVOD_ELASTIC_LOCAL_RANK"])

    resets = [0]  # this process's own count: the state's values are rank 0's after a sync

    def on_reset():
        resets[0] += 1
        if scenario == "twice" and host == "127.0.0.2":
            # A second failure, in the middle of the reset: the survivors' state sync fails.
            print("killing myself in the reset", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    state.register_reset_callbacks([on_reset])

    def commit():
        state.commit()
        if hvd.rank() == 0:
            with open(os.path.join(out_dir, "commits"), "a") as f:
                f.write(f"{len(state.steps)}\n")

    @hvd.elastic.run
    def train(state):
        print(f"size {hvd.size()} rank {hvd.rank()} epoch {state.epoch} step {len(state.steps)}",
              flush=True)
        for epoch in range(state.epoch, EPOCHS):
            order = list(state.sampler)
            for i in range(0, len(order), BATCH):
                idx = order[i:i + BATCH]
                step = len(state.steps)
                if step == AT and resets[0] == 0:
                    act(scenario, host, slot_lr, hosts_file, out_dir)
                time.sleep(STEP_SLEEP)
                opt.zero_grad()
                loss_of(model, x[idx], y[idx]).backward()
                opt.step()
                everyone = hvd.allgather_object(idx, name="elastic.indices")
                state.steps.append(sorted(j for part in everyone for j in part))
                state.sampler.record_indices(idx)
                if len(state.steps) % COMMIT_EVERY == 0:
                    commit()
            state.epoch = epoch + 1
            state.sampler.set_epoch(epoch + 1)
            commit()

    train(state)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = hvd.allgather(weights.unsqueeze(0), name="elastic.final")
    checks = 0
    if hvd.rank() == 0:
        assert torch.equal(gathered, weights.expand_as(gathered)), "ranks' weights differ"
        checks += 1
        per_epoch = [[] for _ in range(EPOCHS)]
        steps_per_epoch, e = [], 0
        seen = 0
        for s in state.steps:
            per_epoch[e].extend(s)
            seen += len(s)
            if seen == N:
                e, seen = e + 1, 0
        for e, idx in enumerate(per_epoch):
            assert sorted(idx) == list(range(N)), f"epoch {e}: samples {sorted(idx)}"
            checks += 1
        ref = make_model()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
        hx, hy = x.cpu(), y.cpu()
        for s in state.steps:
            ref_opt.zero_grad()
            loss_of(ref, hx[s], hy[s]).backward()
            ref_opt.step()
        want = torch.cat([p.detach().flatten() for p in ref.parameters()])
        err = (weights.cpu() - want).abs().max().item()
        assert err < 5e-5, f"weights differ from the replay by {err}"
        checks += 1
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump({"steps": len(state.steps), "size": hvd.size(), "resets": resets[0],
                       "max_err": err}, f)
    print(f"DONE size {hvd.size()} rank {hvd.rank()} resets {resets[0]} "
          f"steps {len(state.steps)}", flush=True)
    print(f"OK {checks + 1}", flush=True)


HOST_UPDATES = T.HostUpdates()


def wait_for_discoveries(out_dir, more, timeout_s=120):
    """Returns once the launcher has run the discovery command ``more`` times from now."""
    runs = os.path.join(out_dir, "discoveries")

    def count():
        try:
            with open(runs) as f:
                return len(f.read())
        except FileNotFoundError:
            return 0

    want = count() + more
    T.wait_until(lambda: count() >= want,
                 lambda: f"the launcher ran discovery {count() - want + more} of {more} times",
                 timeout_s)

# The host whose worker fails, and the hosts the add and remove scenarios write: on one
# machine 127.0.0.1 next to localhost; on network-namespace hosts, their names.
VICTIM = os.environ.get("ELASTIC_VICTIM_HOST", "127.0.0.1")
FIRST = os.environ.get("ELASTIC_FIRST_HOST", "localhost")


def act(scenario, host, slot_lr, hosts_file, out_dir):
    victim = host == VICTIM and slot_lr == (0 if scenario == "twice" else 1)
    if scenario == "first":
        victim = host == FIRST and slot_lr == 1
    if scenario in ("kill", "twice", "first") and victim:
        print("killing myself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "raise" and victim:
        raise RuntimeError("a worker's own error, mid-epoch")
    if scenario == "all":
        raise RuntimeError("every worker's own error, mid-epoch")
    if scenario in ("add", "remove", "replace") and hvd.rank() == 0:
        lines = [f"{FIRST}:2"] + ([f"{VICTIM}:2"] if scenario == "add" else [])
        if scenario == "replace":
            lines = ["127.0.0.2:2"]
        HOST_UPDATES.expect()
        tmp = hosts_file + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, hosts_file)
        if scenario == "replace":
            # The launcher makes no membership of new workers alone, so no update comes to
            # wait for: train on until it has run discovery three times since the change (the
            # test's discovery command counts its runs). The first may have read the old file,
            # the second read the new one, and the launcher runs them one after another, taking
            # each one's hosts before it starts the next.
            wait_for_discoveries(out_dir, 3)
            return
        # Train on once the launcher has published the membership that takes the change, so
        # that it lands at the next commit however long the launcher takes to see it.
        HOST_UPDATES.wait(f"writing {hosts_file}")


if __name__ == "__main__":
    main()
