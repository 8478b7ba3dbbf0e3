"""Type stubs for the native module built from src/python/ (see docs/architecture.md)."""

from typing import Dict, List, Optional, Sequence, Tuple

__version__: str

ALLREDUCE: int
ALLGATHER: int
BROADCAST: int
ALLTOALL: int
REDUCESCATTER: int
BARRIER: int

Average: int
Sum: int
Adasum: int
Min: int
Max: int
Product: int

DTYPE_UINT8: int
DTYPE_INT8: int
DTYPE_INT16: int
DTYPE_INT32: int
DTYPE_INT64: int
DTYPE_FLOAT16: int
DTYPE_BFLOAT16: int
DTYPE_FLOAT32: int
DTYPE_FLOAT64: int
DTYPE_BOOL: int

def init(
    process_sets: Sequence[Sequence[int]] = ...,
    dynamic: bool = ...,
    rendezvous_addr: Optional[str] = ...,
    secret: Optional[bytes] = ...,
    generation: Optional[int] = ...,
) -> None: ...
def launch_info() -> Dict[str, object]: ...
def interfaces() -> List[Tuple[str, str, int]]: ...
def log_settings() -> Tuple[str, bool, int]: ...
def reset_log_cache() -> None: ...
def shutdown() -> None: ...
def is_initialized() -> bool: ...
def topology() -> Tuple[int, int, int, int, int, int, bool]: ...
def enqueue(
    kind: int,
    name: str,
    set_id: int,
    tensors: Sequence[Tuple[int, int, int, Sequence[int], int]],
    op: int = ...,
    root: int = ...,
    prescale: float = ...,
    postscale: float = ...,
    splits: Sequence[int] = ...,
) -> CoreHandle: ...
def enqueue_arrays(
    kind: int,
    name: str,
    set_id: int,
    inputs: Sequence[object],
    outputs: Sequence[Optional[object]],
    op: int = ...,
    root: int = ...,
    prescale: float = ...,
    postscale: float = ...,
    splits: Sequence[int] = ...,
) -> Optional[CoreHandle]: ...
def join() -> CoreHandle: ...
def add_process_set(ranks: Sequence[int]) -> int: ...
def remove_process_set(id: int) -> bool: ...
def process_sets() -> Dict[int, List[int]]: ...
def start_timeline(path: str, mark_cycles: bool = ...) -> None: ...
def stop_timeline() -> None: ...
def build_info() -> Dict[str, object]: ...
def env_vars() -> List[Tuple[str, Optional[str], str, str]]: ...

class CoreHandle:
    def poll(self) -> bool: ...
    def wait(self) -> Tuple[List[Tuple[OwnedBuffer, List[int]]], List[int], Optional[int]]: ...

class OwnedBuffer:
    @property
    def __array_interface__(self) -> Dict[str, object]: ...
    def __len__(self) -> int: ...

class RendezvousServer:
    def __init__(self, secret: bytes, host: str = ...) -> None: ...
    @property
    def addr(self) -> str: ...
    def set(self, key: str, value: bytes) -> None: ...
    def close(self) -> None: ...

class StoreClient:
    def __init__(self, addr: str, secret: bytes, timeout_s: float) -> None: ...
    def get(self, key: str, timeout_s: float) -> Optional[bytes]: ...
    def add(self, key: str, delta: int) -> int: ...
