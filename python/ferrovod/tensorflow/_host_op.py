"""How a TensorFlow collective runs: as a NumPy body now (eager) or as one stateful
``tf.numpy_function`` of the graph (:func:`_execute`, ordered in a TF1 graph by
:func:`_tf1_predecessor`), with TensorFlow's error classes, the dtype checks, the refusal
of what this rank cannot send, and the names ops are matched by across ranks."""

from __future__ import annotations

import os
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import _api
from ..exceptions import InvalidArgumentError, MismatchError
from ..process_sets import ProcessSet


class TFMismatchError(MismatchError, tf.errors.FailedPreconditionError):
    """Ranks disagreed about a collective: ``ferrovod.MismatchError`` and TensorFlow's
    ``FailedPreconditionError`` (what Horovod raises then), so either ``except`` catches it."""

    def __init__(self, message: str) -> None:
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)


class TFInvalidArgumentError(InvalidArgumentError, tf.errors.InvalidArgumentError):
    """Arguments no rank could satisfy: ``ferrovod.InvalidArgumentError`` (a ValueError) and
    TensorFlow's ``InvalidArgumentError``, as Horovod raises."""

    def __init__(self, message: str) -> None:
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)


def tf_error(error: BaseException) -> BaseException:
    """``error`` as the class TensorFlow code expects (see :class:`TFMismatchError`,
    :class:`TFInvalidArgumentError`); other errors are returned unchanged."""
    if isinstance(error, tf.errors.OpError):
        return error
    if isinstance(error, MismatchError):
        new: BaseException = TFMismatchError(str(error))
    elif isinstance(error, InvalidArgumentError):
        new = TFInvalidArgumentError(str(error))
    else:
        return error
    new.__dict__.update({k: v for k, v in error.__dict__.items() if not k.startswith("_")})
    return new


_NUMERIC = (tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16,
            tf.float32, tf.float64)
_SUPPORTED_TEXT = "uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64"


def _to_tensor(value: Any) -> tf.Tensor:
    """A tensor for ``value`` (tensors pass through; variables are read)."""
    if isinstance(value, tf.Tensor):
        return value
    return tf.convert_to_tensor(value)


def _label(tensor: Any, name: Optional[str]) -> str:
    """How error messages name a tensor: the op name, else the graph tensor name."""
    if name is not None:
        return str(name)
    try:
        return str(tensor.name)
    except (AttributeError, ValueError):
        return f"<eager tensor of shape {list(tensor.shape)}>"


# Data-movement ops (allgather, broadcast, alltoall) only copy bytes, so they also take bool
# and the unsigned types the engine has no reduction for: those travel as the signed type of
# the same width (a NumPy view, no copy) and come back as themselves.
_MOVE_ONLY = (tf.bool, tf.uint16, tf.uint32, tf.uint64)
_SIGNED_VIEW = {np.dtype(np.uint16): np.dtype(np.int16), np.dtype(np.uint32): np.dtype(np.int32),
                np.dtype(np.uint64): np.dtype(np.int64)}


def _dtype_problem(tensor: tf.Tensor, kind: str, label: str,
                   allow_bool: bool = False) -> Optional[str]:
    """Why ``tensor``'s dtype cannot go through ``kind`` (None: it can): the engine's numeric
    types, plus (``allow_bool``: a data-movement op) bool, uint16, uint32 and uint64."""
    dt = tensor.dtype
    if dt in _NUMERIC or (allow_bool and dt in _MOVE_ONLY):
        return None
    extra = ", bool, uint16, uint32, uint64" if allow_bool else ""
    return (f"{kind} of tensor '{label}': dtype {dt.name} is not supported "
            f"(supported: {_SUPPORTED_TEXT}{extra})")


def _check_dtype(tensor: tf.Tensor, kind: str, label: str, allow_bool: bool = False) -> None:
    """Raises what :func:`_dtype_problem` finds: for calls every rank makes alike (variable
    lists, whose agreement is checked before anything moves)."""
    problem = _dtype_problem(tensor, kind, label, allow_bool)
    if problem:
        raise TFInvalidArgumentError(problem)


