"""The training run of ``scripts/elastic_soak.py``: NumPy linear regression through
``ferrovod.elastic`` (an ``ObjectState`` holding the weights, the epoch, the samples of the
epoch trained so far and every committed step's samples), running until the soak driver asks
it to stop.

Each step the ranks take the next ``size * BATCH`` samples of the epoch's order that no
committed step has trained, each rank its share; the summed gradient (an allreduce) divided by
the step's samples updates the weights. At the end rank 0 checks, independently of ferrovod,
that every epoch trained each sample once and the last one none twice, that every rank holds
the same weights, and that they equal a one-process replay of the committed steps; it writes
``result.json``. Rank 0 appends a line to ``progress`` at every commit (time, steps, size)
and each rank prints ``RESET size S`` when its state is reset.

usage: elastic_soak_worker.py OUT_DIR
"""

import json
import os
import sys
import time

import numpy as np

import ferrovod as fv

N, DIM, BATCH, COMMIT_EVERY, LR = 512, 8, 2, 3, 0.05
# Seconds per step, so that a soak's steps (and the state every commit copies) stay few.
STEP_SLEEP = float(os.environ.get("SOAK_STEP_SLEEP", "0.02"))


def data():
    g = np.random.default_rng(1234)
    x = g.standard_normal((N, DIM))
    y = x @ g.standard_normal(DIM) + 0.1 * g.standard_normal(N)
    return x, y


def order(epoch):
    return [int(i) for i in np.random.default_rng(epoch).permutation(N)]


def grad(w, x, y):
    return x.T @ (x @ w - y)


def main():
    out = sys.argv[1]
    stop_file = os.path.join(out, "stop")
    fv.init()
    x, y = data()
    state = fv.elastic.ObjectState(w=np.zeros(DIM), epoch=0, done=[], steps=[])
    state.register_reset_callbacks([lambda: print(f"RESET size {fv.size()}", flush=True)])

    def commit():
        state.commit()
        if fv.rank() == 0:
            with open(os.path.join(out, "progress"), "a") as f:
                f.write(f"{time.time():.3f} {len(state.steps)} {fv.size()}\n")

    @fv.elastic.run
    def train(state):
        while True:
            seen = set(state.done)
            rest = [i for i in order(state.epoch) if i not in seen]
            if not rest:
                state.epoch += 1
                state.done = []
                commit()
                continue
            size, rank = fv.size(), fv.rank()
            step = rest[:size * BATCH]
            mine = step[rank::size]
            g = fv.allreduce(grad(state.w, x[mine], y[mine]), op=fv.Sum, name="grad")
            state.w = state.w - LR * g / len(step)
            # As bytes, which a commit's deep copy shares instead of copying.
            state.steps.append(np.array(step, dtype=np.int32).tobytes())
            time.sleep(STEP_SLEEP)
            state.done = state.done + step
            asked = float(rank == 0 and os.path.exists(stop_file))
            stop = fv.allreduce(np.array([asked]), op=fv.Max, name="stop")[0] > 0
            if stop or len(state.steps) % COMMIT_EVERY == 0:
                commit()
            if stop:
                return

    train(state)
    every = fv.allgather(state.w[None, :], name="final")
    if fv.rank() == 0:
        problems = []
        if not np.array_equal(every, np.broadcast_to(state.w, every.shape)):
            problems.append("ranks' weights differ")
        steps = [np.frombuffer(b, dtype=np.int32).tolist() for b in state.steps]
        epoch, trained = 0, set()
        for s in steps:
            for i in s:
                if i in trained:
                    problems.append(f"epoch {epoch}: sample {i} trained twice")
                trained.add(i)
            if len(trained) == N:
                epoch, trained = epoch + 1, set()
        w = np.zeros(DIM)
        for s in steps:
            w = w - LR * grad(w, x[s], y[s]) / len(s)
        err = float(np.abs(w - state.w).max())
        if err > 1e-8:
            problems.append(f"weights differ from the replay by {err}")
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"steps": len(state.steps), "epochs": epoch, "size": fv.size(),
                       "replay_err": err, "problems": problems[:20]}, f)
    print(f"DONE rank {fv.rank()} size {fv.size()} steps {len(state.steps)}", flush=True)


if __name__ == "__main__":
    main()
