"""Host lists for ``ferrovodrun``: ``-H``/``--hostfile`` parsing, locality and rank assignment.

Rank assignment follows ``horovodrun`` (``get_host_assignments``): hosts are filled in the order
given, slot by slot; ``local_rank`` is the index of a process on its host, ``cross_rank`` the
order of its host among the hosts that have that local rank, and ``cross_size`` the number of
such hosts.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

__all__ = [
    "HostInfo",
    "HostSpecError",
    "SlotInfo",
    "get_host_assignments",
    "is_local_host",
    "parse_hostfile",
    "parse_hostfile_text",
    "parse_hosts",
    "remote_hosts",
]

# Host names as horovodrun accepts them, plus bracketed IPv6 literals ("[::1]:2").
_HOST_RE = re.compile(r"^(?P<host>[\w.-]+|\[[0-9A-Fa-f:.]+\])(?::(?P<slots>[^:]*))?$")

_LOCAL_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class HostSpecError(ValueError):
    """A host list or hostfile that cannot be parsed, or slots that cannot hold the job."""


@dataclass(frozen=True)
class HostInfo:
    """One host and how many processes (slots) it may run."""

    hostname: str
    slots: int


@dataclass(frozen=True)
class SlotInfo:
    """Where one process runs and its place in the global, local and cross groups."""

    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int


def _parse_slots(text: str, where: str) -> int:
    try:
        slots = int(text)
    except ValueError:
        raise HostSpecError(f"{where}: slots must be a positive integer, got {text!r}") from None
    if slots < 1:
        raise HostSpecError(f"{where}: slots must be a positive integer, got {slots}")
    return slots


def _parse_host_item(item: str, where: str) -> HostInfo:
    """Parses ``host:N`` or ``host`` (one slot, as mpirun reads it)."""
    match = _HOST_RE.match(item.strip())
    if match is None:
        raise HostSpecError(
            f"{where}: invalid host {item.strip()!r}; expected <hostname>:<slots>, "
            "e.g. worker-0:2,worker-1:2"
        )
    slots_text = match.group("slots")
    slots = 1 if slots_text is None else _parse_slots(slots_text, where)
    return HostInfo(match.group("host"), slots)


def _reject_duplicates(hosts: List[HostInfo]) -> List[HostInfo]:
    """Refuses a host listed twice: its slots would be ambiguous and its local ranks collide."""
    seen: Set[str] = set()
    for host in hosts:
        key = host.hostname.lower()
        if key in seen:
            raise HostSpecError(f"host {host.hostname!r} is listed more than once")
        seen.add(key)
    return hosts


def parse_hosts(hosts: str) -> List[HostInfo]:
    """Parses a ``-H`` value such as ``"localhost:2,127.0.0.1:2"`` into host infos.

    A host without ``:N`` has one slot. Raises :class:`HostSpecError` on malformed input,
    non-positive slot counts or a host listed twice.
    """
    items = [item for item in hosts.split(",") if item.strip()]
    if not items:
        raise HostSpecError("empty host list")
    return _reject_duplicates([_parse_host_item(item, "-H/--hosts") for item in items])


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> List[HostInfo]:
    """Parses hostfile contents: one ``host slots=N``, ``host:N`` or ``host`` per line.

    Blank lines and ``#`` comments are skipped; Open MPI's ``max_slots=N`` is accepted and
    ignored.
    """
    hosts: List[HostInfo] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        tokens = line.split()
        host = _parse_host_item(tokens[0], where)
        for token in tokens[1:]:
            key, sep, value = token.partition("=")
            if sep and key == "slots":
                host = HostInfo(host.hostname, _parse_slots(value, where))
            elif sep and key == "max_slots":
                continue
            else:
                raise HostSpecError(f"{where}: unexpected {token!r}; expected '<host> slots=<n>'")
        hosts.append(host)
    if not hosts:
        raise HostSpecError(f"{source}: no hosts listed")
    return _reject_duplicates(hosts)


def parse_hostfile(path: str) -> List[HostInfo]:
    """Reads and parses a hostfile (see :func:`parse_hostfile_text`)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise HostSpecError(f"cannot read hostfile {path!r}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        raise HostSpecError(
            f"{path}:{lineno}: not a text hostfile (byte 0x{data[exc.start]:02x} is not UTF-8); "
            "expected lines of '<host> slots=<n>'"
        ) from None
    if "\0" in text:
        lineno = text.count("\n", 0, text.index("\0")) + 1
        raise HostSpecError(
            f"{path}:{lineno}: not a text hostfile (it holds a NUL byte); "
            "expected lines of '<host> slots=<n>'"
        )
    return parse_hostfile_text(text, source=path)


