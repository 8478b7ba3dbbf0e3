"""The TensorFlow collectives (allreduce, allgather, broadcast, alltoall, reducescatter,
join, barrier) and their gradients, each run through :func:`._host_op._execute`."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from .. import _api, _core
from .. import process_sets as _ps
from .._api import Average, Sum
from .._same_lists import differences
from ..process_sets import ProcessSet, global_process_set
from ._host_op import (
    TFInvalidArgumentError,
    _check_dtype,
    _dtype_problem,
    _execute,
    _float,
    _from_wire,
    _grad_name,
    _label,
    _on_device,
    _op_name,
    _refused,
    _rest_shape,
    _set_rank,
    _set_size,
    _to_tensor,
    _to_wire,
    _unique_graph_name,
    _with_shape,
)


# ----------------------------------------------------------------------------- allreduce


def _allreduce_raw(tensors: List[tf.Tensor], names: Optional[str], op: int, pre: float,
                   post: float, process_set: ProcessSet, grouped: bool) -> List[tf.Tensor]:
    _ps._check_known(process_set)

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
    _ps._check_known(process_set)

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
    _ps._check_known(process_set)

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
    mine = [(lab, tuple(a.shape), a.dtype.name) for lab, a in zip(labels, arrays)]
    names = (None, None) if base is None else (f"{base}.check", f"{base}.describe")
    lines = differences(mine, lambda x: x[1:], "variables", names, process_set)
    if lines:
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
    _ps._check_known(process_set)
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
    _ps._check_known(process_set)

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
