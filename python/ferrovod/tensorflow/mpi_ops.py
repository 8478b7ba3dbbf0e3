"""The TensorFlow collectives of ``ferrovod.tensorflow`` (Horovod's ``horovod.tensorflow.mpi_ops``).

There is no custom C++ op: every collective runs the framework-free engine (``ferrovod._api``)
on NumPy arrays.

* Eager mode: ``tensor.numpy()`` -> engine -> ``tf.convert_to_tensor``.
* Inside ``tf.function`` (graph mode): one ``tf.numpy_function(..., stateful=True)`` per
  collective. Stateful, so tf.function's automatic control dependencies run the collectives in
  program order: every rank then submits them in the same order, and two blocking host ops
  never race for TensorFlow's inter-op threads. Static output shapes are set where known
  (allreduce, broadcast: the input's; allgather, alltoall, reducescatter: all but dim 0).
* In a TF1 graph (``tf.compat.v1.Session``) nothing orders stateful ops, so each collective
  gets a control dependency on the one created before it (see :func:`_tf1_predecessor`).
* Errors: a mismatch between ranks is ``tf.errors.FailedPreconditionError``, an invalid
  argument ``tf.errors.InvalidArgumentError``, eagerly and in graphs (see :func:`_execute`).

Names: ops are matched across ranks by name. Inside a graph an unnamed op gets a name derived
at trace time from its input tensor's name (``HorovodAllreduce_<tensor name>``, under the
current name scope unless ``ignore_name_scope``), made unique within the graph by a ``_<n>``
suffix, so every step of a traced function reuses the same names and the engine's response
cache hits. In eager mode unnamed ops are named by ``ferrovod._api``'s call-order counters,
so every rank must issue them in the same order.

Gradients follow Horovod 0.28.1 and ``ferrovod.torch`` (registered with ``tf.custom_gradient``,
eager and graph): allreduce -> allreduce of the gradient with the same op and scale factors;
allgather -> Average-allreduce of the gradient, this rank's rows; broadcast -> Average-allreduce
on the root, zeros elsewhere; alltoall -> alltoall back with the received splits;
reducescatter -> allgather of the gradient times the scale factors (and the set size for Sum).
"""

from __future__ import annotations

import os
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import _api, _core
from .. import process_sets as _ps
from .._api import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from ..exceptions import InvalidArgumentError, MismatchError
from ..process_sets import ProcessSet, global_process_set

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "cross_rank", "cross_size", "is_homogeneous", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall", "reducescatter",
    "grouped_reducescatter", "join", "barrier",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled", "mpi_threads_supported",
    "nccl_built", "cuda_built", "ddl_built", "ccl_built", "rocm_built",
]

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


# ----------------------------------------------------------------------------- init


def init(comm: Optional[Any] = None, process_sets: Optional[Any] = None) -> None:
    """Starts ferrovod (``ferrovod.init``), then gives TensorFlow's thread pools this rank's
    share of the cores.

    When several ranks run on this host and the launcher gave this process a thread share
    (``OMP_NUM_THREADS``, set by ``ferrovodrun`` or by ``init()`` under mpirun/srun), and
    TensorFlow's runtime has not started yet and the user has not configured it, TensorFlow's
    intra-op parallelism is set to that share and its inter-op parallelism to 2 — otherwise
    two ranks on two cores would each run a pool as wide as the machine. Once TensorFlow's
    runtime has started (any tensor was created) its pools cannot change; they are left as
    they are and a debug message says so.
    """
    _api.init(comm=comm, process_sets=process_sets)
    _share_tf_threads()


def _share_tf_threads() -> None:
    import os

    from .. import _logging

    if _api.local_size() <= 1:
        return
    try:
        share = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return
    if share <= 0:
        return
    threading = tf.config.threading
    try:
        if threading.get_intra_op_parallelism_threads() == 0:
            threading.set_intra_op_parallelism_threads(share)
        if threading.get_inter_op_parallelism_threads() == 0:
            threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:
        _logging.LOGGER.debug("TensorFlow's runtime is already initialised: its thread pools "
                              "keep their sizes (call ferrovod.tensorflow.init() before "
                              "creating tensors to give each rank its share of the cores)")
        return
    _logging.LOGGER.debug("TensorFlow threads: intra-op %d, inter-op %d",
                          threading.get_intra_op_parallelism_threads(),
                          threading.get_inter_op_parallelism_threads())


