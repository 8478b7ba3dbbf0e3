"""A rank killed in the middle of a sharded step whose ranks share host memory: every survivor
raises ``RankFailureError`` naming it, within bounded time, wherever it was waiting.

usage: torch_kill_worker.py WHERE   (WHERE: before_step | after_reduce)

Rank 1 SIGKILLs itself at step 3, either before ``step()`` (the others wait in the meeting
that says every rank's gradients are final) or right after reducing its shard (they wait in
the meeting after the update). Survivors print ``RANKFAIL rank_attr=R elapsed=S msg=...``.
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import torch  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.torch as hvd  # noqa: E402
from ferrovod.exceptions import RankFailureError  # noqa: E402

KILL_AT = 3


def main():
    where = sys.argv[1]
    hvd.init()
    r = hvd.rank()
    ck = T.Checker(r)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), sharded=True)
    ck.true(opt._step.shared, "host memory", "the ranks do not share host memory")
    if r == 1 and where == "after_reduce":

        class DieAfterReducing:
            """The optimizer's step buffer, but this rank dies once it has reduced its shard
            at step KILL_AT (the engine's object cannot be patched)."""

            def __init__(self, inner):
                self.inner = inner

            def __getattr__(self, name):
                return getattr(self.inner, name)

            def reduce_shard(self, *args):
                agreed = self.inner.reduce_shard(*args)
                if step == KILL_AT:
                    print("killing myself after reducing my shard", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                return agreed

        opt._step = DieAfterReducing(opt._step)
    if r != 1:
        signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM", flush=True))
    for step in range(KILL_AT + 100):
        x = torch.randn(32, 64)
        opt.zero_grad()
        model(x).square().mean().backward()
        if r == 1 and where == "before_step" and step == KILL_AT:
            print("killing myself before step()", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            opt.step()
        except RankFailureError as e:
            print(f"RANKFAIL step={step} rank_attr={e.rank} elapsed={time.monotonic() - t0:.3f} "
                  f"msg={e}", flush=True)
            sys.exit(0)
    raise RuntimeError("rank 1 never died")


if __name__ == "__main__":
    T.run_main(main)
