"""torch.distributed's front end: the process-group backend ``"ferrovod"``.

Importing :mod:`ferrovod.torch` registers it, so that a DDP, FSDP2 or torchrun script moves onto
ferrovod's engine by naming the backend::

    import ferrovod.torch  # noqa: F401  (registers the backend)
    torch.distributed.init_process_group("ferrovod")

The job forms over the store torch hands the backend (``env://``, ``tcp://``, ``file://``,
``store=``): there is no second rendezvous. Every op is one of the engine's, named
``<kind>.pg<group>.<n>`` (the n-th op of the group on every rank, since torch's collectives
are issued in one order), so it is negotiated, checked for agreement (shape, dtype, op, root)
and failed on every rank alike, as the Horovod API's ops are. Tensors are handed to the engine
by pointer, as :mod:`ferrovod.torch.ops` does (that module's functions are the way in); CUDA
tensors take the NCCL path there.

What each ``ProcessGroup`` method maps to:

- ``allreduce`` / ``allreduce_coalesced``: an in-place (grouped) allreduce. ``AVG`` is the
  engine's Average, ``PREMUL_SUM`` a Sum with the factor as pre-scale; ``BAND``, ``BOR`` and
  ``BXOR`` (integer tensors, rare) reduce locally over an allgather.
- ``broadcast``: an in-place broadcast. ``reduce``: an allreduce into a scratch tensor that
  the root copies.
- ``allgather`` / ``gather``: one allgather of the flat inputs, one row each; ``all_gather_single``
  (``all_gather_into_tensor``) gathers straight into the output.
- ``reduce_scatter`` / ``reduce_scatter_single``: a reducescatter of the flat input(s).
- ``alltoall`` / ``all_to_all_single`` / ``scatter``: an alltoall of flat inputs with splits.
- ``barrier``: a one-element allreduce. ``monitored_barrier``: through the store, naming the
  ranks that did not arrive in time, as gloo's does.

A group over some of the job's ranks (``new_group``, ``new_subgroups``, a device mesh's
dimensions) is an engine process set that its members register alone (torch asks only them).

Point-to-point ``send``/``recv`` (and so ``isend``, ``irecv``, ``batch_isend_irecv``): the
engine's point-to-point messages (``ferrovod.torch.ops._transfer_async``), which take no part
in the collectives' negotiation: a connection per direction between the two ranks, no process
set, a send done once its receive has taken it. A receive from any source is the engine's too:
it takes the first message of its tag to arrive from any rank (:class:`_FromAnyRank`).

torch holds this backend through its C++ half (:mod:`ferrovod.torch._front`) where that can be
built, which asks this one's work what torch asks of a C++ backend's.
"""

from __future__ import annotations

import functools
import itertools
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._profiler import _RecordFunctionFast

from .. import _api, _core, _lifecycle
from .._api import Average, Max, Min, Product, Sum
from ..exceptions import InvalidArgumentError
from ..process_sets import ProcessSet, global_process_set
from . import _front
from . import ops as _ops

#: The backend's name in ``init_process_group``.
BACKEND = "ferrovod"

_RedOp = dist.ReduceOp.RedOpType
_ENGINE_OPS = {
    _RedOp.SUM: Sum,
    _RedOp.AVG: Average,
    _RedOp.PRODUCT: Product,
    _RedOp.MIN: Min,
    _RedOp.MAX: Max,
}
_BITWISE = {
    _RedOp.BAND: torch.bitwise_and,
    _RedOp.BOR: torch.bitwise_or,
    _RedOp.BXOR: torch.bitwise_xor,
}

# What a held allreduce (_Held) may be: NumPy views it as is, for the engine's fast path.
_HOLDABLE_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.int8,
                              torch.int16, torch.int32, torch.int64, torch.uint8))


class _Completer:
    """Completes the futures torch asked for (``Work.get_future``: DDP's reducer always does)
    on one thread per process, in the order they were asked for. A caller that waits on its
    work itself (``wait()``) never goes through here."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def add(self, work: Any) -> None:
        if threading.current_thread() is self._thread:
            # A future's callback asked for another future (PowerSGD's hook chains collectives
            # and waits on them inside its callbacks): queued behind the callback running
            # here, it would never complete. The callback waits for it, so settle it now.
            work._settle()
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ferrovod-futures",
                                                daemon=True)
                self._thread.start()
        self._queue.put(work)

    def _run(self) -> None:
        while True:
            self._queue.get()._settle()


_completer = _Completer()


class _RecordEnd:
    """Ends a profiler record once its op's work has completed, on the completer's thread: a
    record that ends on another thread than it began on is an async one, as torch's own
    backends' collectives are in a profile."""

    def __init__(self, work: Any, record: Any) -> None:
        self._work, self._record = work, record
        self.ended = threading.Event()

    def _settle(self) -> None:
        # A work's own wait() waits for this record's end (below): wait without it.
        wait = getattr(self._work, "_outcome", None) or self._work.wait
        try:
            wait()
        except BaseException:  # noqa: BLE001, S110 - the op's waiter raises it
            pass
        # On a thread without the profiler's state (this one), __exit__ leaves the record open,
        # and it ends where it is freed: dropped here, it ends here. Left to the work, it ended
        # on whichever thread freed the work last, now and then the caller's while its profile
        # still ran, and torch then saw a record that began and ended on one thread: not async.
        record, self._record = self._record, None
        record.__exit__(None, None, None)
        del record
        self.ended.set()


