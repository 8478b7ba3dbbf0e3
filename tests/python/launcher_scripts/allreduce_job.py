"""A real ferrovod job: init() from the launcher's environment, one allreduce, print the result.

Rank r contributes [r+1, 2(r+1), ..., 5(r+1)]; the test computes the sum independently.
"""

import json

import ferrovod as fv
import numpy as np


def main():
    fv.init()
    mine = np.arange(1, 6, dtype=np.float64) * (fv.rank() + 1)
    total = fv.allreduce(mine, op=fv.Sum, name="launcher.check")
    topo = [
        fv.rank(),
        fv.size(),
        fv.local_rank(),
        fv.local_size(),
        fv.cross_rank(),
        fv.cross_size(),
    ]
    print("RESULT " + json.dumps({"topology": topo, "sum": total.tolist()}))
    fv.shutdown()


if __name__ == "__main__":
    main()
