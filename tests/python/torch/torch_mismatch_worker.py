"""Ranks that wrap different parameters in DistributedOptimizer get a clear error, not a hang.

usage: torch_mismatch_worker.py KIND...   (KIND: extra | shape)

For each KIND in turn, the last rank builds a model that differs (one extra layer, or one layer
of another width); every rank must raise ValueError naming the difference, and the job must
stay usable (an allreduce is checked after each). Prints ``error <kind>: <message>`` for each,
then ``OK <n_checks>``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import torch  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.torch as hvd  # noqa: E402


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    odd = r == n - 1
    ck = T.Checker(r)
    for kind in sys.argv[1:]:
        layers = [torch.nn.Linear(4, 5 if (odd and kind == "shape") else 6)]
        if odd and kind == "extra":
            layers.append(torch.nn.Linear(6, 6))
        model = torch.nn.Sequential(*layers)
        e = ck.raises(ValueError, lambda: hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters()),
            f"{kind}: different parameters", contains=("different parameters", f"rank {n - 1}"))
        print(f"error {kind}: {e}", flush=True)
        # the job is still usable afterwards
        ck.equal(float(hvd.allreduce(torch.ones(1), op=hvd.Sum)), float(n),
                 f"allreduce after the {kind} error")
    hvd.shutdown()
    return ck.count


if __name__ == "__main__":
    T.run_main(main)