def _profiled(title: str, inputs: Callable[..., Sequence[torch.Tensor]]) -> Callable:
    """Records a method's op in torch's profiler, when one runs, as ``ferrovod:<title>`` with
    the shapes of ``inputs(*args)`` (what gloo's ops show as ``gloo:<title>``)."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            _holds.release()
            if not torch.autograd._profiler_enabled():
                return method(self, *args, **kwargs)
            record = _RecordFunctionFast(f"{BACKEND}:{title}", list(inputs(*args)))
            record.__enter__()
            try:
                work = method(self, *args, **kwargs)
            except BaseException:
                record.__exit__(None, None, None)
                raise
            end = _RecordEnd(work, record)
            # The completer may end the record before this returns: no reference here may
            # outlive its own (see _RecordEnd._settle).
            del record
            if isinstance(work, _Work):
                # The record ends before wait() returns, as gloo's does: a profiler that stops
                # right after the wait finds it complete.
                work._record_end = end
            _completer.add(end)
            return work

        return run

    return wrap


def _first(tensors: Sequence[torch.Tensor], *_: Any) -> Sequence[torch.Tensor]:
    return tensors


def _second(_: Any, tensors: Any, *__: Any) -> Sequence[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else tensors


class _Work(dist.Work):
    """One op's work: ``wait()`` waits for it (GIL released) and finishes it (copies results
    where torch wants them), ``get_future()`` gives a future completed with the op's outputs,
    as torch's own backends' work does. An op is finished once, by whichever asks first.

    ``source`` is the engine handle the work waits on, or another work whose completion this
    one finishes (an op made of two steps)."""

    def __init__(self, source: Union[int, "_Work", "_Called", "_Held"],
                 finish: Callable[[Any], List[torch.Tensor]],
                 devices: Iterable[torch.device]) -> None:
        super().__init__()
        self._source = source
        self._finish = finish
        self._devices = sorted({d for d in devices if d.type != "cpu"}, key=str)
        self._lock = threading.Lock()
        self._done = False
        self._value: List[torch.Tensor] = []
        self._error: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None
        # The profiler's record of the op, when one runs (see _profiled).
        self._record_end: Optional[_RecordEnd] = None

    def _outcome(self) -> None:
        with self._lock:
            if self._done:
                return
            try:
                if isinstance(self._source, int):
                    raw = _ops.synchronize(self._source)
                else:
                    raw = self._source.wait()
                self._value = self._finish(raw)
            except BaseException as e:  # noqa: BLE001 - handed to every waiter
                self._error = e
            self._done = True

    def _settle(self) -> None:
        self._outcome()
        fut = self._future
        if fut is None or fut.done():
            return
        if self._error is not None:
            fut.set_exception(self._error)
        else:
            fut.set_result(self._value)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Waits for the op; raises what it failed with (a rank failure, a mismatch)."""
        del timeout  # the engine bounds every wait (a dead peer fails the op)
        self._outcome()
        if self._record_end is not None:
            self._record_end.ended.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the op has completed (never blocks)."""
        if self._done:
            return True
        if isinstance(self._source, int):
            return _ops.poll(self._source)
        return self._source.is_completed()

    def is_success(self) -> bool:
        """Whether the op completed without an error (waits for it)."""
        self._outcome()
        return self._error is None

    def _source_rank(self) -> int:
        """The group rank a receive from any source received from: only such a receive's
        work (:class:`_FromAnyRank`) knows."""
        raise RuntimeError("sourceRank() may only be called on the work of a receive "
                           "from any source (recv without src)")

    def exception(self) -> Optional[BaseException]:
        """The error the op failed with, or None (waits for it)."""
        self._outcome()
        return self._error

    def result(self) -> List[torch.Tensor]:
        """The op's output tensors (waits for it)."""
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future:
        """A future that completes with the op's output tensors, or its error."""
        if self._future is None:
            if isinstance(self._source, _Held):
                # Completed on the completer's thread, it goes through the engine's queue.
                self._source.submit()
            self._future = torch.futures.Future(devices=self._devices)
            if self._done:
                self._settle()
            else:
                _completer.add(self)
        return self._future


