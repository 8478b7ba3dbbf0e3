"""Workers started by other launchers find each other with no ferrovodrun: real torchrun, and
the exact environments Open MPI, Slurm and a PyTorchJob give a worker (each rank started here
as a plain process with that environment)."""

import importlib.util
import os
import re
import socket
import shutil
import subprocess
import sys
import time

import pytest

from conftest import WORKERS, reserved_port

pytestmark = pytest.mark.usefixtures("ferrovod_importable")
SCRIPT = str(WORKERS / "foreign_launcher_worker.py")
# Variables a surrounding launcher might have set: each test states its own launcher.
_LAUNCH_VARS = ("FERROVOD_", "HOROVOD_", "OMPI_", "PMI_", "SLURM_", "RANK", "WORLD_SIZE",
                "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "TORCHELASTIC_", "PET_")


def _base_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS)}
    env["PYTHONUNBUFFERED"] = "1"
    env["FERROVOD_START_TIMEOUT"] = "30"
    return env


def _run_ranks(envs, mode="ops", timeout=60):
    """Starts one plain process per environment and waits for all of them."""
    procs = [subprocess.Popen([sys.executable, SCRIPT, mode], env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    outs = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs


def _assert_all_ok(outs, n):
    for r, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {r} exited {code}\n{out}\n{err}"
        assert f"OK rank={r} size={n} local_rank={r} local_size={n} cross_size=1" in out, out + err


def _needs_torch():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (torchrun and torch.distributed come with it)")


def _mpich_hydra_runs():
    """None where MPICH's mpiexec.hydra starts a process here, else why not: tried, since an
    installed launcher may still fail (no hostname resolution, a broken install)."""
    if shutil.which("mpiexec.hydra") is None:
        return "MPICH's mpiexec.hydra is not installed (Debian/Ubuntu: mpich)"
    try:
        done = subprocess.run(["mpiexec.hydra", "-n", "1", "true"], capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"mpiexec.hydra -n 1 true did not run: {exc}"
    if done.returncode != 0:
        return f"mpiexec.hydra -n 1 true failed ({done.returncode}): {done.stderr.strip()[-300:]}"
    return None


def test_pytorchjob_environment_without_torchrun():
    port = reserved_port()
    envs = []
    for r in range(3):
        e = _base_env()
        e.update(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        envs.append(e)
    _assert_all_ok(_run_ranks(envs), 3)


def test_ranks_whose_torch_process_group_holds_master_port():
    """Ray Train's TorchTrainer sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT and starts
    torch's process group (its store on MASTER_PORT) before the training function runs: init()
    agrees on its own rendezvous through that group's store rather than taking the port."""
    _needs_torch()
    port = reserved_port(2)
    envs = []
    for r in range(3):
        e = _base_env()
        e.update(RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="3",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        envs.append(e)
    _assert_all_ok(_run_ranks(envs, mode="torch_group", timeout=120), 3)


def test_open_mpi_environment_with_an_explicit_rendezvous():
    addr = f"127.0.0.1:{reserved_port()}"
    envs = []
    for r in range(2):
        e = _base_env()
        e.update(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                 OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                 OMPI_UNIVERSE_SIZE="8",  # counts slots, not ranks: must be ignored
                 FERROVOD_RENDEZVOUS_ADDR=addr)
        envs.append(e)
    _assert_all_ok(_run_ranks(envs), 2)


def test_slurm_step_environment_derives_the_rendezvous_from_the_job():
    port = reserved_port()  # the Slurm rendezvous is 20000 + SLURM_JOB_ID % 10000
    assert 20000 <= port < 30000, port
    envs = []
    for r in range(2):
        e = _base_env()
        e.update(SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r), SLURM_STEP_ID="0",
                 SLURM_JOB_ID=str(port - 20000), SLURM_STEP_NODELIST="localhost")
        envs.append(e)
    _assert_all_ok(_run_ranks(envs), 2)


def test_horovod_gloo_workers_started_by_hand():
    """The variables a script sets to start Horovod's Gloo workers by hand: the ranks and the
    rendezvous host and port (rank 0 hosts ferrovod's store there); no FERROVOD_ variable."""
    port = reserved_port()
    envs = []
    for r in range(2):
        e = _base_env()
        e.update(HOROVOD_RANK=str(r), HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK=str(r),
                 HOROVOD_LOCAL_SIZE="2", HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1",
                 HOROVOD_HOSTNAME="localhost", HOROVOD_CONTROLLER="gloo",
                 HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
                 HOROVOD_GLOO_RENDEZVOUS_PORT=str(port))
        envs.append(e)
    _assert_all_ok(_run_ranks(envs), 2)


def test_half_set_environment_is_a_clear_error():
    e = _base_env()
    e["RANK"] = "1"
    proc = subprocess.run([sys.executable, SCRIPT], env=e, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0
    assert "RANK is set but WORLD_SIZE is missing" in proc.stderr, proc.stderr


def test_killed_rank_is_reported_when_no_launcher_stops_the_others():
    """By the failure, not by a timeout: the operation timeout (600 s) lies far beyond the
    wait for the ranks (60 s), and a stall would be a FerrovodTimeoutError besides."""
    port = reserved_port()
    envs = []
    for r in range(3):
        e = _base_env()
        e.update(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 FERROVOD_TIMEOUT_SECONDS="600")
        envs.append(e)
    outs = _run_ranks(envs, mode="kill")
    assert outs[1][0] == -9
    for r in (0, 2):
        code, out, err = outs[r]
        assert code == 0 and "saw RankFailureError rank=1" in out, out + err
        assert re.search(r"msg=.*rank\D{0,20}\b1\b", out), out


def test_real_torchrun():
    _needs_torch()
    port = reserved_port(2)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
         "--master_addr", "127.0.0.1", "--master_port", str(port), SCRIPT],
        env=_base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        assert f"OK rank={r} size=2 local_rank={r} local_size=2" in proc.stdout, proc.stdout


def test_torchrun_with_master_port_plus_one_taken():
    """ferrovod's store gets a free port agreed through torchrun's own store: a busy
    MASTER_PORT+1 (with torchrun's --standalone, MASTER_PORT is random) is no obstacle."""
    _needs_torch()
    port = reserved_port(2)
    with socket.socket() as squatter:
        squatter.bind(("0.0.0.0", port + 1))
        squatter.listen()
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
             "2", "--master_addr", "127.0.0.1", "--master_port", str(port), SCRIPT],
            env=_base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(2):
        assert f"OK rank={r} size=2 local_rank={r} local_size=2" in proc.stdout, proc.stdout


def test_torchrun_standalone():
    _needs_torch()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
         SCRIPT], env=_base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(3):
        assert f"OK rank={r} size=3 local_rank={r} local_size=3" in proc.stdout, proc.stdout


def test_real_mpich_hydra_with_a_rendezvous_address():
    """MPICH's mpiexec.hydra gives PMI_RANK/PMI_SIZE/MPI_LOCALRANKID; the store address comes
    with -genv (the mpi4py path is tested with Open MPI: the mpi4py wheel here loads it)."""
    why = _mpich_hydra_runs()
    if why is not None:
        pytest.skip(why)
    port = reserved_port(2)
    proc = subprocess.run(
        ["mpiexec.hydra", "-n", "3", "-genv", "FERROVOD_RENDEZVOUS_ADDR", f"127.0.0.1:{port}",
         sys.executable, SCRIPT], env=_base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(3):
        assert f"OK rank={r} size=3 local_rank={r} local_size=3" in proc.stdout, proc.stdout
