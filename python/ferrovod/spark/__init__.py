"""``ferrovod.spark``: Horovod's ``horovod.spark.run`` — a ferrovod job whose ranks are the tasks
of one Spark barrier stage.

::

    from pyspark.sql import SparkSession
    import ferrovod.spark

    spark = SparkSession.builder.getOrCreate()
    results = ferrovod.spark.run(train, args=(epochs,), num_proc=4)  # rank 0's result first

``run`` starts ``num_proc`` Spark tasks in barrier mode (all at once, or none). Each task works
out its rank from the stage's task addresses (a host's tasks get consecutive ranks, as
``ferrovodrun`` places a host's slots) and runs ``fn`` in a fresh Python process on its
executor, with the environment ``ferrovodrun`` gives a worker; ``fn`` calls
``ferrovod.init()`` as a script would. The job's rendezvous store runs in the driver, and the
results travel back through it. Horovod's Spark estimators (``KerasEstimator``,
``TorchEstimator``, Petastorm) are not provided.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import IO, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..runner.hosts import HostInfo, SlotInfo, get_host_assignments
from ..runner.outcome import first_failure
from ..runner.run_func import FUNC_KEY, result_key
from ..runner.worker_env import SECRET_VAR, slot_env, thread_share

__all__ = ["run", "run_elastic"]

WHO = "ferrovod.spark.run"
STARTED_KEY = "spark/started"

# (rank, exit code, captured stdout, captured stderr); rank -1 for a stage Spark re-ran.
TaskStatus = Tuple[int, int, bytes, bytes]


def run(fn: Any, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
        num_proc: Optional[int] = None, start_timeout: Optional[int] = None,
        use_mpi: Optional[bool] = None, use_gloo: Optional[bool] = None,
        extra_mpi_args: Optional[str] = None, env: Optional[Dict[str, str]] = None,
        stdout: Optional[IO[str]] = None, stderr: Optional[IO[str]] = None, verbose: int = 1,
        nics: Optional[Iterable[str]] = None, prefix_output_with_timestamp: bool = False,
        executable: Optional[str] = None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one per Spark task, and returns
    their results, rank 0's first.

    Args:
        fn, args, kwargs: what every rank calls (pickled with cloudpickle).
        num_proc: number of ranks; default ``spark.default.parallelism``.
        start_timeout: seconds for Spark to start every task at once (default
            ``FERROVOD_SPARK_START_TIMEOUT``, ``HOROVOD_SPARK_START_TIMEOUT``, else 600); then
            the stage is cancelled and this raises ``TimeoutError``. Ranks get the same time
            to form the job.
        env: variables added to each rank's environment (on its executor).
        stdout, stderr: when given, each rank's output is captured and written there once the
            job ends, every line prefixed ``[rank]<stdout>:`` (or ``<stderr>``); by default it
            goes to the executors' own output as it comes (the console in local mode).
        verbose: 0 quiet; 1 or more says on stderr what starts.
        nics: the network interfaces the ranks may use; the first is used (``FERROVOD_IFACE``).
        prefix_output_with_timestamp: prefix each captured line with the time it is written out.
        executable: the Python each rank runs (default: the executors' own).
        use_mpi, use_gloo, extra_mpi_args: accepted for Horovod's signature; change nothing.

    A rank that raises makes this raise ``RuntimeError`` naming the first such rank, with its
    traceback; a rank whose process dies, ``RuntimeError`` naming it and its exit code.
    """
    import cloudpickle
    import pyspark

    from .._core import RendezvousServer, StoreClient  # type: ignore[import-not-found,unused-ignore]

    sc = pyspark.SparkContext._active_spark_context
    if sc is None:
        raise RuntimeError(f"{WHO}: no active SparkContext; create a SparkSession first")
    if num_proc is None:
        num_proc = sc.defaultParallelism
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"{WHO}: num_proc must be a positive integer, got {num_proc!r}")
    timeout = _start_timeout(start_timeout)
    secret = secrets.token_bytes(32)
    server = RendezvousServer(secret, _driver_address(sc))
    try:
        server.set(FUNC_KEY, cloudpickle.dumps((fn, tuple(args), dict(kwargs or {}))))
        job = {
            "addr": str(server.addr), "secret": secret.hex(), "timeout": timeout,
            "env": dict(env or {}), "iface": sorted(nics)[0] if nics else None,
            "executable": executable, "capture": stdout is not None or stderr is not None,
        }
        if verbose:
            sys.stderr.write(f"{WHO}: {num_proc} rank(s) as Spark barrier tasks, rendezvous "
                             f"at {job['addr']}\n")
        client = StoreClient(str(server.addr), secret, 30.0)
        statuses = _run_stage(sc, job, num_proc, timeout, client)
        _deliver(statuses, stdout, stderr, prefix_output_with_timestamp)
        outcomes = {}
        for rank in range(num_proc):
            raw = client.get(result_key(rank), 0.0)
            if raw is not None:
                outcomes[rank] = cloudpickle.loads(raw)
    finally:
        server.close()
    raised = first_failure(WHO, outcomes)
    if any(rank < 0 for rank, _, _, _ in statuses):
        raise RuntimeError(f"{WHO}: Spark lost a task and ran the stage again; a job of fixed "
                           "size does not restart (ferrovod.spark.run_elastic does)") from raised
    # A rank whose process died is the cause of the others' errors (their peer went away).
    died = sorted((rank, code) for rank, code, _, _ in statuses if rank not in outcomes)
    if died:
        rank, code = died[0]
        then = sorted(r for r, o in outcomes.items() if o[0] == "error")
        raise RuntimeError(
            f"{WHO}: the process of rank {rank} ended with exit code {code} before returning "
            f"a result (ranks without one: {[r for r, _ in died]}"
            + (f"; rank(s) {then} then raised, most likely because of it" if then else "")
            + ")") from raised
    if raised is not None:
        raise raised
    return [outcomes[r][1] for r in range(num_proc)]


