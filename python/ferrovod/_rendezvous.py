"""How the ranks find the rendezvous store when no launcher of ours hands out its address:
``init()`` asks :func:`find` before it starts the engine.

Under ``mpirun`` without ``FERROVOD_RENDEZVOUS_ADDR`` the ranks agree over MPI (mpi4py); under
torchrun whose agent store the workers may use, through that store; and where torch's
variables describe the job and its process group is already up (Ray Train's ``TorchTrainer``,
a script that calls ``init_process_group`` first), through that group's store. Either way rank 0
picks an address of its own every other host can reach, a port it listens on (kept open and
handed to its engine, so that nothing can take the port between the answer and the store's
start) and (unless ``FERROVOD_SECRET`` is set) a random secret, and every rank gets the same
answer — or the same error. Everything else about the launch (which launcher, rank, size, the
address when the environment gives it) is parsed by the engine
(``_core.read_settings().launch()``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from . import _core
from .exceptions import InvalidArgumentError


class Found(NamedTuple):
    """What ``init()`` starts the engine with: the rendezvous address and the job secret (None:
    the environment's own), and on rank 0 the socket listening on that address's port, for its
    engine to serve the rendezvous store on."""

    addr: Optional[str]
    secret: Optional[bytes]
    listener: Optional[socket.socket] = None


def find(comm: Optional[Any], info: Dict[str, Any]) -> Found:
    """The rendezvous to start the engine with, given what the engine made of the environment
    (``_core.read_settings().launch()``): found over MPI or through torchrun's agent store when
    the launch needs that, else nothing (the environment's own)."""
    if info["needs_mpi_rendezvous"]:
        return over_mpi(comm, info)
    if info["agent_store"] is not None:
        return through_agent_store(info)
    store = torch_group_store(info)
    if store is not None:
        return through_group_store(store, info)
    return Found(None, None)


#: How many rendezvous this process made through torch's process group: each ``init()`` takes
#: its own keys in the group's store, and every rank calls ``init()`` as often.
_group_rounds = 0


#: How many rendezvous this process made through torchrun's agent store (as _group_rounds).
_agent_rounds = 0


def torch_group_store(info: Dict[str, Any]) -> Optional[Any]:
    """The store of torch's default process group, when this rank's job comes from the torch
    variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with no rendezvous address of ours,
    and the script (or Ray Train's ``TorchTrainer``, which does it before the training function
    runs) has started that group: its store then holds ``MASTER_PORT``. torch is looked up,
    never imported."""
    if info["launcher"] != "torchrun" or os.environ.get("FERROVOD_RENDEZVOUS_ADDR"):
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    if dist.get_world_size() != info["size"] or dist.get_rank() != info["rank"]:
        raise InvalidArgumentError(
            f"torch's process group has rank {dist.get_rank()} of {dist.get_world_size()} but "
            f"RANK and WORLD_SIZE say rank {info['rank']} of {info['size']}: set "
            "FERROVOD_RENDEZVOUS_ADDR=<rank 0's host>:<free port> on every rank instead")
    return dist.distributed_c10d._get_default_store()


def through_group_store(store: Any, info: Dict[str, Any]) -> Found:
    """The exchange of :func:`through_agent_store`, through the store of torch's process
    group: rank 0 listens on an address and a port of its own, so ferrovod's store never
    contends for ``MASTER_PORT``."""
    global _group_rounds
    _group_rounds += 1
    return exchange(store, f"ferrovod/rendezvous/{_group_rounds}/", info,
                    "torch's process group store")


def is_world_comm(comm: Any) -> bool:
    # An mpi4py communicator exists only once mpi4py is imported: look it up, never import it.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not isinstance(comm, mpi.Comm):
        return False
    return bool(comm.Get_size() == mpi.COMM_WORLD.Get_size())


def over_mpi(comm: Optional[Any], info: Dict[str, Any]) -> Found:
    """Open MPI / Hydra with no rendezvous address: one exchange over MPI. Every rank
    allgathers its host name and IPv4 interfaces; rank 0 picks an address of its own that every
    other host can reach (a shared subnet), listens on a port there and, unless
    ``FERROVOD_SECRET`` is set, picks a random secret, and broadcasts them. Without mpi4py:
    nothing, and the engine reports that it has no rendezvous address."""
    try:
        from mpi4py import MPI
    except ImportError:
        return Found(None, None)
    comm = MPI.COMM_WORLD if comm is None else comm
    if comm.Get_size() != info["size"]:
        raise InvalidArgumentError(
            f"the launcher ({info['launcher']}) says {info['size']} ranks but mpi4py's "
            f"communicator has {comm.Get_size()}: is mpi4py built against another MPI than the "
            "one that started this job? Set FERROVOD_RENDEZVOUS_ADDR instead")
    everyone = comm.allgather(host_identity(info))
    root = next((i for i, e in enumerate(everyone) if e[0] == 0), 0)
    reply: Tuple[str, Any, Any] = ("error", "", None)
    listener = None
    if comm.Get_rank() == root:
        reply, listener = answer(everyone, root, info)
    status, text, secret = comm.bcast(reply, root=root)
    if status != "ok":
        raise InvalidArgumentError(f"finding a rendezvous address over MPI: {text}")
    return Found(text, secret, listener)


def host_identity(info: Dict[str, Any]) -> Tuple[int, str, List[Tuple[str, str, int]]]:
    """(rank, host name, IPv4 interfaces): what rank 0 needs to pick a reachable address."""
    return (info["rank"], socket.gethostname(), [tuple(i) for i in _core.interfaces()])


def answer(everyone: List[Any], root: int,
           info: Dict[str, Any]) -> Tuple[Tuple[str, Any, Any], Optional[socket.socket]]:
    """Rank 0's answer, ("ok", "ip:port", secret or None) or ("error", message, None), and the
    socket listening on that port for the store rank 0's engine serves there: a port closed
    here and bound again by the engine could be taken meanwhile (another rank's connection
    picks its source port from the same range).

    Whatever goes wrong here must reach every rank as an answer, or they would wait forever.
    """
    listener = None
    try:
        ip = rendezvous_ip(everyone, root, info["iface"])
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        return ("ok", f"{ip}:{port}", None if info["secret_set"] else os.urandom(32)), listener
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by the caller
        if listener is not None:
            listener.close()
        return ("error", f"{e}", None), None


def through_agent_store(info: Dict[str, Any]) -> Found:
    """Under torchrun: the same exchange as over MPI, through torchrun's own store (which its
    workers may use, ``TORCHELASTIC_USE_AGENT_STORE=True``). Rank 0 picks a free port instead
    of assuming ``MASTER_PORT``+1 is free — with torchrun's default, a random ``MASTER_PORT``,
    that port may belong to anything. Without torch importable: nothing, and the engine uses
    ``MASTER_PORT``+1."""
    try:
        import datetime

        from torch.distributed import TCPStore
    except ImportError:
        return Found(None, None)
    endpoint, prefix = info["agent_store"]
    host, port = endpoint.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=float(info["start_timeout"]))
    try:
        store = TCPStore(host, int(port), is_master=False, timeout=timeout)
    except (RuntimeError, OSError, ValueError) as e:
        raise InvalidArgumentError(
            f"finding a rendezvous address through torchrun's store at {endpoint}: {e}. Set "
            "FERROVOD_RENDEZVOUS_ADDR=<rank 0's host>:<free port> on every rank instead") from None
    # Each init() of this process takes keys of its own (every rank calls it as often): a second
    # one must not read the first one's answer.
    global _agent_rounds
    _agent_rounds += 1
    return exchange(store, f"{prefix}ferrovod/rendezvous/{_agent_rounds}/", info,
                    f"torchrun's store at {endpoint}")


def exchange(store: Any, prefix: str, info: Dict[str, Any], what: str) -> Found:
    """Every rank puts its host identity under ``prefix`` in a torch store; rank 0 answers
    (:func:`answer`) under the same prefix, and every rank returns that answer."""
    listener = None
    try:
        me = host_identity(info)
        store.set(f"{prefix}host/{info['rank']}", json.dumps(me))
        if info["rank"] == 0:
            everyone = [json.loads(store.get(f"{prefix}host/{r}")) for r in range(info["size"])]
            (status, text, secret), listener = answer(everyone, 0, info)
            store.set(f"{prefix}reply", json.dumps([status, text, secret.hex() if secret else None]))
        status, text, secret_hex = json.loads(store.get(f"{prefix}reply"))
    except (RuntimeError, OSError, ValueError) as e:
        if listener is not None:
            listener.close()
        raise InvalidArgumentError(
            f"finding a rendezvous address through {what}: {e}. Set "
            "FERROVOD_RENDEZVOUS_ADDR=<rank 0's host>:<free port> on every rank instead") from None
    if status != "ok":
        raise InvalidArgumentError(f"finding a rendezvous address through {what}: {text}")
    return Found(text, bytes.fromhex(secret_hex) if secret_hex else None, listener)


def rendezvous_ip(everyone: List[Any], root: int, iface: Optional[str]) -> str:
    """Rank 0's address for the rendezvous store, from ``(rank, hostname, interfaces)`` of
    every rank (``everyone[root]`` is rank 0's)."""

    def key(e: Any) -> Any:
        # A host is its name and its non-loopback addresses: containers on different machines
        # may share a host name.
        return (e[1], tuple(sorted(a for _, a, _ in e[2] if not a.startswith("127."))))

    def describe(e: Any) -> str:
        addrs = ", ".join(f"{n} {a}/{p}" for n, a, p in e[2]) or "no IPv4 interface"
        return f"{e[1]} ({addrs})"

    hosts: Dict[Any, Any] = {}
    for e in [everyone[root], *everyone]:
        hosts.setdefault(key(e), e)
    mine, others = everyone[root], [e for k, e in hosts.items() if k != key(everyone[root])]
    if iface:
        lacking = [e for e in hosts.values() if not any(n == iface for n, _, _ in e[2])]
        if lacking:
            raise InvalidArgumentError(
                f"FERROVOD_IFACE={iface}: no network interface {iface!r} with an IPv4 address on "
                + "; ".join(f"host {describe(e)}" for e in lacking))
        return str(next(a for n, a, _ in mine[2] if n == iface))
    if not others:
        return "127.0.0.1"
    for _, a, p in mine[2]:
        if a.startswith("127."):
            continue
        net = ipaddress.ip_network(f"{a}/{p}", strict=False)
        if all(any(ipaddress.ip_address(b) in net for _, b, _ in e[2]) for e in others):
            return str(a)
    raise InvalidArgumentError(
        "no network interface of rank 0's host shares a subnet with every other host. Rank 0: "
        + describe(mine) + "; others: " + "; ".join(describe(e) for e in others)
        + ". Set FERROVOD_IFACE=<interface> or FERROVOD_RENDEZVOUS_ADDR=<rank 0's address>:<port>")