# ----------------------------------------------------------------------------- plumbing


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
        name = f"{prefix}_{_normalize_name(tensor.name)}"
    return _unique_graph_name(str(name), ignore_name_scope)


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


# ----------------------------------------------------------------------------- allreduce


def _allreduce_raw(tensors: List[tf.Tensor], names: Optional[str], op: int, pre: float,
                   post: float, process_set: ProcessSet, grouped: bool) -> List[tf.Tensor]:
    def body(*arrays: np.ndarray) -> List[np.ndarray]:
        if grouped:
            return _api.grouped_allreduce(list(arrays), name=names, op=op, prescale_factor=pre,
                                          postscale_factor=post, process_set=process_set)
        return [_api.allreduce(arrays[0], name=names, op=op, prescale_factor=pre,
                               postscale_factor=post, process_set=process_set)]

    outs = _execute(body, tensors, [t.dtype for t in tensors],
                    "FerrovodGroupedAllreduce" if grouped else "FerrovodAllreduce")
    return [_on_device(_with_shape(o, t.shape), t) for o, t in zip(outs, tensors)]


def _allreduce(tensor: Any, name: Optional[str] = None, op: int = Sum,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               ignore_name_scope: bool = False,
               process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Differentiable allreduce of one dense tensor (no compression; ``op`` as given)."""
    return _grouped_allreduce([tensor], name, op, prescale_factor, postscale_factor,
                              ignore_name_scope, process_set, single=True)[0]


def _grouped_allreduce(tensors: Sequence[Any], name: Optional[str] = None, op: int = Sum,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       ignore_name_scope: bool = False,
                       process_set: ProcessSet = global_process_set,
                       single: bool = False) -> List[tf.Tensor]:
    """Differentiable allreduce of a list of dense tensors negotiated as one engine group
    (one ``numpy_function`` in graph mode)."""
    ts = [_to_tensor(t) for t in tensors]
    kind = "allreduce" if single else "grouped_allreduce"
    if not ts:
        return []
    prefix = "HorovodAllreduce" if single else "HorovodGroupedAllreduce"
    engine_name = _op_name(prefix, ts[0], name, ignore_name_scope)
    problems = [_dtype_problem(t, kind, _label(t, name if single else None)) for t in ts]
    problem = next((p for p in problems if p), None)
    if problem:
        return _refused(ts, _core.ALLREDUCE, kind, engine_name, process_set, problem,
                        [t.dtype for t in ts])
    args = (int(op), float(prescale_factor), float(postscale_factor), process_set, not single)
    if not all(_float(t) for t in ts):
        return _allreduce_raw(ts, engine_name, *args)

    @tf.custom_gradient
    def fn(*xs: tf.Tensor) -> Any:
        ys = _allreduce_raw(list(xs), engine_name, *args)

        def grad(*dys: Any) -> List[tf.Tensor]:
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            gname = _grad_name(engine_name, prefix, dys[0])
            return _allreduce_raw(list(dys), gname, *args)

        return ys, grad

    return list(fn(*ts))


# ----------------------------------------------------------------------------- allgather


def _allgather_raw(tensors: List[tf.Tensor], name: Optional[str], process_set: ProcessSet,
                   grouped: bool) -> List[tf.Tensor]:
    def body(*arrays: np.ndarray) -> List[np.ndarray]:
        wire = [_to_wire(a) for a in arrays]
        if grouped:
            outs = _api.grouped_allgather(wire, name=name, process_set=process_set)
        else:
            outs = [_api.allgather(wire[0], name=name, process_set=process_set)]
        return [_from_wire(o, a.dtype) for o, a in zip(outs, arrays)]

    outs = _execute(body, tensors, [t.dtype for t in tensors],
                    "FerrovodGroupedAllgather" if grouped else "FerrovodAllgather")
    return [_on_device(_with_shape(o, _rest_shape(t)), t) for o, t in zip(outs, tensors)]


def _allgather_grad_raw(dys: List[tf.Tensor], xs: List[tf.Tensor], name: Optional[str],
                        process_set: ProcessSet) -> List[tf.Tensor]:
    """Average-allreduce of the gathered gradients, then this rank's rows of each."""
    k = len(dys)

    def body(*arrays: np.ndarray) -> List[np.ndarray]:
        grads, rows = list(arrays[:k]), [int(r) for r in arrays[k:]]
        reduced = _api.grouped_allreduce(grads, name=name, op=Average, process_set=process_set)
        counts = _api.allgather(np.asarray([rows], dtype=np.int64),
                                name=None if name is None else f"{name}.rows",
                                process_set=process_set)
        r = _set_rank(process_set)
        offsets = counts[:r].sum(0) if r else np.zeros(k, dtype=np.int64)
        return [np.ascontiguousarray(g[int(o):int(o) + n]) for g, o, n in zip(reduced, offsets, rows)]

    rows = [tf.shape(x, out_type=tf.int64)[0] for x in xs]
    outs = _execute(body, list(dys) + rows, [d.dtype for d in dys], "FerrovodAllgatherGrad")
    return [_with_shape(o, x.shape) for o, x in zip(outs, xs)]


def _gather(tensors: Sequence[Any], name: Optional[str], ignore_name_scope: bool,
            process_set: ProcessSet, single: bool) -> List[tf.Tensor]:
    ts = [_to_tensor(t) for t in tensors]
    kind = "allgather" if single else "grouped_allgather"
    if not ts:
        return []
    prefix = "HorovodAllgather" if single else "HorovodGroupedAllgather"
    engine_name = _op_name(prefix, ts[0], name, ignore_name_scope)
    for t in ts:
        label = _label(t, name if single else None)
        problem = _dtype_problem(t, kind, label, allow_bool=True)
        if not problem and t.shape.rank == 0:
            problem = (f"{kind} of tensor '{label}': a 0-d (scalar) tensor cannot be gathered; "
                       "reshape it to (1,)")
        if problem:
            return _refused(ts, _core.ALLGATHER, kind, engine_name, process_set, problem,
                            [t.dtype for t in ts])
    if not all(_float(t) for t in ts):
        return _allgather_raw(ts, engine_name, process_set, not single)

    @tf.custom_gradient
    def fn(*xs: tf.Tensor) -> Any:
        ys = _allgather_raw(list(xs), engine_name, process_set, not single)

        def grad(*dys: Any) -> List[tf.Tensor]:
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            return _allgather_grad_raw(list(dys), list(xs),
                                       _grad_name(engine_name, prefix, dys[0]), process_set)

        return ys, grad

    return list(fn(*ts))


def allgather(tensor: Any, name: Optional[str] = None, ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Concatenates every rank's ``tensor`` along dim 0 in rank order (dim 0 may differ per
    rank; the other dims must match). Differentiable: the gradient is the average over the
    set of the incoming gradients, sliced to this rank's rows."""
    return _gather([tensor], name, ignore_name_scope, process_set, True)[0]


def grouped_allgather(tensors: Sequence[Any], name: Optional[str] = None,
                      ignore_name_scope: bool = False,
                      process_set: ProcessSet = global_process_set) -> List[tf.Tensor]:
    """Allgathers a list of tensors negotiated as one unit. Differentiable."""
    return _gather(list(tensors), name, ignore_name_scope, process_set, False)


# ----------------------------------------------------------------------------- broadcast


def _broadcast_raw(t: tf.Tensor, root_rank: int, name: Optional[str],
                   process_set: ProcessSet) -> tf.Tensor:
    def body(a: np.ndarray) -> List[np.ndarray]:
        out = _api.broadcast(_to_wire(a), root_rank, name=name, process_set=process_set)
        return [_from_wire(out, a.dtype)]

    out = _execute(body, [t], [t.dtype], "FerrovodBroadcast")[0]
    return _on_device(_with_shape(out, t.shape), t)


def _root_problem(root_rank: int) -> Optional[str]:
    r = int(root_rank)
    if _api.is_initialized() and not 0 <= r < _api.size():
        return f"broadcast received invalid root rank {r}: the job has {_api.size()} ranks"
    return None


def _check_root(root_rank: int) -> int:
    problem = _root_problem(root_rank)
    if problem:
        raise TFInvalidArgumentError(problem)
    return int(root_rank)


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None,
              ignore_name_scope: bool = False,
              process_set: ProcessSet = global_process_set) -> tf.Tensor:
    """Returns global rank ``root_rank``'s ``tensor`` on every rank of the set.
    Differentiable: the root gets the average of the incoming gradients, the others zeros."""
    t = _to_tensor(tensor)
    engine_name = _op_name("HorovodBroadcast", t, name, ignore_name_scope)
    problem = (_dtype_problem(t, "broadcast", _label(t, name), allow_bool=True)
               or _root_problem(root_rank))
    if problem:
        return _refused([t], _core.BROADCAST, "broadcast", engine_name, process_set, problem, [t.dtype])[0]
    root = int(root_rank)
    if not _float(t):
        return _broadcast_raw(t, root, engine_name, process_set)

    @tf.custom_gradient
    def fn(x: tf.Tensor) -> Any:
        y = _broadcast_raw(x, root, engine_name, process_set)

        def grad(dy: Any) -> tf.Tensor:
            dy = tf.zeros_like(y) if dy is None else dy
            g = _allreduce_raw([dy], _grad_name(engine_name, "HorovodBroadcast", dy), Average,
                               1.0, 1.0, process_set, False)[0]
            # g * 0, not zeros_like(g): TensorFlow builds zeros_like of a tensor with a known
            # shape without reading it, and a TF1 session would then prune this rank's
            # allreduce while the root waits for it.
            return g if _api.rank() == root else g * tf.constant(0, g.dtype)

        return y, grad

    return fn(t)


