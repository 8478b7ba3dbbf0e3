"""What every op does with its arguments before the engine sees them: the reduction and
dtype codes, NumPy views of the caller's tensors, op names and process-set ids, and
:class:`_BadArgument` for what this rank cannot send."""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional

import numpy as np

from . import _core
from ._lifecycle import _instance_counters, _name_counters, rank, size
from .exceptions import InvalidArgumentError
from .process_sets import ProcessSet

Average = _core.Average
Sum = _core.Sum
Adasum = _core.Adasum
Min = _core.Min
Max = _core.Max
Product = _core.Product

_DTYPES: Dict[str, int] = {
    "uint8": _core.DTYPE_UINT8,
    "int8": _core.DTYPE_INT8,
    "int16": _core.DTYPE_INT16,
    "int32": _core.DTYPE_INT32,
    "int64": _core.DTYPE_INT64,
    "float16": _core.DTYPE_FLOAT16,
    "bfloat16": _core.DTYPE_BFLOAT16,
    "float32": _core.DTYPE_FLOAT32,
    "float64": _core.DTYPE_FLOAT64,
    "bool": _core.DTYPE_BOOL,
}

Tensor = Any


class _BadArgument(InvalidArgumentError):
    """An argument this rank cannot submit an op with. Raised only before anything is
    submitted; the op functions then refuse the op through the engine (``_api._refuse``), so
    that the other members of the set fail it too instead of waiting for it."""


def _as_array(tensor: Tensor) -> np.ndarray:
    """A NumPy view of ``tensor`` (zero-copy for arrays and CPU DLPack objects)."""
    if isinstance(tensor, np.ndarray):
        return tensor
    if tensor is None:
        raise _BadArgument("expected an array or a tensor, got None")
    if hasattr(tensor, "__dlpack__"):
        try:
            return np.from_dlpack(tensor)
        except (TypeError, RuntimeError, BufferError) as e:
            raise _BadArgument(
                f"cannot read a {type(tensor).__name__} through DLPack ({e}); pass a CPU tensor "
                "or a NumPy array"
            ) from e
    arr = np.asarray(tensor)
    if arr.dtype == object:
        raise _BadArgument(f"expected an array or a tensor, got {type(tensor).__name__}")
    return arr


def _writable(tensor: Tensor, arr: np.ndarray, what: str) -> None:
    """Refuses an in-place op on memory it cannot write back into: a read-only array, or an
    object (a list, bytes) that ``arr`` is a copy of."""
    if not (isinstance(tensor, np.ndarray) or hasattr(tensor, "__dlpack__")):
        raise _BadArgument(
            f"{what} writes its result into its input, which must be an array or a tensor; "
            f"got a {type(tensor).__name__} (use the out-of-place {what.rstrip('_')})")
    if not arr.flags.writeable:
        raise _BadArgument(f"{what} writes its result into its input, which is read-only")


def _root(root_rank: Any) -> int:
    """``root_rank`` as a global rank of this job, or refused."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, (int, np.integer)):
        raise _BadArgument(f"root_rank must be an integer rank, got {root_rank!r} "
                           f"({type(root_rank).__name__})")
    if not 0 <= int(root_rank) < size():
        raise _BadArgument(
            f"broadcast received invalid root rank {int(root_rank)}: the job has {size()} ranks")
    return int(root_rank)


def _contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself when the engine can read it as it lies (C-contiguous, native byte order),
    else a copy that is (the engine reduces raw bytes: a byte-swapped array would be summed as
    garbage)."""
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if arr.flags.c_contiguous:
        return arr
    # np.ascontiguousarray turns a 0-d array into shape (1,): keep 0-d tensors 0-d.
    return np.ascontiguousarray(arr).reshape(arr.shape)


# Keyed by the dtype object: ``dtype.name`` builds a string per call (several µs, a tenth of
# a small allreduce).
_DTYPE_CODES: Dict[np.dtype, int] = {}


def _dtype_code(arr: np.ndarray, what: str) -> int:
    code = _DTYPE_CODES.get(arr.dtype)
    if code is not None:
        return code
    code = _DTYPES.get(arr.dtype.name)
    if code is None:
        raise _BadArgument(
            f"{what}: dtype {arr.dtype} is not supported (supported: {', '.join(_DTYPES)})"
        )
    _DTYPE_CODES[arr.dtype] = code
    return code


def _ptr(arr: np.ndarray) -> int:
    # __array_struct__ through the engine: ~0.2 µs against 3-4 µs for __array_interface__.
    address = _core.array_address(arr)
    if address is None:
        address = arr.__array_interface__["data"][0]
    return int(address)


class OpName(str):
    """An op's name built as ``<kind>.<base>``, as Horovod's torch names ops
    (``allreduce.grad``, ``broadcast.grad``, ``grouped_allreduce.grad``): the name the engine
    matches and shows, which also tells it where the base begins (``base_at``), the part ops
    of other kinds share. The engine keeps ops under one base in the order each rank called
    them, so ranks that disagree on an op's kind fail instead of waiting; it never reads the
    name for the kind. The engine's binding reads ``base_at`` from the name it is handed. A
    name with nothing after its kind shares nothing: a plain ``str``."""

    base_at: int

    def __new__(cls, kind: str, base: str) -> str:  # type: ignore[misc]
        if not base:
            return f"{kind}."
        made = super().__new__(cls, f"{kind}.{base}")
        made.base_at = len(kind) + 1
        return made

    def __reduce__(self) -> Any:
        # Copied or pickled, it is made again from its two parts.
        return (OpName, (self[: self.base_at - 1], self[self.base_at:]))


def _auto_name(kind: str, name: Optional[str]) -> str:
    if isinstance(name, str):
        return name  # an OpName stays one
    if name is not None:
        return str(name)
    counter = _name_counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _instance_number(kind: str, process_set: ProcessSet) -> int:
    """How many ``kind`` objects (an optimizer wrapper, say) this rank made before on
    ``process_set``, to name the new one's collectives. Counted per set, so that the members
    of a set agree whenever they make its objects in one order, whatever the members of other
    sets made: one count for every set would leave a rank outside a set behind its members,
    and the next object on a set they share would wait for names that never come."""
    # The global set by its id: its ranks are only filled in by init().
    key = () if process_set.process_set_id == 0 else tuple(process_set.ranks)
    counter = _instance_counters.setdefault((kind, key), itertools.count())
    return next(counter)


def _set_id(process_set: ProcessSet) -> int:
    if process_set.process_set_id is None:
        raise InvalidArgumentError(
            f"{process_set} has not been registered (pass it to init(process_sets=...) or "
            "add_process_set)"
        )
    if process_set.process_set_id != 0 and rank() not in process_set.ranks:
        raise InvalidArgumentError(
            f"rank {rank()} is not a member of the provided process set {process_set.ranks}"
        )
    return int(process_set.process_set_id)


_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max",
             Product: "Product"}


def _resolve_op(op: Optional[int], average: Optional[bool], default: int = Average) -> int:
    """The reduction's code, or refused (a float, a string or an unknown code is not one)."""
    if op is not None and average is not None:
        raise _BadArgument("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        return Average if average else Sum
    if op is None:
        return default
    if isinstance(op, bool) or not isinstance(op, (int, np.integer)) or int(op) not in _OP_NAMES:
        raise _BadArgument(f"op={op!r} is not a reduction: use Sum, Average, Min, Max or Product "
                           "(ferrovod.Sum, ...)")
    return int(op)