class _Held:
    """A small allreduce of the job's whole group, held back from the engine until its work is
    waited for: torch's blocking ``dist.all_reduce`` waits at once, and an op whose caller
    waits may take the engine's fast path (no queue, no coordinator: a 4-byte allreduce on
    one host costs a few microseconds instead of about fifty). torch does not say at
    submission whether the caller will wait, so every op of the kind is held, and handed to
    the engine's queue as an op that nobody waits for yet (:meth:`submit`) as soon as the
    process issues another op of a group, asks for its future, or :data:`_holds`' releaser
    finds it still held a tick later: an async op runs without a wait, and ops reach the
    engine in the order they were issued."""

    __slots__ = ("_tensor", "_kind", "_name", "_op", "_factor", "_lock", "_handle", "_done",
                 "_error")

    def __init__(self, tensor: torch.Tensor, kind: str, name: str, op: int,
                 factor: float) -> None:
        """``kind``: the op as its name and errors call it (``allreduce``, ``barrier``);
        ``name``: the group's name for it (:meth:`ProcessGroup._name`)."""
        self._tensor, self._kind, self._op, self._factor = tensor, kind, op, factor
        self._name = _api.OpName(kind, name)  # new every op: not worth caching
        self._lock = threading.Lock()
        self._handle: Optional[int] = None
        self._done = False
        # What handing the op on failed with (the engine shut down meanwhile): its waiter's.
        self._error: Optional[BaseException] = None

    def _queue(self, now: bool) -> None:
        self._handle = _ops._allreduce_async([self._tensor], True, None, self._name, self._op,
                                             self._factor, 1.0, global_process_set,
                                             self._kind, now=now, named=True)

    def submit(self) -> None:
        """Hands the op to the engine's queue, unless it is there already or its waiter is
        running it."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._handle is None and not self._done:
                self._queue(False)
        except Exception as e:  # noqa: BLE001 - raised by wait(), on the caller's thread
            self._error, self._done = e, True
        finally:
            self._lock.release()

    def wait(self) -> Any:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._handle is None and not self._done:
                _holds.forget(self)
                arr = _ops._numpy_view(self._tensor)
                if arr is not None and _core.allreduce_now(arr, arr, self._name, self._op, None,
                                                           self._factor, 1.0):
                    self._done = True
                    return None
                self._queue(True)
        return None if self._handle is None else _ops.synchronize(self._handle)

    def is_completed(self) -> bool:
        if self._done:
            return True
        return self._handle is not None and _ops.poll(self._handle)


class _Holds:
    """The one op of this process held back (:class:`_Held`), and the thread that hands it
    to the engine when its caller does not wait for it: it looks every :data:`TICK` seconds
    while ops are held and sleeps otherwise, so a blocking op never waits on it (and wakes it
    at most once a tick)."""

    TICK = 0.001

    def __init__(self) -> None:
        self._reset()
        # A forked child has none of its parent's threads, and no op of its own held.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._held: Optional[_Held] = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._sleeping = False
        self._holds = 0  # how many ops were ever held: whether any came during a tick
        self._thread: Optional[threading.Thread] = None

    def hold(self, op: _Held) -> None:
        with self._lock:
            last, self._held = self._held, op
            self._holds += 1
        if last is not None:
            # Another thread of this process held one meanwhile (one thread's ops have
            # handed theirs on before they came here).
            last.submit()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ferrovod-held-ops",
                                            daemon=True)
            self._thread.start()
        elif self._sleeping:
            self._wake.set()

    def forget(self, op: _Held) -> None:
        """``op`` is being waited for: nothing to hand on."""
        with self._lock:
            if self._held is op:
                self._held = None

    def release(self) -> None:
        """Hands the held op, if any, to the engine's queue (another op comes after it)."""
        if self._held is None:
            return
        with self._lock:
            op, self._held = self._held, None
        if op is not None:
            op.submit()

    def _run(self) -> None:
        while True:
            # Set before looking, so that a hold() after the look sees it and wakes us.
            self._sleeping = True
            if self._held is None:
                self._wake.wait()
            self._sleeping = False
            self._wake.clear()
            # Awake, tick until a tick passes in which nothing new was held and nothing is
            # held still: ops held one after another (a loop of blocking ones, each forgotten
            # by its wait) then cost no wake-up each, only this thread's tick. An op held
            # through a whole tick is handed on: within two ticks of its hold.
            holds, seen = -1, None
            while self._holds != holds or seen is not None:
                holds = self._holds
                time.sleep(self.TICK)
                with self._lock:
                    late = self._held if self._held is seen else None
                    if late is not None:
                        self._held = None
                    seen = self._held
                if late is not None:
                    late.submit()


_holds = _Holds()


class _Called:
    """An op's source whose result a call waits for and returns (an op of several engine
    ops, such as a sparse allreduce's two allgathers)."""

    def __init__(self, result: Callable[[], Any]) -> None:
        self._result = result
        self._done = False

    def wait(self) -> Any:
        value = self._result()
        self._done = True
        return value

    def is_completed(self) -> bool:
        return self._done


class _FromAnyRank(_Work):
    """The work of a receive from any rank (``recv`` without ``src``): the engine's receive
    takes the first message of its tag to arrive from any rank of the group, and
    ``_source_rank()`` says whose it took."""

    def __init__(self, group: "ProcessGroup", handle: int, tensor: torch.Tensor) -> None:
        self._group = group
        self._tensor = tensor
        self._sender = -1
        super().__init__(handle, self._took, [tensor.device])

    def _took(self, sender: int) -> List[torch.Tensor]:
        self._sender = sender
        return [self._tensor]

    def _source_rank(self) -> int:
        """The group rank whose message the receive took (waits for it)."""
        self.wait()
        return self._group._group_rank(self._sender)


