"""torch.distributed's ``backend="ferrovod"`` (ferrovod/torch/process_group.py), in jobs that
torchrun starts as users do (``--standalone``: torchrun binds its own free port), or plain
processes joining through ``file://``: every
collective torch's process group offers, against NumPy references and against a gloo group
over the same ranks in the same processes, over several dtypes, shapes, odd sizes and reduce
ops, and on groups over some of the ranks (new_group, new_subgroups_by_enumeration), and point to point (send/recv, isend/irecv,
batch_isend_irecv, tags); DDP (buckets, unused parameters, no_sync, static graph) and its communication hooks
(fp16, bf16, PowerSGD) equal to DDP on gloo; FSDP2 and DDP under Join with uneven inputs
equal to one process on the same batches; destroy_process_group and a new
init_process_group in the same processes (pg_worker.py); ranks that disagree on a
collective's shape, dtype, op or root, and a rank killed mid-op: an error naming the ranks on
every other rank, never a hang (pg_fail_worker.py)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from capabilities import cxx_half_missing
from conftest import _env, _run, describe

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

HERE = Path(__file__).resolve().parent


def torchrun(n, *args, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={n}", str(HERE / "pg_worker.py"), *[str(a) for a in args]]
    return _run(cmd, _env({"OMP_NUM_THREADS": "1"}, plain=True), timeout)


def ferrovodrun(n, *args, timeout=300):
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(n), sys.executable,
           str(HERE / "pg_worker.py"), *[str(a) for a in args]]
    return _run(cmd, _env(None, plain=True), timeout)


def checks(res, n):
    """``{rank: checks}`` from every rank's ``rank <r> OK <checks>`` line."""
    found = {int(m.group(1)): int(m.group(2))
             # torchrun passes its ranks' output through one pipe, and a print's text and its
             # line end are two writes: another rank's line may come between them.
             for m in re.finditer(r"rank (\d+) OK (\d+)(?!\d)", res.stdout)}
    assert res.returncode == 0 and sorted(found) == list(range(n)), describe(res)
    return found


# pg_worker.py's sections, in the order one job runs them (lifecycle last: it restarts groups).
SECTIONS = ["collectives", "subgroups", "p2p", "objects", "ddp", "hooks", "fsdp", "join",
            "lifecycle"]


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_ddp_hooks_fsdp2_and_join_match_their_references_and_a_group_starts_again(n):
    """Every section of pg_worker.py in one job: each rank pays for starting torch once (about
    3 s of CPU on the 2-core VM) for all of them, and a section that fails names itself."""
    res = torchrun(n, *SECTIONS)
    found = checks(res, n)
    for r in range(n):
        done = re.findall(rf"rank {r} section (\w+):", res.stdout)
        assert done == SECTIONS, f"rank {r} ran sections {done}\n{describe(res)}"
    assert min(found.values()) > 3000, found


def test_a_job_of_one_process_forms_without_meeting_anyone():
    """torchrun --nproc-per-node 1 (a first try, a debug run): torch's store is handed in but
    a job of one rank needs none; it once dialled that store's address as ferrovod's own
    store and waited there for the group's timeout."""
    found = checks(torchrun(1, "collectives", "objects"), 1)
    assert found[0] > 1000, found


def test_ferrovodrun_runs_a_script_that_gives_init_process_group_no_arguments():
    """Under ferrovodrun, ``init_process_group("ferrovod")`` with no arguments (env://) joins
    the store the launcher holds, with ferrovodrun's ranks; a gloo group beside it too."""
    res = ferrovodrun(3, "subgroups", "p2p")
    found = {int(m.group(1)): int(m.group(2))
             for m in re.finditer(r"^\[\d+\]<stdout>:rank (\d+) OK (\d+)$", res.stdout, re.M)}
    assert res.returncode == 0 and sorted(found) == [0, 1, 2], describe(res)
    assert min(found.values()) > 40, found


def plain_ranks(n, mode, tmp_path, timeout=120, worker="pg_fail_worker.py", extra=(), env=None):
    """``n`` plain processes of ``worker`` joining over a file store; their outputs."""
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(HERE / worker), *([mode] if mode else []),
                               str(r), str(n), str(store), *extra], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(env, plain=True))
             for r in range(n)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    return procs, outs


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_that_disagree_fail_on_every_rank_and_the_job_goes_on(n, tmp_path):
    procs, outs = plain_ranks(n, "mismatch", tmp_path)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and re.search(rf"^rank {r} OK (\d+)$", out, re.M), \
            f"rank {r} (exit {p.returncode}):\n{out[-4000:]}"


def test_ranks_go_on_among_themselves_after_rank_0_has_left(tmp_path):
    procs, outs = plain_ranks(3, "early", tmp_path)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and re.search(rf"^rank {r} OK (\d+)$", out, re.M), \
            f"rank {r} (exit {p.returncode}):\n{out[-4000:]}"


def test_after_rank_0_has_left_the_others_make_a_group_of_an_engine_ferrovod_init_started():
    """As above, with torch.distributed joining the engine ``ferrovod.init()`` started under
    ferrovodrun: rank 0's node must serve the group the others make after it shut down, as
    it does in a job torch.distributed started."""
    cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", "3", sys.executable,
           str(HERE / "pg_fail_worker.py"), "early-attached"]
    res = _run(cmd, _env(None, plain=True), 120)
    found = sorted(int(m.group(1)) for m in re.finditer(r"rank (\d+) OK \d+", res.stdout))
    assert res.returncode == 0 and found == [0, 1, 2], describe(res)


