"""A Horovod script run as it is: ``ferrovodrun --as-horovod`` makes its ``import horovod.torch``
give ferrovod.torch. It trains with Horovod's names (broadcast_parameters, DistributedOptimizer)
and checks the result against single-process torch on the concatenated batches.

usage: horovod_alias_worker.py SEED

The model, the rank-dependent batches and the reference are the torch training tests' own
(torch/torch_train_worker.py). Prints ``weights <sha256>`` (for the test to compare ranks) and
``OK <n_checks>``.
"""

import hashlib
import sys
from pathlib import Path

# Imported before anything else names ferrovod: the alias must import it by itself.
import horovod.torch as hvd

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "torch")]

import fvtest as T  # noqa: E402

import ferrovod.torch  # noqa: E402
import torch_train_worker as W  # noqa: E402


def main() -> int:
    seed = int(sys.argv[1])
    hvd.init()
    run = W.Run(seed)
    ck = run.ck
    ck.true(hvd is ferrovod.torch, "horovod.torch is ferrovod.torch")
    ck.true(sys.modules["horovod.torch"] is sys.modules["ferrovod.torch"],
            "one module object under both names")
    ck.equal(hvd.__name__, "ferrovod.torch", "the module keeps its own name")
    ck.equal(hvd.size(), 2, "size")

    # Initialised differently on each rank, so the broadcast is what makes them equal.
    model = W.make_model(hvd.rank())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(W.sgd(model), named_parameters=model.named_parameters())
    ck.true(type(opt).__module__.startswith("ferrovod."), "ferrovod's DistributedOptimizer",
            type(opt).__module__)
    run.train(model, opt)  # each rank its own batch of every step

    weights = W.flat(model)
    run.same_on_all_ranks(weights, "weights identical on every rank")
    run.close(weights, W.flat(run.reference(W.sgd)),
              "weights equal single-process training on the concatenated batches")
    print(f"weights {hashlib.sha256(weights.numpy().tobytes()).hexdigest()}", flush=True)
    hvd.shutdown()
    return ck.count


if __name__ == "__main__":
    T.run_main(main)