def _variables_check(arrays: Sequence[np.ndarray], labels: Sequence[str], base: Optional[str],
                     what: str, process_set: ProcessSet) -> None:
    """Raises on every rank, naming the difference, when the ranks passed different variable
    lists (count, shapes, dtypes): their per-variable broadcasts would never all match."""
    import hashlib

    desc = [(tuple(a.shape), a.dtype.name) for a in arrays]
    digest = np.frombuffer(hashlib.sha256(repr(desc).encode()).digest(), dtype=np.uint8)
    check = None if base is None else f"{base}.check"
    seen = _api.allgather(digest, name=check, process_set=process_set).reshape(-1, 32)
    if all((row == seen[0]).all() for row in seen):
        return
    mine = [(lab, s, d) for lab, (s, d) in zip(labels, desc)]
    every = _api.allgather_object(mine, name=None if base is None else f"{base}.describe",
                                  process_set=process_set)
    ranks = process_set.ranks if process_set.process_set_id != 0 else list(range(_api.size()))
    lines = []
    for r, d in zip(ranks, every):
        if [x[1:] for x in d] == [x[1:] for x in every[0]]:
            continue
        diff = next((i for i, (a, b) in enumerate(zip(every[0], d)) if a[1:] != b[1:]),
                    min(len(d), len(every[0])))
        theirs = d[diff] if diff < len(d) else "nothing"
        first = every[0][diff] if diff < len(every[0]) else "nothing"
        lines.append(f"rank {r} has {len(d)} variables, rank {ranks[0]} has {len(every[0])}; "
                     f"first difference at position {diff}: rank {r} {theirs} vs rank "
                     f"{ranks[0]} {first}")
    raise TFInvalidArgumentError(
        f"{what}: the ranks passed different variables (number, shapes or dtypes), so "
        "their broadcasts could never match: " + "; ".join(lines))