class _Done(dist.Work):
    """Work that has nothing left to do (an op with nothing to send, e.g. an empty list)."""

    def __init__(self, value: List[torch.Tensor]) -> None:
        super().__init__()
        self._value = value

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        del timeout
        return True

    def is_completed(self) -> bool:
        return True

    def result(self) -> List[torch.Tensor]:
        return self._value

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._value)
        return fut


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` as one dimension: a view when it is contiguous (no copy)."""
    return t.reshape(-1)


def _copy_into(outs: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies consecutive pieces of ``flat`` into ``outs`` (each by its element count)."""
    at = 0
    with torch.no_grad():
        for o in outs:
            n = o.numel()
            o.copy_(flat[at:at + n].view(o.shape))
            at += n


#: Every group not yet shut down (see ``ProcessGroup.__init__``).
_open_groups: "set[ProcessGroup]" = set()


class ProcessGroup(_C10dBackend):
    """The backend of a torch.distributed process group whose collectives run on ferrovod's
    engine. torch makes it (``init_process_group("ferrovod")``) and puts it under the group it
    hands the user, as it does gloo's."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta, group_id: str,
                 process_set: ProcessSet, owns_engine: bool) -> None:
        super().__init__(rank, size)
        self._store = store
        self._rank = rank
        self._size = size
        self._timeout = timeout
        self._group_id = group_id
        self._set = process_set
        self._owns_engine = owns_engine
        self._seq = 0
        self._barriers = itertools.count()
        self._closed = False
        # Without the C++ half (_front), torch holds this object by its C++ base alone. Where
        # it wraps the backend in its own (TORCH_DISTRIBUTED_DEBUG=DETAIL), nothing else holds
        # the Python object, and once it is freed every call torch makes falls through to the
        # base class.
        _open_groups.add(self)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND

    def _global(self, group_rank: int) -> int:
        """The job's rank of this group's rank ``group_rank`` (the engine's roots are)."""
        ranks = self._set.ranks
        return group_rank if self._set is global_process_set or not ranks else ranks[group_rank]

    def _name(self) -> str:
        """The next op's name: torch issues a group's collectives in one order on every rank."""
        self._check_open()
        self._seq += 1
        return f"pg{self._group_id}.{self._seq - 1}"

    def _check_open(self) -> None:
        """Refuses an op of a group that was shut down."""
        if self._closed:
            raise InvalidArgumentError(f"process group {self._group_id} was shut down")

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives the group has issued: the same on every rank between two
        collectives, which torch's collective checks (``TORCH_DISTRIBUTED_DEBUG=DETAIL``)
        compare across ranks."""
        return self._seq

    def _work(self, handle: int, finish: Callable[[Any], List[torch.Tensor]],
              tensors: Sequence[torch.Tensor]) -> _Work:
        return _Work(handle, finish, (t.device for t in tensors))

    def _refuse(self, kind: int, kind_name: str, reason: str,
                tensors: Sequence[torch.Tensor]) -> _Work:
        """The group's next op, which this rank's arguments make impossible: refused through
        the engine as the op the others submit (``kind``, named as ``kind_name`` names it),
        so that every rank of the group fails it with ``reason`` instead of waiting for this
        one. Its work raises that error."""
        name = _api.OpName(kind_name, self._name())
        h = _ops._refused(kind, name, self._set, InvalidArgumentError(reason), True)
        return self._work(h, lambda _: [], tensors)

    @staticmethod
    def _engine_op(op: Any, what: str) -> tuple:
        """(engine op, pre-scale) for torch's ``ReduceOp``; bitwise ops return (None, op)."""
        kind = op.op if hasattr(op, "op") else op
        if kind in _ENGINE_OPS:
            return _ENGINE_OPS[kind], 1.0
        if kind == _RedOp.PREMUL_SUM:
            factor = op.factor if hasattr(op, "factor") else None
            if isinstance(factor, torch.Tensor):
                factor = factor.item()
            if factor is None:
                raise InvalidArgumentError(f"{what}: PREMUL_SUM without a factor")
            return Sum, float(factor)
        if kind in _BITWISE:
            return None, kind
        raise InvalidArgumentError(f"{what}: reduce op {kind} is not supported")

    # ------------------------------------------------------------------ allreduce, reduce

    @_profiled("all_reduce", _first)
    def allreduce(self, tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:
        """Reduces ``tensors`` in place across the group."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce(tensors, op, "allreduce")

    @_profiled("all_reduce", _first)
    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any = None) -> dist.Work:
        """Reduces every tensor of ``tensors`` in place, negotiated as one op."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        return self._allreduce(tensors, op, "allreduce_coalesced")

    def _allreduce(self, tensors: List[torch.Tensor], op: Any, what: str) -> dist.Work:
        if not tensors:
            return _Done([])
        engine_op, factor = self._engine_op(op, what)
        if tensors[0].is_sparse if len(tensors) == 1 else any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, engine_op, factor, what)
        name = self._name()
        if engine_op is None:
            return self._bitwise(tensors, factor, name)
        def finish(_: Any) -> List[torch.Tensor]:
            return list(tensors)

        if self._holdable(tensors):
            held = _Held(tensors[0], "allreduce", name, int(engine_op), factor)
            _holds.hold(held)
            return _Work(held, finish, ())
        h = _ops._allreduce_async(tensors, True, None, name, engine_op, factor, 1.0, self._set,
                                  "allreduce")
        return self._work(h, finish, tensors)

    def _holdable(self, tensors: List[torch.Tensor]) -> bool:
        """Whether an allreduce of ``tensors`` may be held until it is waited for
        (:class:`_Held`): one dense CPU tensor of the whole job's group that the engine's
        fast path would take, with no profiler recording (its record is async)."""
        if self._set is not global_process_set or len(tensors) != 1:
            return False
        t = tensors[0]
        return (type(t) is torch.Tensor and t.is_cpu and t.dtype in _HOLDABLE_DTYPES
                and t.is_contiguous() and t.nbytes <= _core.fast_path_bytes()
                and not torch.autograd._profiler_enabled())

    def _sparse_allreduce(self, tensors: List[torch.Tensor], engine_op: Any, factor: float,
                          what: str) -> dist.Work:
        """A sparse COO tensor, reduced in place: every rank's indices and values gathered
        (ferrovod.torch's sparse allreduce), duplicates summed by coalescing."""
        if len(tensors) != 1 or engine_op not in (Sum, Average):
            raise InvalidArgumentError(f"{what}: a sparse tensor is reduced alone, with SUM, AVG "
                                       f"or PREMUL_SUM")
        t = tensors[0]
        result = _ops.sparse_allreduce_async(t * factor if factor != 1.0 else t, self._name(),
                                             engine_op, self._set)

        def finish(reduced: torch.Tensor) -> List[torch.Tensor]:
            with torch.no_grad():
                t.copy_(reduced)
            return [t]

        return _Work(_Called(result), finish, [t.device])

    def _bitwise(self, tensors: List[torch.Tensor], kind: Any, name: str) -> dist.Work:
        """BAND/BOR/BXOR: every rank's tensors gathered, reduced here in rank order."""
        flat = torch.cat([_flat(t) for t in tensors]).reshape(1, -1)
        h = _ops._api._single(_ops._allgather_async([flat], name, self._set, "allgather"))
        fn = _BITWISE[kind]

        def finish(rows: torch.Tensor) -> List[torch.Tensor]:
            acc = rows[0].clone()
            for r in rows[1:]:
                acc = fn(acc, r)
            _copy_into(tensors, acc)
            return list(tensors)

        return self._work(h, finish, tensors)

    @_profiled("reduce", _first)
    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> dist.Work:
        """Reduces ``tensors[0]`` into the root's copy; the others keep theirs."""
        t = tensors[0]
        scratch = [t.detach().clone(memory_format=torch.contiguous_format)]
        inner = self._allreduce(scratch, opts.reduceOp, "reduce")
        root = int(opts.rootRank)

        def finish(_: Any) -> List[torch.Tensor]:
            if self._rank == root:
                with torch.no_grad():
                    t.copy_(scratch[0])
            return [t]

        return _Work(inner, finish, [t.device])

    # ------------------------------------------------------------------ broadcast

    @_profiled("broadcast", _first)
    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> dist.Work:
        """Overwrites ``tensors`` with the root's, in place."""
        if not tensors:
            return _Done([])
        root = self._global(int(opts.rootRank))
        name = self._name()
        if len(tensors) == 1:
            h = _ops._broadcast_async(tensors[0], root, name, self._set, True)
            return self._work(h, lambda _: list(tensors), tensors)
        flat = torch.cat([_flat(t) for t in tensors])
        h = _ops._broadcast_async(flat, root, name, self._set, True)

        def finish(_: Any) -> List[torch.Tensor]:
            _copy_into(tensors, flat)
            return list(tensors)

        return self._work(h, finish, tensors)

    # ------------------------------------------------------------------ allgather, gather

    def _gather_rows(self, t: torch.Tensor, name: str) -> int:
        """An allgather of ``t`` as one row: every rank must give as many elements (the engine
        checks the trailing dimension, so a rank that differs fails on every rank)."""
        return _ops._api._single(_ops._allgather_async([_flat(t).reshape(1, -1)], name,
                                                       self._set, "allgather"))

    @_profiled("all_gather", _second)
    def allgather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        """Every rank's ``inputs[0]`` into ``outputs[0]``, one tensor per rank."""
        h = self._gather_rows(inputs[0], self._name())
        outs = outputs[0]

        def finish(rows: torch.Tensor) -> List[torch.Tensor]:
            _copy_into(outs, _flat(rows))
            return list(outs)

        return self._work(h, finish, inputs)

    @_profiled("all_gather", _second)
    def allgather_coalesced(self, outputs: List[List[torch.Tensor]],
                            inputs: List[torch.Tensor], opts: Any = None) -> dist.Work:
        """Every rank's ``inputs`` into ``outputs[i]`` (rank-major), as one op."""
        flat = torch.cat([_flat(t) for t in inputs])
        h = self._gather_rows(flat, self._name())

        def finish(rows: torch.Tensor) -> List[torch.Tensor]:
            for r, outs in enumerate(outputs):
                _copy_into(outs, rows[r])
            return [t for outs in outputs for t in outs]

        return self._work(h, finish, inputs)

    @_profiled("all_gather_into_tensor", _second)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        """``all_gather_into_tensor``: every rank's ``input`` into ``output`` in rank order,
        straight into ``output`` when it is contiguous on the CPU."""
        name = self._name()
        if output.device.type == "cpu" and output.is_contiguous() and input.is_contiguous() \
                and input.device.type == "cpu" and output.dtype == input.dtype \
                and output.numel() == input.numel() * self._size:
            src = _flat(input)
            dst = _flat(output)
            desc = _ops._desc(src, dst, "allgather")
            h = _ops._submit(_ops._core.ALLGATHER, name, "allgather", self._set, [desc],
                             lambda _: output, [input, output, src, dst],
                             out_bytes=[output.numel() * output.element_size()])
            return self._work(h, lambda _: [output], [output])
        h = self._gather_rows(input, name)

        def finish(rows: torch.Tensor) -> List[torch.Tensor]:
            _copy_into([output], _flat(rows))
            return [output]

        return self._work(h, finish, [output])

    @_profiled("all_gather_into_tensor_coalesced", _second)
    def all_gather_single_coalesced(self, outputs: List[torch.Tensor],
                                    inputs: List[torch.Tensor], opts: Any = None) -> dist.Work:
        """``all_gather_into_tensor`` of several pairs, as one op."""
        flat = torch.cat([_flat(t) for t in inputs])
        h = self._gather_rows(flat, self._name())

        def finish(rows: torch.Tensor) -> List[torch.Tensor]:
            at = 0
            with torch.no_grad():
                for o, i in zip(outputs, inputs):
                    n = i.numel()
                    o.view(-1).copy_(rows[:, at:at + n].reshape(-1))
                    at += n
            return list(outputs)

        return self._work(h, finish, outputs)

    @_profiled("gather", _second)
    def gather(self, outputs: List[List[torch.Tensor]], inputs: List[torch.Tensor],
               opts: Any) -> dist.Work:
        """Every rank's ``inputs[0]`` into the root's ``outputs[0]``."""
        root = int(opts.rootRank)
        h = self._gather_rows(inputs[0], self._name())

        def finish(rows: torch.Tensor) -> List[torch.Tensor]:
            if self._rank != root:
                return []
            _copy_into(outputs[0], _flat(rows))
            return list(outputs[0])

        return self._work(h, finish, inputs)

    # ------------------------------------------------------------------ reduce-scatter

    @_profiled("reduce_scatter", lambda _, inputs, *__: [t for ts in inputs for t in ts])
    def reduce_scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                       opts: Any) -> dist.Work:
        """The reduction of every rank's ``inputs[0][r]``, into rank r's ``outputs[0]``."""
        flat = torch.cat([_flat(t) for t in inputs[0]])
        return self._reduce_scatter(outputs[0], flat, opts.reduceOp)

    @_profiled("reduce_scatter_tensor", _second)
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any) -> dist.Work:
        """``reduce_scatter_tensor``: rank r's share of the reduced ``input`` into ``output``."""
        return self._reduce_scatter(output, _flat(input), opts.reduceOp)

    @_profiled("reduce_scatter_tensor_coalesced", _second)
    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor],
                                        inputs: List[torch.Tensor], opts: Any) -> dist.Work:
        """``reduce_scatter_tensor`` of several pairs, one op each; the last one's work."""
        works = [self._reduce_scatter(o, _flat(i), opts.reduceOp) for o, i in zip(outputs, inputs)]
        if not works:
            return _Done([])

        def finish(_: Any) -> List[torch.Tensor]:
            for w in works:
                w.wait()
            return list(outputs)

        return _Work(works[-1], finish, [o.device for o in outputs])

    def _reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor, op: Any) -> dist.Work:
        engine_op, factor = self._engine_op(op, "reduce_scatter")
        n = self._size
        if flat.numel() != output.numel() * n:
            # Refused as the op the other ranks submit for this reduction.
            kind, kind_name = ((_core.REDUCESCATTER, "reducescatter")
                               if engine_op in (Sum, Average) else
                               (_core.ALLREDUCE, "allreduce") if engine_op is not None else
                               (_core.ALLGATHER, "allgather"))
            return self._refuse(
                kind, kind_name,
                f"reduce_scatter: rank {self._rank} gives {flat.numel()} elements for "
                f"{output.numel()} out on each of {n} ranks", [output])
        if engine_op not in (Sum, Average):
            # The engine reduce-scatters Sum and Average; other ops reduce whole and keep
            # this rank's share.
            whole = [flat.clone()]
            inner = self._allreduce(whole, op, "reduce_scatter")
            k = output.numel()

            def keep(_: Any) -> List[torch.Tensor]:
                _copy_into([output], whole[0][self._rank * k:(self._rank + 1) * k])
                return [output]

            return _Work(inner, keep, [output.device])
        name = self._name()
        h = _ops._api._single(_ops._reducescatter_async([flat], name, engine_op, self._set, factor,
                                                        1.0, "reducescatter"))

        def finish(share: torch.Tensor) -> List[torch.Tensor]:
            _copy_into([output], _flat(share))
            return [output]

        return self._work(h, finish, [output])

    # ------------------------------------------------------------------ alltoall, scatter

    def _alltoall(self, flat: torch.Tensor, splits: List[int], outs: List[torch.Tensor],
                  name: str) -> dist.Work:
        h = _ops._alltoall_async(flat, splits, name, self._set, True)

        def finish(result: Any) -> List[torch.Tensor]:
            received, _ = result
            _copy_into(outs, _flat(received))
            return list(outs)

        return self._work(h, finish, outs)

    @_profiled("all_to_all", _second)
    def alltoall(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """``inputs[r]`` to rank r; rank r's tensor for this rank into ``outputs[r]``."""
        flat = torch.cat([_flat(t) for t in inputs])
        return self._alltoall(flat, [t.numel() for t in inputs], list(outputs), self._name())

    @_profiled("all_to_all", _second)
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: List[int], input_split_sizes: List[int],
                          opts: Any = None) -> dist.Work:
        """Rows of ``input`` to each rank (``input_split_sizes``, else an even split), the rows
        each rank sends here into ``output`` in rank order."""
        n = self._size
        rows = input.shape[0] if input.dim() else 1
        row = input.numel() // rows if rows else 0
        sends = list(input_split_sizes) or [rows // n] * n
        if sum(sends) != rows or len(sends) != n:
            return self._refuse(
                _core.ALLTOALL, "alltoall",
                f"all_to_all_single: rank {self._rank}'s input splits {sends} do not cover its "
                f"{rows} rows over {n} ranks", [output])
        return self._alltoall(_flat(input), [s * row for s in sends], [output], self._name())

    @_profiled("scatter", lambda _, inputs, *__: [t for ts in inputs for t in ts])
    def scatter(self, outputs: List[torch.Tensor], inputs: List[List[torch.Tensor]],
                opts: Any) -> dist.Work:
        """The root's ``inputs[0][r]`` into rank r's ``outputs[0]``."""
        root = int(opts.rootRank)
        out = outputs[0]
        if self._rank == root:
            flat = torch.cat([_flat(t) for t in inputs[0]])
            splits = [t.numel() for t in inputs[0]]
        else:
            flat = out.new_empty((0,))
            splits = [0] * self._size
        return self._alltoall(flat, splits, [out], self._name())

    # ------------------------------------------------------------------ barriers

    @_profiled("barrier", lambda *_: [])
    def barrier(self, opts: Any = None) -> dist.Work:
        """Completes once every rank of the group has reached it."""
        mark = [torch.zeros(1)]
        if self._holdable(mark):
            held = _Held(mark[0], "barrier", self._name(), int(Sum), 1.0)
            _holds.hold(held)
            return _Work(held, lambda _: [], ())
        h = _ops._allreduce_async(mark, True, None, self._name(), Sum, 1.0, 1.0, self._set,
                                  "barrier")
        return self._work(h, lambda _: [], mark)

    def monitored_barrier(self, opts: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier, through the group's store: rank 0 waits up to the timeout
        for every other rank and raises naming the first (or, with ``wait_all_ranks``, every)
        rank that did not arrive; the others wait for rank 0's word and raise what it said."""
        limit = getattr(opts, "timeout", None)
        if limit is None:
            limit = self._timeout
        if not isinstance(limit, timedelta):
            limit = timedelta(milliseconds=float(limit.total_seconds() * 1000)
                              if hasattr(limit, "total_seconds") else float(limit))
        _holds.release()
        n = next(self._barriers)
        key = f"ferrovod/monitored_barrier/{n}"
        if self._rank != 0:
            self._store.set(f"{key}/{self._rank}", b"1")
            # gloo's words, which users and tools look for.
            reached = (f"Rank {self._rank} successfully reached monitoredBarrier, but received "
                       f"errors while waiting for send/recv from rank 0")
            try:
                self._store.wait([f"{key}/verdict"], limit)
            except Exception as e:  # noqa: BLE001 - the store's timeout, reworded
                raise RuntimeError(f"{reached}: no verdict within {limit} ({e})") from None
            verdict = self._store.get(f"{key}/verdict").decode()
            if verdict:
                raise RuntimeError(f"{reached}: {verdict}")
            return
        missing: List[int] = []
        deadline = time.monotonic() + limit.total_seconds()
        ms = int(limit.total_seconds() * 1000)
        for r in range(1, self._size):
            left = deadline - time.monotonic()
            if left <= 0 and not wait_all_ranks:
                # As gloo: the time ran out before this rank was looked at.
                verdict = (f"Rank 0 timed out in monitoredBarrier after {ms} ms (group "
                           f"{self._group_id}); ranks that passed: {list(range(1, r))}")
                self._store.set(f"{key}/verdict", verdict.encode())
                raise RuntimeError(verdict)
            left = max(left, 0.001)
            try:
                self._store.wait([f"{key}/{r}"], timedelta(seconds=left))
            except Exception:  # noqa: BLE001 - a timeout: this rank did not arrive
                missing.append(r)
                if not wait_all_ranks:
                    break
        verdict = ""
        if missing:
            which = "Ranks " + ", ".join(map(str, missing)) if len(missing) > 1 \
                else f"Rank {missing[0]}"
            verdict = (f"{which} failed to pass monitoredBarrier in {ms} ms (group "
                       f"{self._group_id}, seen by its rank 0)")
        self._store.set(f"{key}/verdict", verdict.encode())
        if verdict:
            raise RuntimeError(verdict)

    # ------------------------------------------------------------------ point to point

    def _p2p(self, tensors: List[torch.Tensor], peer: int, tag: int, sending: bool) -> dist.Work:
        """A message between this rank and group rank ``peer``: one of the engine's
        point-to-point messages, named by the group and the tag. Messages between two ranks
        arrive in the order sent, and the n-th receive of a name takes the n-th message, so
        messages of one tag keep their order and another tag's may overtake them, as torch
        allows."""
        self._check_open()
        me, other = self._global(self._rank), self._global(int(peer))
        if me == other:
            raise InvalidArgumentError(f"rank {self._rank} cannot send to or receive from itself")
        t = tensors[0]
        handle = _ops._transfer_async(t, other, self._channel(tag), sending,
                                      self._timeout.total_seconds())
        return _Work(handle, lambda _: [t], [t.device])

    def _channel(self, tag: int) -> str:
        """The name of this group's messages of ``tag``."""
        return f"pg{self._group_id}.p2p.t{int(tag)}"

    def _group_rank(self, global_rank: int) -> int:
        """This group's rank of the job's rank ``global_rank`` (the inverse of ``_global``)."""
        ranks = self._set.ranks
        if self._set is global_process_set or not ranks:
            return global_rank
        return list(ranks).index(global_rank)

    @_profiled("send", _first)
    def send(self, tensors: List[torch.Tensor], dst: int, tag: int) -> dist.Work:
        """Sends ``tensors[0]`` to group rank ``dst``; its ``recv`` must give the same shape
        and dtype (a difference fails both sides, naming them)."""
        return self._p2p(tensors, dst, tag, True)

    @_profiled("recv", _first)
    def recv(self, tensors: List[torch.Tensor], src: int, tag: int) -> dist.Work:
        """Receives into ``tensors[0]`` what group rank ``src`` sends."""
        return self._p2p(tensors, src, tag, False)

    @_profiled("recvAnySource", _first)
    def recv_anysource(self, tensors: List[torch.Tensor], tag: int) -> dist.Work:
        """Receives into ``tensors[0]`` the first message of ``tag`` to arrive from any group
        rank (``recv`` without ``src``); the work's ``_source_rank()`` says whose."""
        self._check_open()
        if _front.backend_class() is None:
            raise InvalidArgumentError(
                "recv() without src needs the backend's C++ half, which could not be built "
                "here (see the warning above), to say who sent: name the sender (src=...)")
        t = tensors[0]
        handle = _ops._transfer_async(t, None, self._channel(tag), False,
                                      self._timeout.total_seconds())
        return _FromAnyRank(self, handle, t)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Ends the group; the default group stops the engine it started
        (``destroy_process_group``), after which ``init_process_group`` may start another."""
        if self._closed:
            return
        _holds.release()
        self._closed = True
        _open_groups.discard(self)
        if self._owns_engine:
            _lifecycle.shutdown()

    def abort(self) -> None:
        """As :meth:`shutdown`: pending ops fail."""
        self.shutdown()

    def __repr__(self) -> str:
        return f"ferrovod.ProcessGroup(rank={self._rank}, size={self._size}, group={self._group_id})"


# What the backend does not offer, said on the class: torch's Python trampoline reads these
# properties through Python, and the base class's own would call back into it for ever.
for _capability in ("supports_coalescing", "supports_splitting", "supports_shrinking",
                    "supports_reconfigure", "supports_window", "_supports_time_estimate"):
    setattr(ProcessGroup, _capability, property(lambda self: False))


def _store_address(store: Any) -> Optional[str]:
    """``host:port`` of the TCPStore under ``store`` (through any PrefixStores), else None."""
    seen = 0
    while isinstance(store, dist.PrefixStore) and seen < 16:
        store = store.underlying_store
        seen += 1
    if isinstance(store, dist.TCPStore):
        return f"{store.host}:{store.port}"
    return None


# What torch gives a group whose creator set no timeout.
_TORCH_DEFAULT_TIMEOUT: timedelta = dist.constants.default_pg_timeout
# The default group's timeout when this job's engine was started by it (ops of the job's own
# set are bounded by it); None when ferrovod.init() started the engine.
_job_timeout: Optional[timedelta] = None
#: Which forming of the job over its store this process is in (``_formings``).
_forming = 0


def _formings(store: Any, size: int) -> int:
    """Which forming of a job over ``store`` this is, the same on every rank: each rank counts
    itself in once per forming, and a forming ends only once every rank has counted."""
    return (int(store.add("ferrovod/formings", 1)) - 1) // size


def _create(opts: Any, backend_options: Any = None) -> Any:  # noqa: D417
    """torch's creator: the default group starts (or joins) the engine over the store torch
    hands in; other groups are not here yet. torch gets the backend's C++ half over it where
    that can be built (:mod:`ferrovod.torch._front`)."""
    global _job_timeout, _forming
    del backend_options
    store, rank, size = opts.store, int(opts.group_rank), int(opts.group_size)
    timeout = opts.timeout if isinstance(opts.timeout, timedelta) else \
        timedelta(milliseconds=float(opts.timeout))
    members = [int(r) for r in opts.global_ranks_in_group]
    if members:
        return _subgroup(store, rank, size, timeout, str(opts.group_id), members)
    # torch's default timeout (30 min) leaves the job's ops to the engine's stall limits and
    # small ones on the fast path; a timeout the user chose bounds every op, as gloo's does.
    op_limit = None if timeout == _TORCH_DEFAULT_TIMEOUT else timeout.total_seconds()
    _forming = _formings(store, size)
    started = _lifecycle.init_over_store(store, rank, size, timeout.total_seconds(),
                                         _store_address(store), _forming, op_limit)
    _job_timeout = timeout if started else None
    return _front.wrap(ProcessGroup(store, rank, size, timeout, str(opts.group_id),
                                    global_process_set, owns_engine=started), rank, size)


def _subgroup(store: Any, rank: int, size: int, timeout: timedelta, group_id: str,
              members: List[int]) -> Any:
    """A group over some ranks of the job (``new_group``, ``new_subgroups``, a device mesh's
    dimensions): an engine process set registered by its members alone, since torch asks only
    them; a group over every rank is the job's own set."""
    if not _api.is_initialized():
        raise InvalidArgumentError(
            f"new_group(backend='ferrovod') needs the job's default group on ferrovod too: "
            f"init_process_group('ferrovod') (group {group_id} of ranks {members})")
    if members != sorted(members) or len(members) != size:
        raise InvalidArgumentError(f"group {group_id}: ranks {members} must be sorted and "
                                   f"{size} in number")
    if members == list(range(_api.size())) and timeout in (_job_timeout, _TORCH_DEFAULT_TIMEOUT):
        ps = global_process_set
    else:
        # The group's ops fail once stalled for its timeout (a set with a limit of its own).
        ps = ProcessSet(members)
        ps.process_set_id = int(_core.add_process_set(members, True, timeout.total_seconds()))
    return _front.wrap(ProcessGroup(store, rank, size, timeout, group_id, ps, owns_engine=False),
                       rank, size)


def register() -> None:
    """Registers the backend with torch.distributed (idempotent; importing
    :mod:`ferrovod.torch` does it)."""
    if not dist.is_available():
        return
    if BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])

