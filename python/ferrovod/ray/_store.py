"""The rendezvous store of a ``ferrovod.ray`` job, in the driver, and what every rank's
environment says about it (fixed and elastic jobs alike)."""

from __future__ import annotations

import secrets
from typing import Any, Dict, Iterable, Optional, Tuple

from ..runner.worker_env import SECRET_VAR


def start_store(timeout_s: float, nics: Optional[Iterable[str]]) -> Tuple[Any, Dict[str, str]]:
    """Starts a store on the address Ray knows this node by; returns it and the variables
    every rank gets (its address and secret, the launcher, the start timeout, the interface)."""
    import ray

    from .._core import RendezvousServer  # type: ignore[import-not-found,unused-ignore]

    secret = secrets.token_bytes(32)
    server = RendezvousServer(secret, ray.util.get_node_ip_address())
    common = {
        "FERROVOD_RENDEZVOUS_ADDR": str(server.addr),
        SECRET_VAR: secret.hex(),
        "FERROVOD_LAUNCHER": "ray",
        "FERROVOD_START_TIMEOUT": str(int(timeout_s)),
        "PYTHONUNBUFFERED": "1",
    }
    if nics:
        common["FERROVOD_IFACE"] = sorted(nics)[0]
    return server, common