def _start_timeout(given: Optional[int]) -> int:
    """``given``, else ``FERROVOD_SPARK_START_TIMEOUT`` / ``HOROVOD_SPARK_START_TIMEOUT``, else
    the default of the engine's table."""
    if given is not None:
        return int(given)
    from .._defaults import default, positive_seconds

    names = ("FERROVOD_SPARK_START_TIMEOUT", "HOROVOD_SPARK_START_TIMEOUT")
    fallback = float(default(names[0]))
    return int(positive_seconds(os.environ, names, fallback, whole=True))


def _driver_address(sc: Any) -> str:
    """Where executors reach the driver: Spark's own ``spark.driver.host``, as an address."""
    host = sc.getConf().get("spark.driver.host") or socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _run_stage(sc: Any, job: Dict[str, Any], num_proc: int, timeout: int,
               store: Any) -> List[TaskStatus]:
    """Runs the barrier stage in a thread; cancels it when its tasks have not all started
    within ``timeout`` seconds."""
    group = f"ferrovod.spark.run.{uuid.uuid4().hex[:12]}"
    done: Dict[str, Any] = {}

    def stage() -> None:
        try:
            sc.setJobGroup(group, f"{WHO} ({num_proc} ranks)", interruptOnCancel=True)
            rdd = sc.parallelize(range(num_proc), num_proc).barrier()
            done["statuses"] = rdd.mapPartitions(lambda it: _task(job, it)).collect()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            done["error"] = exc

    thread = threading.Thread(target=stage, name=group, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive() and store.add(STARTED_KEY, 0) < num_proc:
        if time.monotonic() > deadline:
            started = store.add(STARTED_KEY, 0)
            sc.cancelJobGroup(group)
            thread.join(30)
            raise TimeoutError(
                f"{WHO}: Spark started {started} of {num_proc} task(s) within {timeout} s "
                f"(start_timeout); a barrier stage needs a free slot for every rank at once, "
                f"and this Spark has {sc.defaultParallelism} (spark.default.parallelism). The "
                f"stage was cancelled. Use fewer ranks or wait longer for executors.")
        time.sleep(0.1)
    thread.join()
    if "error" in done:
        raise RuntimeError(f"{WHO}: the Spark stage failed: {_essence(done['error'])}") \
            from done["error"]
    return list(done["statuses"])


def _essence(exc: BaseException) -> str:
    """A Spark failure without the JVM's stack: the Python traceback of the task that failed
    when there is one, else the first line."""
    text = str(exc)
    start = text.find("Traceback (most recent call last)")
    if start >= 0:
        end = text.find("\n\tat ", start)
        return text[start:end if end >= 0 else None].strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("An error occurred while calling"):
        return lines[1]  # py4j's wrapper: the JVM's exception is on the next line
    return lines[0] if lines else type(exc).__name__


def _slots(hosts: Sequence[str]) -> List[SlotInfo]:
    """Each task's slot, by partition: a host's tasks get consecutive ranks (hosts in the
    order their first task appears, tasks within a host by partition)."""
    order: Dict[str, List[int]] = {}
    for partition, host in enumerate(hosts):
        order.setdefault(host, []).append(partition)
    assigned = get_host_assignments([HostInfo(h, len(p)) for h, p in order.items()], len(hosts))
    by_partition: Dict[int, SlotInfo] = {}
    ranks = iter(assigned)
    for partitions in order.values():
        for partition in partitions:
            by_partition[partition] = next(ranks)
    return [by_partition[p] for p in range(len(hosts))]


def _task(job: Dict[str, Any], _: Iterator[int]) -> Iterator[TaskStatus]:
    """One rank, inside its Spark task: runs ``ferrovod.runner.run_task`` with this rank's
    environment and waits for it."""
    from pyspark import BarrierTaskContext

    from .._core import StoreClient  # type: ignore[import-not-found,unused-ignore]

    ctx = BarrierTaskContext.get()
    hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
    slot = _slots(hosts)[ctx.partitionId()]
    started = StoreClient(job["addr"], bytes.fromhex(job["secret"]), 30.0).add(STARTED_KEY, 1)
    if started > slot.size:
        # Spark runs the stage again (a task was lost): the store holds the first attempt's
        # state, and run() reports that the job cannot go on.
        yield (-1, 0, b"", b"")
        return
    env = _rank_env(job, slot_env(slot))
    pipe = subprocess.PIPE if job["capture"] else None
    proc = subprocess.Popen([job["executable"] or sys.executable, "-m",
                             "ferrovod.runner.run_task"], env=env, stdout=pipe, stderr=pipe,
                            preexec_fn=_die_with_parent)
    out, err = proc.communicate()
    yield (slot.rank, proc.returncode, out or b"", err or b"")


def _rank_env(job: Dict[str, Any], slot: Dict[str, str]) -> Dict[str, str]:
    """A rank's environment on its executor: the executor's own, the job's ``env``, the
    slot's variables (``slot``), its share of the threads, and the job's store."""
    env = dict(os.environ)
    env.update(job["env"])
    env.update(slot)
    env.update(thread_share(env, int(slot["FERROVOD_LOCAL_SIZE"])))
    env.update({
        "FERROVOD_RENDEZVOUS_ADDR": job["addr"], SECRET_VAR: job["secret"],
        "FERROVOD_LAUNCHER": "spark", "FERROVOD_START_TIMEOUT": str(job["timeout"]),
        "PYTHONUNBUFFERED": "1",
    })
    if job["iface"]:
        env["FERROVOD_IFACE"] = job["iface"]
    return env


def _die_with_parent() -> None:
    """In the rank's process: SIGKILL when its task's Python worker goes (a cancelled stage,
    a lost executor), so that no rank outlives its task."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _deliver(statuses: Sequence[TaskStatus], stdout: Optional[IO[str]],
             stderr: Optional[IO[str]], timestamps: bool) -> None:
    for rank, _, out, err in sorted(statuses):
        for stream, name, data in ((stdout, "stdout", out), (stderr, "stderr", err)):
            if stream is None or not data:
                continue
            stamp = time.strftime("%a %b %d %H:%M:%S %Y ") if timestamps else ""
            for line in data.decode(errors="replace").splitlines():
                stream.write(f"{stamp}[{rank}]<{name}>:{line}\n")
            stream.flush()


from .elastic import run_elastic  # noqa: E402 - it uses this module's helpers
