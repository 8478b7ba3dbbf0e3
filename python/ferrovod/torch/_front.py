"""The C++ half of torch.distributed's backend ``"ferrovod"``: ``_front.cpp``, built on first
use against the torch installed here and kept in torch's extension cache (``TORCH_EXTENSIONS_DIR``,
by default ``~/.cache/torch_extensions``), one build per torch version.

torch hands a backend written in Python only the collectives, its name, and of the work it
returns only ``wait`` and ``get_future``: ``Work.is_completed()`` stays false and a receive
from any source cannot say who sent. The C++ half is a ``c10d::Backend`` whose every op is the
Python backend's (:mod:`ferrovod.torch.process_group`) and whose work asks the Python work those
two questions too. Where it cannot be built (no C++ compiler, no ``ninja``), the backend runs
without it, and says so once.
"""

from __future__ import annotations

import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

_SOURCE = Path(__file__).with_name("_front.cpp")
_lock = threading.Lock()
_built: Optional[Any] = None
_tried = False


def _build() -> Any:
    """The compiled module (built here the first time this torch version asks for it; other
    processes of the host wait for that build and load it)."""
    from torch.utils import cpp_extension

    # The build is only right for the torch it was compiled against: one name per version.
    version = re.sub(r"[^0-9A-Za-z]+", "_", torch.__version__)
    path = os.environ.get("PATH", "")
    try:
        # torch runs `ninja` from PATH, where pip's ninja is not unless its venv is activated.
        import ninja  # type: ignore[import-not-found]

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    except ImportError:
        pass
    try:
        return cpp_extension.load(name=f"ferrovod_front_{version}", sources=[str(_SOURCE)],
                                  extra_cflags=["-O2"], verbose=False)
    finally:
        os.environ["PATH"] = path


def backend_class() -> Optional[Any]:
    """The C++ half's ``Backend(impl, rank, size)`` class, or None where it cannot be built."""
    global _built, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _built = _build().Backend
            except Exception as e:  # noqa: BLE001 - any reason leaves the Python half alone
                warnings.warn(
                    f"ferrovod: the C++ half of backend='ferrovod' could not be built against "
                    f"torch {torch.__version__} ({type(e).__name__}: {str(e)[:500]}); the "
                    f"backend runs without it: Work.is_completed() stays False and recv() "
                    f"needs src. It needs a C++ compiler, Python's headers and ninja (pip install ninja).",
                    RuntimeWarning, stacklevel=3)
        return _built


def wrap(impl: Any, rank: int, size: int) -> Any:
    """What torch gets for the Python backend ``impl``: the C++ half over it where that can be
    built, ``impl`` itself otherwise."""
    cls = backend_class()
    return impl if cls is None else cls(impl, rank, size)