def _broadcast_values(values: List[tf.Tensor], labels: List[str], root_rank: int,
                      base: Optional[str], what: str,
                      process_set: ProcessSet) -> List[tf.Tensor]:
    """One host op: check that every rank passed the same variable list, then broadcast every
    value from ``root_rank`` (all in flight at once)."""
    root = _check_root(root_rank)

    def body(*arrays: np.ndarray) -> List[np.ndarray]:
        _variables_check(arrays, labels, base, what, process_set)
        handles = [_api.broadcast_async(_to_wire(a), root,
                                        name=None if base is None else f"{base}.{i}",
                                        process_set=process_set)
                   for i, a in enumerate(arrays)]
        return [_from_wire(_api.synchronize(h), a.dtype) for h, a in zip(handles, arrays)]

    outs = _execute(body, values, [v.dtype for v in values], "FerrovodBroadcastVariables")
    if not values:
        return []
    return [_with_shape(o, v.shape) for o, v in zip(outs, values)]


def _var_label(v: Any, i: int) -> str:
    for attr in ("path", "name"):
        try:
            val = getattr(v, attr, None)
        except (AttributeError, ValueError):
            val = None
        if val:
            return str(val)
    return f"#{i}"


def _assign_broadcast(variables: Sequence[Any], root_rank: int, name: Optional[str],
                      default_base: str, what: str, process_set: ProcessSet) -> List[Any]:
    if callable(variables) and not isinstance(variables, (list, tuple)):
        variables = variables()  # Horovod scripts pass opt.variables(): accept the method too
    variables = list(variables)
    values, labels = [], []
    for i, v in enumerate(variables):
        if not hasattr(v, "assign"):
            raise TFInvalidArgumentError(f"{what}: entry {i} is a {type(v).__name__}, not a "
                                       "variable (it has no assign())")
        t = _to_tensor(v)
        _check_dtype(t, what, _var_label(v, i), allow_bool=True)
        values.append(t)
        labels.append(_var_label(v, i))
    if tf.executing_eagerly():
        base = name or default_base
    else:
        base = _unique_graph_name(name or default_base, True)
    outs = _broadcast_values(values, labels, root_rank, base, what, process_set)
    return [v.assign(o) for v, o in zip(variables, outs)]


