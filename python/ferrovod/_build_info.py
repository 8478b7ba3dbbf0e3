"""What this build holds and what this machine offers it: :func:`build_info`, the run-time
search for GPU libraries (:func:`gpu_libraries`), and Horovod's ``*_built`` and
``*_enabled`` queries."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, Dict, List, Optional

from . import _core


def _nccl_wheel_dirs() -> List[str]:
    """``lib`` directories of the ``nvidia-nccl-*`` wheel (torch's CUDA builds install it),
    found without importing torch."""
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        return []
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return [os.path.join(r, "lib") for r in roots if os.path.isdir(os.path.join(r, "lib"))]


_gpu_libraries: Optional[Dict[str, Any]] = None


def gpu_libraries() -> Dict[str, Any]:
    """What the run-time search for GPU libraries found (done once per process, never raises):
    ``{"nccl": {"found", "version", "path" | "reason"}, "cuda": {"found", "devices" |
    "reason"}}``. Nothing is linked at build time; ``FERROVOD_NCCL_LIBRARY`` names the NCCL
    library to use."""
    global _gpu_libraries
    if _gpu_libraries is None:
        probe = dict(_core.gpu_probe(_nccl_wheel_dirs()))
        _gpu_libraries = {k: dict(v) for k, v in probe.items()}
    return {k: dict(v) for k, v in _gpu_libraries.items()}


def build_info() -> Dict[str, Any]:
    """What this build contains: version, transports, controllers and backends, and (as
    ``nccl_library`` and ``cuda_driver``) what the run-time search for GPU libraries found."""
    info = dict(_core.build_info())
    gpu = gpu_libraries()
    info["nccl_library"] = gpu["nccl"]
    info["cuda_driver"] = gpu["cuda"]
    return info


def gloo_built() -> bool:
    """True: ferrovod's own controller and data plane take the place Gloo has in Horovod (a
    job that needs no MPI), which is what a script asking this wants to know; no Gloo library
    is involved."""
    return True


def gloo_enabled() -> bool:
    """Whether the job is formed (ferrovod's controller, in Gloo's place: see
    :func:`gloo_built`)."""
    return bool(_core.is_initialized())


def mpi_built() -> bool:
    """False: ferrovod does not link MPI."""
    return False


def mpi_enabled() -> bool:
    """False: ferrovod does not link MPI."""
    return False


def mpi_threads_supported() -> bool:
    """False: ferrovod does not link MPI."""
    return False


def nccl_built() -> int:
    """As in Horovod, the NCCL version code (e.g. 23007) collectives of GPU tensors run on, 0 when
    none. ferrovod's NCCL backend is in every build and loads NCCL at run time, so this is the
    code of the library ``gpu_libraries()`` found — when the engine dispatches CUDA tensors to
    NCCL (``build_info()["device_dispatch"]``, on unless ``FERROVOD_NCCL_DISPATCH=0``);
    otherwise 0: they are staged through host memory."""
    if not _core.build_info().get("device_dispatch"):
        return 0
    nccl = gpu_libraries()["nccl"]
    return int(nccl.get("code", 0)) if nccl.get("found") else 0


def cuda_built() -> bool:
    """Whether CUDA support is built in."""
    return False


def rocm_built() -> bool:
    """Whether ROCm support is built in."""
    return False


def ddl_built() -> bool:
    """Whether IBM DDL support is built in."""
    return False


def ccl_built() -> bool:
    """Whether oneCCL support is built in."""
    return False