def get_host_assignments(
    hosts: Iterable[HostInfo], min_np: int, max_np: Optional[int] = None
) -> List[SlotInfo]:
    """Assigns ranks to host slots the way horovodrun does.

    Hosts are filled in order, slot by slot, until ``max_np`` processes are placed (all slots
    when ``max_np`` is None). Raises :class:`HostSpecError` when fewer than ``min_np`` slots
    exist.
    """
    placed: List[Tuple[str, List[int]]] = []  # (hostname, [global ranks]) per host, in order
    # local_rank -> {hostname: cross_rank}; dicts keep insertion order, i.e. host order.
    cross: Dict[int, Dict[str, int]] = {}
    rank = 0
    for host in hosts:
        ranks: List[int] = []
        for local_rank in range(host.slots):
            if max_np is not None and rank >= max_np:
                break
            ranks.append(rank)
            rank += 1
            at_local = cross.setdefault(local_rank, {})
            at_local[host.hostname] = len(at_local)
        placed.append((host.hostname, ranks))

    size = rank
    if size < min_np:
        raise HostSpecError(
            f"requested more processes ({min_np}) than there are available slots ({size})"
        )

    slots: List[SlotInfo] = []
    for hostname, ranks in placed:
        for local_rank, global_rank in enumerate(ranks):
            at_local = cross[local_rank]
            slots.append(
                SlotInfo(
                    hostname=hostname,
                    rank=global_rank,
                    local_rank=local_rank,
                    cross_rank=at_local[hostname],
                    size=size,
                    local_size=len(ranks),
                    cross_size=len(at_local),
                )
            )
    return slots


def _strip_brackets(name: str) -> str:
    return name[1:-1] if name.startswith("[") and name.endswith("]") else name


def _is_loopback_literal(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _this_machine_names() -> Set[str]:
    """Names and addresses of this machine; may consult the resolver, so only called lazily."""
    names: Set[str] = set()
    try:
        hostname = socket.gethostname()
    except OSError:
        return names
    names.update({hostname, hostname.split(".", 1)[0]})
    try:
        names.add(socket.getfqdn(hostname))
    except OSError:
        pass
    try:
        _, aliases, addresses = socket.gethostbyname_ex(hostname)
        names.update(aliases)
        names.update(addresses)
    except OSError:
        pass
    return {n.lower() for n in names if n}


def is_local_host(name: str, this_machine: Optional[Set[str]] = None) -> bool:
    """True when ``name`` is this machine: localhost, a loopback address, or its own name/FQDN.

    ``this_machine`` may pass a precomputed set of this machine's names (lower case).
    """
    plain = _strip_brackets(name.strip()).lower()
    if plain in _LOCAL_NAMES or _is_loopback_literal(plain):
        return True
    names = _this_machine_names() if this_machine is None else this_machine
    return plain in names


def remote_hosts(hosts: Iterable[HostInfo]) -> List[str]:
    """Names of the hosts in ``hosts`` that are not this machine, in order."""
    this_machine: Optional[Set[str]] = None
    remote: List[str] = []
    for host in hosts:
        plain = _strip_brackets(host.hostname).lower()
        if plain in _LOCAL_NAMES or _is_loopback_literal(plain):
            continue
        if this_machine is None:
            this_machine = _this_machine_names()
        if not is_local_host(host.hostname, this_machine):
            remote.append(host.hostname)
    return remote
