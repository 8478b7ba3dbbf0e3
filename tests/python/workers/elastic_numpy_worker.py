"""Elastic training without a framework (``ferrovod.elastic``): an ``ObjectState`` counts 20
steps, committed every 2; at step 5 the worker of host 127.0.0.1 with local rank 1 SIGKILLs
itself. The survivors restore the last commit and finish: every rank must end with exactly 20
steps counted (none lost, none counted twice) and agree on the values.

usage: elastic_numpy_worker.py [SCENARIO]
  kill   as above (the default)
  all    every worker raises an exception at step 5 instead
"""

import os
import signal
import sys

import numpy as np

import ferrovod as fv

STEPS, AT = 20, 5


def main():
    scenario = sys.argv[1] if len(sys.argv) > 1 else "kill"
    fv.init()
    host = os.environ["FERROVOD_HOSTNAME"]
    slot_lr = int(os.environ["FERROVOD_ELASTIC_LOCAL_RANK"])
    state = fv.elastic.ObjectState(step=0, counted=0, sizes=[])

    @fv.elastic.run
    def train(state):
        while state.step < STEPS:
            if state.step == AT and scenario == "all":
                raise RuntimeError("every worker's own error, mid-run")
            if state.step == AT and host == "127.0.0.1" and slot_lr == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            n = fv.allreduce(np.ones(1), op=fv.Sum, name="elastic.step")
            state.counted += 1
            state.sizes.append(int(n[0]))
            state.step += 1
            if state.step % 2 == 0:
                state.commit()

    train(state)
    everyone = fv.allgather_object((state.step, state.counted, state.sizes))
    assert all(e == everyone[0] for e in everyone), everyone
    assert state.counted == STEPS, state.counted
    print(f"DONE size {fv.size()} counted {state.counted} sizes {state.sizes}", flush=True)
    print("OK 2", flush=True)


if __name__ == "__main__":
    main()
