"""Proves the checking harness can fail: expects a wrong allreduce result on purpose."""

import numpy as np

import fvtest as T

import ferrovod as fv


def main():
    fv.init()
    ck = T.Checker(fv.rank())
    x = np.full(4, fv.rank() + 1, np.int32)
    res = fv.allreduce(x, op=fv.Sum, name="selfcheck")
    wrong = np.full(4, fv.size() * (fv.size() + 1) // 2 + 1, np.int32)  # off by one on purpose
    ck.array(res, wrong, "allreduce op=Sum dtype=int32 shape=(4,) (deliberately wrong reference)")
    return ck.count


if __name__ == "__main__":
    T.run_main(main)
