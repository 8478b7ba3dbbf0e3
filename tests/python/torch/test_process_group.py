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


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_numpy_and_gloo(n):
    found = checks(torchrun(n, "collectives", "subgroups", "p2p", "objects"), n)
    assert min(found.values()) > 2000, found


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


@pytest.mark.parametrize("n", [2, 3])
def test_ddp_hooks_fsdp2_and_join_match_their_references_and_a_group_starts_again(n):
    found = checks(torchrun(n, "ddp", "hooks", "fsdp", "join", "lifecycle"), n)
    assert min(found.values()) > 1000, found


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


def test_a_group_timeout_fails_a_stalled_op_once_it_has_passed(tmp_path):
    procs, outs = plain_ranks(3, "timeout", tmp_path)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and re.search(rf"^rank {r} OK (\d+)$", out, re.M), \
            f"rank {r} (exit {p.returncode}):\n{out[-4000:]}"


def test_a_killed_rank_fails_the_others_naming_it(tmp_path):
    n = 3
    procs, outs = plain_ranks(n, "kill", tmp_path)
    assert procs[n - 1].returncode == -9, outs[n - 1][-2000:]
    for r in range(n - 1):
        assert procs[r].returncode == 0 and f"rank {r} OK" in outs[r], \
            f"rank {r} (exit {procs[r].returncode}):\n{outs[r][-4000:]}"


@pytest.mark.parametrize("how", ["tcp", "store"])
def test_a_job_meets_over_tcp_or_a_store_the_user_made(how, tmp_path):
    """``init_method="tcp://..."`` and ``store=``: the store is this test's, on a port it bound
    itself (port 0) and holds, so no port is chosen here and bound later by a rank. For
    tcp:// the ranks are told it is hosted for them, as torchrun's agent tells its workers."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    env = None
    if how == "tcp":
        env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port)}
    procs, outs = plain_ranks(3, None, tmp_path, worker="pg_entry_worker.py",
                              extra=[f"{how}:{store.port}"], env=env)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} OK" in out, f"rank {r}:\n{out[-4000:]}"


def test_naming_the_backend_is_enough_without_importing_ferrovod(tmp_path):
    """torch finds the backend through the package's entry point (Ray Train's
    TorchConfig(backend="ferrovod") and scripts that only change the backend's name)."""
    procs, outs = plain_ranks(2, None, tmp_path, worker="pg_entry_worker.py")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {r} OK" in out, f"rank {r}:\n{out[-4000:]}"
