"""``ferrovodrun --check-build`` and ``--version``: what this installation can do.

Frameworks are detected with :func:`importlib.util.find_spec` (never imported: importing torch
or TensorFlow takes seconds). Controllers and tensor-op backends come from the native core:
``ferrovod.build_info()`` and the Horovod-style ``*_built()`` queries.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

__all__ = [
    "FRAMEWORKS",
    "check_build",
    "ferrovod_version",
    "framework_available",
    "render_check_build",
]

# (label, framework module, ferrovod adapter module)
FRAMEWORKS: List[Tuple[str, str, str]] = [
    ("TensorFlow", "tensorflow", "ferrovod.tensorflow"),
    ("PyTorch", "torch", "ferrovod.torch"),
    ("Keras", "keras", "ferrovod.keras"),
    ("MXNet", "mxnet", "ferrovod.mxnet"),
]


def _module_found(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def framework_available(framework: str, adapter: str) -> bool:
    """True when both the framework and ferrovod's adapter for it are installed."""
    return _module_found(framework) and _module_found(adapter)


def _ferrovod_module() -> Optional[Any]:
    try:
        import ferrovod
    except ImportError:
        return None
    return ferrovod


def ferrovod_version() -> str:
    """``ferrovod.__version__``, else the installed distribution's version, else ``unknown``."""
    module = _ferrovod_module()
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version:
        return version
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version
    except ImportError:  # pragma: no cover - Python < 3.8
        return "unknown"
    try:
        return dist_version("ferrovod")
    except PackageNotFoundError:
        return "unknown"


def _names(value: Any) -> List[str]:
    """Lower-case names from a build-info entry: a list, a dict of flags, or a string."""
    if isinstance(value, str):
        return [part.strip().lower() for part in value.split(",") if part.strip()]
    if isinstance(value, Mapping):
        return [str(k).lower() for k, v in value.items() if v]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [str(v).lower() for v in value]
    return []


# build_info() entries that list what is built in.
_LIST_KEYS = (
    "transports",
    "controllers",
    "cpu_operations",
    "gpu_operations",
    "features",
    "backends",
)


def _has(info: Mapping[str, Any], name: str) -> bool:
    if name in info and not isinstance(info[name], (list, tuple, set, frozenset, Mapping)):
        return bool(info[name])
    return any(name in _names(info.get(key)) for key in _LIST_KEYS)


def _query(module: Any, name: str, info: Mapping[str, Any]) -> bool:
    """``ferrovod.<name>_built()`` when it exists, else what build_info says about ``name``."""
    fn = getattr(module, f"{name}_built", None)
    if callable(fn):
        try:
            return bool(fn())
        except Exception:  # noqa: BLE001 - a broken query reads as "not built"
            return False
    return _has(info, name)


_Collected = Tuple[
    Dict[str, bool], Dict[str, bool], Dict[str, bool], Optional[Mapping[str, Any]], Optional[str]
]


def _collect() -> _Collected:
    frameworks = {label: framework_available(fw, adapter) for label, fw, adapter in FRAMEWORKS}
    module = _ferrovod_module()
    build_info: Optional[Callable[[], Mapping[str, Any]]] = getattr(module, "build_info", None)
    if build_info is None:
        return (
            frameworks,
            {},
            {},
            None,
            "ferrovod.build_info() is not available (is the native core built?)",
        )
    try:
        info = dict(build_info())
    except Exception as exc:  # noqa: BLE001 - report, do not crash, on a broken install
        return frameworks, {}, {}, None, f"ferrovod.build_info() failed: {exc}"
    controllers = {
        "ferrovod (built in)": True,
        "MPI": _query(module, "mpi", info),
        "Gloo": _query(module, "gloo", info),
    }
    ops = {
        "TCP": _has(info, "tcp"),
        "Shared memory": _has(info, "shm"),
        "NCCL": _query(module, "nccl", info),
        "DDL": _query(module, "ddl", info),
        "CCL": _query(module, "ccl", info),
        "MPI": _query(module, "mpi", info),
        "Gloo": _query(module, "gloo", info),
    }
    return frameworks, controllers, ops, info, None


def _section(title: str, entries: Mapping[str, bool]) -> List[str]:
    lines = [f"{title}:"]
    lines.extend(f"    [{'X' if ok else ' '}] {label}" for label, ok in entries.items())
    return [*lines, ""]


def _gpu_section(info: Mapping[str, Any]) -> List[str]:
    """What the run-time search for NCCL and the CUDA driver found (build_info's
    ``nccl_library`` / ``cuda_driver``)."""
    nccl, cuda = info.get("nccl_library"), info.get("cuda_driver")
    if not isinstance(nccl, Mapping) or not isinstance(cuda, Mapping):
        return []
    lines = ["GPU libraries (looked for at run time):"]
    if nccl.get("found"):
        lines.append(f"    NCCL {nccl.get('version')}: {nccl.get('path')}")
    else:
        lines.append(f"    NCCL: {nccl.get('reason')}")
    if cuda.get("found"):
        lines.append(f"    CUDA driver {cuda.get('driver_version')}: {cuda.get('devices')} GPU(s)")
    else:
        lines.append(f"    CUDA driver: {cuda.get('reason')}")
    if not info.get("nccl"):
        lines.append("    CUDA tensors are staged through host memory (no NCCL backend in this build)")
    elif not (nccl.get("found") and cuda.get("found")):
        lines.append("    NCCL backend: built in, but CUDA tensors are staged through host memory "
                     "here (it needs both libraries above)")
    elif not info.get("device_dispatch"):
        lines.append("    NCCL backend: built in, off (FERROVOD_NCCL_DISPATCH=0): the engine stages "
                     "CUDA tensors through pinned host memory")
    else:
        lines.append("    NCCL backend: CUDA tensors of allreduce, broadcast and evenly split "
                     "reducescatter run on NCCL; others are staged through host memory")
    return [*lines, ""]


def render_check_build(
    version: str,
    frameworks: Mapping[str, bool],
    controllers: Mapping[str, bool],
    ops: Mapping[str, bool],
    info: Optional[Mapping[str, Any]] = None,
    problem: Optional[str] = None,
    verbose: bool = False,
) -> str:
    """The ``--check-build`` report, laid out as horovodrun lays it out."""
    lines = [f"ferrovod v{version}:", ""]
    lines += _section("Available Frameworks", frameworks)
    if problem is not None:
        lines += [f"Native core: not available: {problem}", ""]
    else:
        lines += _section("Available Controllers", controllers)
        lines += _section("Available Tensor Operations", ops)
        lines += _gpu_section(info or {})
        if verbose and info:
            lines += ["Build info:"] + [f"    {k}: {v}" for k, v in sorted(info.items())] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def check_build(verbose: bool = False) -> int:
    """Prints the ``--check-build`` report; returns 0, or 1 when the native core is missing."""
    frameworks, controllers, ops, info, problem = _collect()
    sys.stdout.write(
        render_check_build(ferrovod_version(), frameworks, controllers, ops, info, problem, verbose)
    )
    sys.stdout.flush()
    return 0 if problem is None else 1