def test_a_group_timeout_fails_a_stalled_op_once_it_has_passed(tmp_path):
    procs, outs = plain_ranks(3, "timeout", tmp_path)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and re.search(rf"^rank {r} OK (\d+)$", out, re.M), \
            f"rank {r} (exit {p.returncode}):\n{out[-4000:]}"


@pytest.mark.parametrize("front", [
    pytest.param(True, id="c++ half", marks=pytest.mark.skipif(
        cxx_half_missing() is not None, reason=str(cxx_half_missing()))),
    pytest.param(False, id="python half alone")])
def test_torchs_own_collective_checks_wrap_the_backend(front, tmp_path):
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL``, which users set to find a desynchronised job; and
    the backend where its C++ half cannot be built (a fresh extension cache and no compiler),
    which must say so once on each rank."""
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "EXPECT_FRONT": int(front)}
    if not front:
        env.update(CXX="false", TORCH_EXTENSIONS_DIR=tmp_path / "extensions")
    procs, outs = plain_ranks(3, "detail", tmp_path, env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and re.search(rf"^rank {r} OK (\d+)$", out, re.M), \
            f"rank {r} (exit {p.returncode}):\n{out[-4000:]}"
        assert out.count("could not be built") == (0 if front else 1), out[-4000:]


def test_a_killed_rank_fails_the_others_naming_it(tmp_path):
    n = 3
    procs, outs = plain_ranks(n, "kill", tmp_path)
    assert procs[n - 1].returncode == -9, outs[n - 1][-2000:]
    for r in range(n - 1):
        assert procs[r].returncode == 0 and f"rank {r} OK" in outs[r], \
            f"rank {r} (exit {procs[r].returncode}):\n{outs[r][-4000:]}"


def test_strangers_at_the_jobs_coordinator_are_dropped_and_the_job_goes_on(tmp_path):
    """No FERROVOD_SECRET: rank 0 draws the job's secret and hands it to the others through
    torch's store. Connections to the job's coordinator that do not prove it (garbage, a
    message with no handshake, a wrong secret, silence) get at most the greeting and the
    rejection byte, and are dropped, while the job's checked allreduces go on
    (test_auth.py does this, and more, to a job that ferrovodrun started)."""
    import test_auth as A

    store = tmp_path / "store"
    env = _env({"FERROVOD_LOG_LEVEL": "debug", "FERROVOD_TIMEOUT_SECONDS": str(A.TIMEOUT_S)},
               plain=True)
    env.pop("FERROVOD_SECRET", None)
    outs = [tmp_path / f"out{r}" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(HERE / "pg_fail_worker.py"), "auth", str(r),
                               "2", str(store)], stdout=open(outs[r], "w"),
                              stderr=subprocess.STDOUT, env=env) for r in range(2)]
    try:
        found = A.wait_for(lambda: re.search(r"control node \(rank 0\) at (\S+:\d+)",
                                             outs[0].read_text()), 120,
                           "the coordinator's address", procs[0])
        coordinator = found.group(1)
        jobs = [(kind, lambda k=kind: A.attack(coordinator, k, "coordinator", None, b"",
                                               wait_close=30))
                for kind in ("garbage", "request", "wrong-secret")]
        silent = A.connect(coordinator)
        threads, results = A.run_attacks(jobs)
        for t in threads:
            t.join(90)
        for kind, r in results.items():
            if isinstance(r, BaseException):
                raise r
            A.check_dropped(r, f"coordinator/{kind}", kind)
        A.check_dropped(A.drain(silent, A.TIMEOUT_S + 10) + ("",), "coordinator/silence",
                        "silence")
    finally:
        (tmp_path / "store.stop").write_text("")
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
    for r, (p, out) in enumerate(zip(procs, outs)):
        text = out.read_text()
        assert p.returncode == 0 and re.search(rf"rank {r} OK [1-9]", text), \
            f"rank {r}:\n{text[-4000:]}"
    assert "no FERROVOD_SECRET" in outs[0].read_text(), "rank 0 did not say where the secret is"


def test_a_job_meets_by_the_backends_name_over_a_file_tcp_or_a_store_the_user_made(tmp_path):
    """Each rank names the backend without importing ferrovod: torch finds it through the
    package's entry point (Ray Train's TorchConfig(backend="ferrovod") and scripts that only
    change the backend's name). The job meets three ways in turn, in the same processes:
    ``init_method="file://..."``, ``init_method="tcp://..."`` and ``store=``. The TCP store
    is this test's, on a port it bound itself (port 0) and holds, so no port is chosen here
    and bound later by a rank; for tcp:// the ranks are told it is hosted for them, as
    torchrun's agent tells its workers."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port)}
    ways = ["file", f"tcp:{store.port}", f"store:{store.port}"]
    procs, outs = plain_ranks(3, None, tmp_path, worker="pg_entry_worker.py",
                              extra=[",".join(ways)], env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        met = re.findall(rf"^rank {r} met over (\S+)$", out, re.M)
        assert p.returncode == 0 and met == ways and f"rank {r} OK 12" in out, \
            f"rank {r}:\n{out[-4000:]}"