def broadcast_(variables: Sequence[Any], root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> List[Any]:
    """Overwrites each variable (``tf.Variable`` or Keras variable) with ``root_rank``'s value.
    Every rank must pass the same number of variables with the same shapes and dtypes; a
    difference is an error on every rank (checked first, so nothing hangs). Returns what each
    ``assign`` returns."""
    return _assign_broadcast(variables, root_rank, name, "broadcast_", "broadcast_", process_set)


# ----------------------------------------------------------------------------- alltoall


def alltoall(tensor: Any, splits: Any = None, name: Optional[str] = None,
             ignore_name_scope: bool = False,
             process_set: ProcessSet = global_process_set) -> Any:
    """Sends ``splits[i]`` rows of dim 0 to set rank i (default: equal split) and concatenates
    what arrives in rank order. Returns the output, or ``(output, received_splits)`` (int32)
    when ``splits`` is given. Differentiable with respect to ``tensor``."""
    t = _to_tensor(tensor)
    label = _label(t, name)
    want_splits = splits is not None
    problem = _dtype_problem(t, "alltoall", label, allow_bool=True)
    if not problem and t.shape.rank == 0:
        problem = f"alltoall of tensor '{label}': a 0-d (scalar) tensor has no first dimension"
    if problem:
        outs = _refused([t], _core.ALLTOALL, "alltoall", _op_name("HorovodAlltoall", t, name, ignore_name_scope),
                        process_set, problem, [t.dtype, tf.int32])
        return (outs[0], outs[1]) if want_splits else outs[0]
    if splits is None:
        # An empty list asks the engine for an equal split (it checks that dim 0 divides),
        # and still returns the received splits, which the gradient needs.
        split_t = tf.zeros([0], dtype=tf.int32)
    else:
        split_t = tf.reshape(tf.cast(_to_tensor(splits), tf.int32), [-1])
    engine_name = _op_name("HorovodAlltoall", t, name, ignore_name_scope)
    nset = _set_size(process_set) if _api.is_initialized() else None

    def raw(x: tf.Tensor, s: tf.Tensor, nm: Optional[str]) -> Tuple[tf.Tensor, tf.Tensor]:
        def body(a: np.ndarray, sp: np.ndarray) -> List[np.ndarray]:
            out, received = _api.alltoall(_to_wire(a), splits=sp, name=nm,
                                          process_set=process_set)
            return [_from_wire(out, a.dtype), np.asarray(received, dtype=np.int32)]

        out, received = _execute(body, [x, s], [x.dtype, tf.int32], "FerrovodAlltoall")
        return (_on_device(_with_shape(out, _rest_shape(x)), x),
                _with_shape(received, tf.TensorShape([nset])))

    received_box: List[tf.Tensor] = []
    if not _float(t):
        out, received = raw(t, split_t, engine_name)
    else:
        @tf.custom_gradient
        def fn(x: tf.Tensor) -> Any:
            y, rec = raw(x, split_t, engine_name)
            received_box.append(rec)

            def grad(dy: Any) -> tf.Tensor:
                dy = tf.zeros_like(y) if dy is None else dy
                g, _ = raw(dy, rec, _grad_name(engine_name, "HorovodAlltoall", dy))
                return _with_shape(g, x.shape)

            return y, grad

        out = fn(t)
        received = received_box[0]
    return (out, received) if want_splits else out


# ----------------------------------------------------------------------------- reducescatter


def _reducescatter_raw(tensors: List[tf.Tensor], name: Optional[str], op: int, pre: float,
                       post: float, process_set: ProcessSet, grouped: bool) -> List[tf.Tensor]:
    def body(*arrays: np.ndarray) -> List[np.ndarray]:
        if grouped:
            return _api.grouped_reducescatter(list(arrays), name=name, op=op,
                                              process_set=process_set, prescale_factor=pre,
                                              postscale_factor=post)
        return [_api.reducescatter(arrays[0], name=name, op=op, process_set=process_set,
                                   prescale_factor=pre, postscale_factor=post)]

    outs = _execute(body, tensors, [t.dtype for t in tensors],
                    "FerrovodGroupedReducescatter" if grouped else "FerrovodReducescatter")
    return [_on_device(_with_shape(o, _rest_shape(t)), t) for o, t in zip(outs, tensors)]


def _reducescatter_impl(tensors: Sequence[Any], name: Optional[str], op: int,
                   ignore_name_scope: bool, process_set: ProcessSet, prescale_factor: float,
                   postscale_factor: float, single: bool) -> List[tf.Tensor]:
    ts = [_to_tensor(t) for t in tensors]
    kind = "reducescatter" if single else "grouped_reducescatter"
    if not ts:
        return []
    prefix = "HorovodReducescatter" if single else "HorovodGroupedReducescatter"
    engine_name = _op_name(prefix, ts[0], name, ignore_name_scope)
    problems = []
    if int(op) not in (Sum, Average):
        problems.append("Reducescatter currently only supports AVERAGE and SUM.")
    for t in ts:
        label = _label(t, name if single else None)
        problems.append(_dtype_problem(t, kind, label))
        if t.shape.rank == 0:
            problems.append(f"{kind} of tensor '{label}': a 0-d (scalar) tensor has no first "
                            "dimension to scatter")
    problem = next((p for p in problems if p), None)
    if problem:
        return _refused(ts, _core.REDUCESCATTER, kind, engine_name, process_set, problem,
                        [t.dtype for t in ts])
    args = (int(op), float(prescale_factor), float(postscale_factor), process_set, not single)
    if not all(_float(t) for t in ts):
        return _reducescatter_raw(ts, engine_name, *args)
    scale = float(prescale_factor) * float(postscale_factor)

    @tf.custom_gradient
    def fn(*xs: tf.Tensor) -> Any:
        ys = _reducescatter_raw(list(xs), engine_name, *args)

        def grad(*dys: Any) -> List[tf.Tensor]:
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            gs = _allgather_raw(list(dys), _grad_name(engine_name, prefix, dys[0]),
                                process_set, not single)
            # Horovod's convention (and ferrovod.torch's): Sum -> size x the allgathered
            # gradient, Average -> 1 x, times the scale factors.
            s = scale * _set_size(process_set) if int(op) == Sum else scale
            return [_with_shape(g * tf.cast(s, g.dtype) if s != 1.0 else g, x.shape)
                    for g, x in zip(gs, xs)]

        return ys, grad

    return list(fn(*ts))


def reducescatter(tensor: Any, name: Optional[str] = None, op: int = Average,
                  ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Reduces across the set (Sum or Average) and returns this rank's rows of dim 0 (the
    lowest ranks get one extra row when dim 0 does not divide evenly). Differentiable."""
    return _reducescatter_impl([tensor], name, op, ignore_name_scope, process_set, prescale_factor,
                          postscale_factor, True)[0]


def grouped_reducescatter(tensors: Sequence[Any], name: Optional[str] = None,
                          op: int = Average, ignore_name_scope: bool = False,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[tf.Tensor]:
    """Reducescatters a list of tensors negotiated as one unit. Differentiable."""
    return _reducescatter_impl(list(tensors), name, op, ignore_name_scope, process_set,
                          prescale_factor, postscale_factor, False)


def _reducescatter(tensor: Any, name: Optional[str] = None, op: int = Sum,
                   ignore_name_scope: bool = False, process_set: ProcessSet = global_process_set,
                   prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """Horovod's ``mpi_ops._reducescatter``: :func:`reducescatter` with Sum by default and no
    compression."""
    return _reducescatter_impl([tensor], name, op, ignore_name_scope, process_set,
                               prescale_factor, postscale_factor, True)[0]


def _grouped_reducescatter(tensors: Sequence[Any], name: Optional[str] = None, op: int = Sum,
                           ignore_name_scope: bool = False,
                           process_set: ProcessSet = global_process_set,
                           prescale_factor: float = 1.0,
                           postscale_factor: float = 1.0) -> List[tf.Tensor]:
    """Horovod's ``mpi_ops._grouped_reducescatter``: :func:`grouped_reducescatter` with Sum by
    default."""
    return _reducescatter_impl(list(tensors), name, op, ignore_name_scope, process_set,
                               prescale_factor, postscale_factor, False)


# ----------------------------------------------------------------------------- join, barrier


def join() -> tf.Tensor:
    """Declares this rank out of data: until every rank has joined, it takes part in the
    others' allreduces with zeros. Returns (as an int32 scalar tensor) the last rank to join."""
    def body() -> List[np.ndarray]:
        return [np.asarray(_api.join(), dtype=np.int32)]

    out = _execute(body, [], [tf.int32], "FerrovodJoin")[0]
    return _with_shape(out, tf.TensorShape([]))


def barrier(process_set: ProcessSet = global_process_set) -> Any:
    """Returns once every rank of ``process_set`` has called it. Horovod's TensorFlow module
    has no barrier; this one is harmless. Eager: None; in a graph: the op."""
    def body() -> List[np.ndarray]:
        _api.barrier(process_set=process_set)
        return []

    out = _execute(body, [], [], "FerrovodBarrier")
    return None if tf.executing_eagerly() else out[0]


# ----------------------------------------------------------------------------- graph-time queries


def _set_by_id(process_set_id: int) -> ProcessSet:
    if int(process_set_id) == 0:
        return global_process_set
    for ps in _ps._registered:
        if ps.process_set_id == int(process_set_id):
            return ps
    raise TFInvalidArgumentError(f"no registered process set has id {process_set_id}")


def _query_op(fn: Callable[[], int], name: Optional[str]) -> tf.Tensor:
    """An int32 scalar whose value is read when the op runs (graph) or now (eager)."""
    def body() -> List[np.ndarray]:
        return [np.asarray(fn(), dtype=np.int32)]

    out = _execute(body, [], [tf.int32], name or "FerrovodQuery", collective=False)[0]
    return _with_shape(out, tf.TensorShape([]))


def rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's global rank, read when the graph runs."""
    return _query_op(_api.rank, name)


def local_rank_op(name: Optional[str] = None) -> tf.Tensor:
    """This process's local rank, read when the graph runs."""
    return _query_op(_api.local_rank, name)


def size_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks in the process set ``process_set_id``, read when the graph runs."""
    return _query_op(lambda: _set_size(_set_by_id(process_set_id)), name)


def local_size_op(name: Optional[str] = None) -> tf.Tensor:
    """The number of ranks on this host, read when the graph runs."""
    return _query_op(_api.local_size, name)


def process_set_included_op(process_set_id: int = 0, name: Optional[str] = None) -> tf.Tensor:
    """1 when this process belongs to process set ``process_set_id``, else 0 (int32)."""
    return _query_op(lambda: int(bool(_set_by_id(process_set_id).included())), name)