def _refused(inputs: Sequence[tf.Tensor], kind: int, kind_name: str, name: Optional[str],
             process_set: ProcessSet, reason: str, touts: Sequence[tf.DType]) -> List[tf.Tensor]:
    """The op of an argument this rank cannot send (an unsupported dtype, a scalar, a root
    out of range): raising here alone would leave the other ranks waiting for it, so the op
    runs as this rank's refusal, negotiated under its name, and every rank of the set fails
    it with ``reason`` (TensorFlow's InvalidArgumentError), eagerly or when the graph runs."""
    def body(*_: np.ndarray) -> List[np.ndarray]:
        # Unnamed (eager) ops take the next automatic name of their kind, as the peers' do.
        full = _api._auto_name(kind_name, name)
        _api._now(_api._refuse(kind, full, process_set, reason, now=True))
        raise InvalidArgumentError(reason)  # the refusal above has raised on every rank

    return _execute(body, inputs, touts, "FerrovodRefused")


def _to_wire(a: np.ndarray) -> np.ndarray:
    """``a`` as the engine can move it (see :data:`_SIGNED_VIEW`)."""
    signed = _SIGNED_VIEW.get(a.dtype)
    return a if signed is None else a.view(signed)


def _from_wire(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return a if a.dtype == dtype else a.view(dtype)


def _normalize_name(name: str) -> str:
    """Horovod's rule: every character outside ``[a-zA-Z0-9_]`` becomes ``_``."""
    return re.sub("[^a-zA-Z0-9_]", "_", name)


# Names handed out per graph, so two ops of one graph never share a name.
_graph_names: "weakref.WeakKeyDictionary[Any, Dict[str, int]]" = weakref.WeakKeyDictionary()


def _unique_graph_name(base: str, ignore_name_scope: bool) -> str:
    """``base`` under the current name scope (unless ignored), unique within the default graph
    (TensorFlow's rule: a repeated name gets ``_1``, ``_2``, ...). Deterministic: the same
    program traces the same names on every rank and in every retrace."""
    if not ignore_name_scope:
        scope = tf.get_current_name_scope()
        if scope:
            base = f"{scope}/{base}"
    graph = tf.compat.v1.get_default_graph()
    used = _graph_names.setdefault(graph, {})
    if base not in used:
        used[base] = 1
        return base
    i = used[base]
    while f"{base}_{i}" in used:
        i += 1
    used[base] = i + 1
    used[f"{base}_{i}"] = 1
    return f"{base}_{i}"


def _op_name(prefix: str, tensor: Any, name: Optional[str], ignore_name_scope: bool) -> Optional[str]:
    """The engine name of an op: eager -> ``name`` (None: ``_api``'s call-order counter);
    graph -> ``name`` or ``<prefix>_<tensor name>``, scoped and unique within the graph."""
    if tf.executing_eagerly():
        return None if name is None else str(name)
    if name is None:
        name = f"{prefix}_{_normalize_name(_graph_label(tensor))}"
    return _unique_graph_name(str(name), ignore_name_scope)


def _graph_label(tensor: Any) -> str:
    """A graph tensor's name; an eager tensor the function captured has none (TensorFlow
    raises), so it goes by a fixed word that the graph's suffixes make unique."""
    try:
        return str(tensor.name)
    except AttributeError:
        return "captured"


def _grad_name(forward: Optional[str], prefix: str, dy: Any) -> Optional[str]:
    """The name of a gradient op, built when the backward pass is built."""
    if tf.executing_eagerly():
        return None if forward is None else f"{forward}.grad"
    if forward is None:
        forward = f"{prefix}_{_normalize_name(dy.name)}"
    return _unique_graph_name(f"{forward}.grad", True)


def _as_arrays(values: Sequence[Any]) -> List[np.ndarray]:
    # numpy_function hands 0-d tensors over as NumPy scalars: make them 0-d arrays.
    return [v if isinstance(v, np.ndarray) else np.asarray(v) for v in values]


# Op types whose output is data fed to or streamed into a TF1 session run: running a
# collective that depends on one needs a feed or consumes input.
_INPUT_OP_TYPES = frozenset({
    "Placeholder", "PlaceholderV2", "IteratorGetNext", "IteratorGetNextSync",
    "IteratorGetNextAsOptional", "MultiDeviceIteratorGetNextFromShard", "QueueDequeue",
    "QueueDequeueV2", "QueueDequeueMany", "QueueDequeueManyV2", "QueueDequeueUpTo",
    "QueueDequeueUpToV2", "ReaderRead", "ReaderReadV2", "ReaderReadUpTo", "ReaderReadUpToV2",
})


class _Tf1Order:
    """Per TF1 graph: the last collective host op created and which input ops
    (:data:`_INPUT_OP_TYPES`) it needs, with a memo of every op's input ops."""

    def __init__(self) -> None:
        self.last: Optional[Tuple[Any, frozenset]] = None
        self.inputs_of: Dict[str, frozenset] = {}

    def input_ops(self, tensors: Sequence[tf.Tensor]) -> frozenset:
        """Names of the input ops that ``tensors`` (transitively) depend on."""
        found: set = set()
        for t in tensors:
            found |= self._of(t.op)
        return frozenset(found)

    def _of(self, op: Any) -> frozenset:
        memo = self.inputs_of
        if op.name in memo:
            return memo[op.name]
        # Iterative post-order walk: graphs can be deeper than Python's recursion limit.
        stack = [(op, False)]
        while stack:
            cur, expanded = stack.pop()
            if cur.name in memo:
                continue
            deps = [i.op for i in cur.inputs] + list(cur.control_inputs)
            if not expanded:
                stack.append((cur, True))
                stack.extend((d, False) for d in deps if d.name not in memo)
                continue
            acc: set = {cur.name} if cur.type in _INPUT_OP_TYPES else set()
            for d in deps:
                acc |= memo.get(d.name, frozenset())
            memo[cur.name] = frozenset(acc)
        return memo[op.name]


_tf1_orders: "weakref.WeakKeyDictionary[Any, _Tf1Order]" = weakref.WeakKeyDictionary()


def _tf1_predecessor(graph: Any, inputs: Sequence[tf.Tensor]
                     ) -> Tuple[Optional[Any], _Tf1Order, frozenset]:
    """The collective host op that a new one in a TF1 graph must run after, if any.

    ``tf.function`` orders stateful ops itself (automatic control dependencies); a TF1 graph
    does not, and a collective is a host op that holds one of TensorFlow's inter-op threads
    until every rank has submitted it. With several collectives in one ``Session.run`` in no
    fixed order, ranks can fill their (few) threads with different collectives and wait on
    each other forever. So each new collective runs after the previous one of its graph, the
    order every rank creates them in. Running a collective therefore also runs the ones
    created before it (in its chain), except:

    * one that depends on an input (placeholder, dataset iterator, queue, reader) that the
      new one does not need: the chain is cut there, so that running the new one never needs
      a feed or consumes a batch it would not otherwise need (a ``broadcast_global_variables``
      built after the training op stays runnable on its own);
    * ones created before a collective of the graph failed: a script that caught the error
      goes on with a new chain;
    * one in another control-flow context (a TF1 ``while_loop`` / ``cond`` body).
    """
    order = _tf1_orders.get(graph)
    if order is None:
        order = _tf1_orders[graph] = _Tf1Order()
    mine = order.input_ops(inputs)
    prev = order.last
    if prev is None:
        return None, order, mine
    op, needs = prev
    if not needs <= mine:
        return None, order, mine
    if op._get_control_flow_context() is not graph._get_control_flow_context():
        return None, order, mine
    return op, order, mine


def _gate_failure(status: tf.Tensor) -> Any:
    """An op that raises ``tf.errors.FailedPreconditionError`` carrying ``status`` when
    ``status`` is not empty.

    Horovod raises FailedPreconditionError when ranks disagree about a collective, and
    scripts catch that class. A host op can only fail with the few codes TensorFlow maps
    Python exceptions to (ValueError/TypeError -> InvalidArgument, NotImplementedError ->
    Unimplemented, everything else -> Unknown), so the host op returns the failure instead
    and a kernel that fails with the right code raises it: reading a path below a file
    (``/dev/null/<message>``) fails with ENOTDIR, which TensorFlow reports as
    FailedPrecondition with the path -- the message -- in the text. It runs only on failure.
    """
    return tf.cond(tf.equal(status, ""), lambda: tf.constant(""),
                   lambda: tf.io.read_file(status), name="FerrovodCheck")


def _failure_path(error: BaseException) -> bytes:
    # Linux rejects paths of 4096 bytes or more (ENAMETOOLONG, another code): keep it shorter.
    text = f"{type(error).__name__}: {error}".replace("\0", " ")
    raw = text.encode("utf-8", "replace")[:3800].decode("utf-8", "ignore")
    # The message's first line is what TensorFlow's own log line about the failed op shows.
    return f"{os.devnull}/ferrovod: {raw}\n".encode("utf-8")


# AutoGraph has nothing to convert here (the branches are on how the op is built, not on
# tensors), and fails to on the nonlocal the TF1 ordering needs, warning in every trace.
@tf.autograph.experimental.do_not_convert
def _execute(body: Callable[..., Sequence[np.ndarray]], inputs: Sequence[tf.Tensor],
             touts: Sequence[tf.DType], node: str, collective: bool = True) -> List[Any]:
    """Runs ``body(*arrays) -> [array, ...]``: now (eager), or as one stateful
    ``tf.numpy_function`` of the current graph. Returns the outputs as tensors (graph mode
    with no outputs: ``[op]``).

    Errors are TensorFlow's classes as in Horovod: ranks that disagree raise
    ``tf.errors.FailedPreconditionError`` (also a ``ferrovod.MismatchError`` when eager),
    invalid arguments ``tf.errors.InvalidArgumentError`` (also a
    ``ferrovod.InvalidArgumentError`` when eager). In a TF1 graph a ``collective`` op is
    ordered after the previous one (see :func:`_tf1_predecessor`).
    """
    if tf.executing_eagerly():
        try:
            outs = body(*_as_arrays([t.numpy() for t in inputs]))
        except (MismatchError, InvalidArgumentError) as e:
            raise tf_error(e) from e
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outs, touts)]

    order: Optional[_Tf1Order] = None

    def run(*arrays: Any) -> List[Any]:
        try:
            outs = list(body(*_as_arrays(arrays)))
        except MismatchError as e:
            if order is not None:
                order.last = None  # see _tf1_predecessor: a failure starts a new chain
            empty = [np.zeros((0,), dtype=d.as_numpy_dtype) for d in touts]
            return empty + [np.asarray(_failure_path(e), dtype=object)]
        except BaseException:
            if order is not None:
                order.last = None
            raise
        return outs + [np.asarray(b"", dtype=object)]

    graph = tf.compat.v1.get_default_graph()
    tf1 = collective and not getattr(graph, "_add_control_dependencies", False)
    prev, needs = None, frozenset()
    if tf1:
        prev, order, needs = _tf1_predecessor(graph, inputs)
    with tf.control_dependencies([prev] if prev is not None else []):
        result = tf.numpy_function(run, list(inputs), list(touts) + [tf.string], stateful=True,
                                   name=node)
    if order is not None:
        order.last = (result[0].op, needs)
    status = result[-1]
    status.set_shape([])
    check = _gate_failure(status)
    with tf.control_dependencies([check]):
        if not touts:
            return [tf.group(check, name=f"{node}Done")]
        return [tf.identity(o) for o in result[:-1]]


def _set_size(process_set: ProcessSet) -> int:
    if process_set.process_set_id == 0:
        return _api.size()
    return len(process_set.ranks)


def _set_rank(process_set: ProcessSet) -> int:
    if process_set.process_set_id == 0:
        return _api.rank()
    return process_set.ranks.index(_api.rank())


def _with_shape(t: tf.Tensor, shape: Any) -> tf.Tensor:
    if not tf.executing_eagerly():
        t.set_shape(shape)
    return t


def _rest_shape(t: tf.Tensor) -> tf.TensorShape:
    """``t``'s static shape with dim 0 unknown (allgather, alltoall, reducescatter)."""
    if t.shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None] + t.shape.as_list()[1:])


def _on_device(out: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """Eager results are made on the host; move them to an accelerator input's device."""
    if tf.executing_eagerly():
        dev = getattr(like, "device", "") or ""
        if "GPU" in dev.upper():
            with tf.device(dev):
                return tf.identity(out)
    return out


def _float(t: tf.Tensor) -> bool:
    return bool(t.dtype.is_floating)
