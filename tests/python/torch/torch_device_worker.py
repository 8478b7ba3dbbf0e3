"""The engine's NCCL path for CUDA tensors, on a machine without a GPU (3 ranks).

usage: torch_device_worker.py

- The native core's answer to "can CUDA tensors take the NCCL path here?" is no, with the
  reason (no CUDA driver, or no GPU), and the torch adapter holds the same answer, asked only
  once a CUDA tensor is at hand: CPU tensors never ask.
- Submissions described as CUDA memory (through the adapters' raw entry point; the addresses
  are host arrays, never dereferenced) fail on every rank with that reason, promptly — an
  allreduce, and a reducescatter whose output the binding sizes to this rank's share — and a
  rank on CUDA while the others are on the host gets a mismatch naming who sent what.
- Host ops stay correct afterwards (checked against sums computed here).
Prints ``OK <n_checks>``.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "workers"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fvtest as T  # noqa: E402

import ferrovod.torch as hvd  # noqa: E402
from ferrovod import _api, _build_info, _core  # noqa: E402
from ferrovod.exceptions import InvalidArgumentError, MismatchError  # noqa: E402
from ferrovod.process_sets import global_process_set  # noqa: E402
from ferrovod.torch import _cuda, ops  # noqa: E402

TIMEOUT_S = 20  # FERROVOD_TIMEOUT_SECONDS, set by the test


def fake_cuda(kind, name, arrays, out_arrays, **params):
    """Submits host arrays described as CUDA memory of device 0 (stream 0)."""
    descs = [(a.ctypes.data, a.nbytes, _core.DTYPE_FLOAT32, list(a.shape), o.ctypes.data)
             for a, o in zip(arrays, out_arrays)]
    h = ops._submit(kind, name, name, global_process_set, descs, lambda r: r,
                    [arrays, out_arrays], device=(0, 0), **params)
    return lambda: _api.synchronize(h)


def host_sum_ok(ck, r, n, name):
    x = torch.arange(7, dtype=torch.float32) + 10 * r
    want = sum(torch.arange(7, dtype=torch.float32) + 10 * k for k in range(n))
    ck.true(torch.equal(hvd.allreduce(x, op=hvd.Sum, name=name), want), f"host allreduce {name}",
            "wrong sum")


def main():
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    ck = T.Checker(r)
    ck.equal(n, 3, "size()")

    # CPU tensors never ask about the device path (nor load GPU libraries for it).
    host_sum_ok(ck, r, n, "before")
    ck.true(_cuda._device_path_answer is None, "a CPU job does not ask about the NCCL path",
            f"asked: {_cuda._device_path_answer!r}")

    usable, why = _core.device_path(_build_info._nccl_wheel_dirs())
    ck.equal(usable, False, "device path usable without a GPU")
    ck.true("CUDA cannot be used" in why, "why the device path is not usable", why)
    print(f"device path: {usable} ({why})", flush=True)
    ck.equal(_cuda._device_path(), (False, why), "the torch adapter's answer")
    ck.true(_core.device_op_check(_core.ALLREDUCE, _core.DTYPE_FLOAT32, hvd.Sum, 1.0, 1.0, n,
                                  [4]) is None, "an f32 allreduce suits NCCL")
    ck.true(_core.device_op_check(_core.ALLGATHER, _core.DTYPE_FLOAT32, hvd.Sum, 1.0, 1.0, n,
                                  [4]) is None, "an allgather suits NCCL")
    ck.true("0-d" in (_core.device_op_check(_core.ALLTOALL, _core.DTYPE_FLOAT32,
                                            hvd.Sum, 1.0, 1.0, n, []) or ""),
            "a 0-d alltoall is staged", "not refused")
    ck.true("not BARRIER" in (_core.device_op_check(_core.BARRIER, _core.DTYPE_FLOAT32,
                                                    hvd.Sum, 1.0, 1.0, n, []) or ""),
            "a barrier is not a device op", "not refused")

    a = np.arange(8, dtype=np.float32)
    start = time.monotonic()
    ck.raises(InvalidArgumentError, fake_cuda(_core.ALLREDUCE, "dev.a", [a], [a], op=hvd.Sum),
              "CUDA allreduce without CUDA", contains=("CUDA cannot be used",))
    rows = np.zeros((6, 2), dtype=np.float32)
    share = np.zeros((2, 2), dtype=np.float32)
    ck.raises(InvalidArgumentError,
              fake_cuda(_core.REDUCESCATTER, "dev.rs", [rows], [share], op=hvd.Sum),
              "CUDA reducescatter without CUDA", contains=("CUDA cannot be used",))
    took = time.monotonic() - start
    ck.true(took < TIMEOUT_S / 2, "CUDA ops fail promptly", f"took {took:.1f} s")

    b = np.ones(4, dtype=np.float32)
    if r == 1:
        mixed = fake_cuda(_core.ALLREDUCE, "dev.mixed", [b], [b], op=hvd.Sum)
    else:
        h = ops._submit(_core.ALLREDUCE, "dev.mixed", "dev.mixed", global_process_set,
                        [(b.ctypes.data, b.nbytes, _core.DTYPE_FLOAT32, [4], b.ctypes.data)],
                        lambda res: res, [b], op=hvd.Sum)
        mixed = lambda: _api.synchronize(h)  # noqa: E731
    ck.raises(MismatchError, mixed, "host on some ranks, CUDA on another",
              contains=("dev.mixed", "rank 1 sent CUDA", "ranks [0, 2] sent CPU"))

    host_sum_ok(ck, r, n, "after")
    hvd.shutdown()
    return ck.count


if __name__ == "__main__":
    T.run_main(main)
