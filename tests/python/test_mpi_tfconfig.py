"""Jobs started by real Open MPI (rendezvous found over mpi4py) and by TF_CONFIG (a TFJob's
chief and workers, each started here as a plain process), with no ferrovodrun and no
FERROVOD_RENDEZVOUS_ADDR; FERROVOD_IFACE; and the errors of both."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from capabilities import mpi4py_missing
from conftest import LAUNCH_ENV_NAMES, LAUNCH_ENV_PREFIXES, WORKERS, reserved_port

pytestmark = pytest.mark.usefixtures("ferrovod_importable")
SCRIPT = str(WORKERS / "mpi_tfconfig_worker.py")
MPIRUN = shutil.which("mpirun")
# Tried once: mpirun starts a rank that imports mpi4py.MPI (capabilities.py).
needs_mpi = pytest.mark.skipif(mpi4py_missing() is not None, reason=str(mpi4py_missing()))


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCH_ENV_PREFIXES) and k not in LAUNCH_ENV_NAMES}
    env.update(PYTHONUNBUFFERED="1", FERROVOD_START_TIMEOUT="30")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _communicate(procs, timeout):
    """Waits for every process; on timeout kills their process groups and fails."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()
        pytest.fail(f"job did not finish within {timeout} s")
    return outs


def _spawn(cmd, env):
    return subprocess.Popen([str(c) for c in cmd], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _mpirun(np_, *args, env):
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "--mca", "btl_vader_single_copy_mechanism", "none", "-np", str(np_),
           sys.executable, SCRIPT, *[str(a) for a in args]]
    code, out, err = _communicate([_spawn(cmd, env)], timeout=50)[0]
    return code, out, err


def _lines(text, prefix):
    """``{rank: line}`` for lines ``<prefix> rank=<r> ...``."""
    found = {}
    for ln in text.splitlines():
        if ln.startswith(prefix + " rank="):
            found[ln.split()[1].split("=")[1]] = ln
    return found


def _assert_ok(text, n, checks=11):
    oks = _lines(text, "OK")
    assert sorted(oks) == [str(r) for r in range(n)], text
    assert all(ln.endswith(f"checks={checks}") for ln in oks.values()), oks


def _rank0_listens(out):
    """The addresses rank 0 listens on at the end (its coordinator's among them)."""
    listen = _lines(out, "LISTEN")
    assert "0" in listen, out
    return set(listen["0"].split()[2:])


@needs_mpi
def test_mpirun_with_mpi4py_finds_the_rendezvous_by_itself():
    code, out, err = _mpirun(3, "mpi", 3, 3, env=_env())
    assert code == 0, out + err
    _assert_ok(out, 3)
    # All ranks on one host: the store and the listeners are on loopback.
    assert "127.0.0.1" in _rank0_listens(out), out


@needs_mpi
def test_mpirun_with_a_world_communicator_and_ferrovod_iface_lo():
    code, out, err = _mpirun(3, "mpi-comm", 3, 3, env=_env(FERROVOD_IFACE="lo"))
    assert code == 0, out + err
    _assert_ok(out, 3)
    assert "127.0.0.1" in _rank0_listens(out), out


@needs_mpi
def test_rank_list_and_communicator_process_sets_as_in_horovod():
    """init(comm=[0..n-1]) runs the job; ProcessSet(comm) of each process's half of a
    COMM_WORLD split registers both halves; collectives in them are right."""
    code, out, err = _mpirun(4, "mpi-sets", 4, 4, env=_env())
    assert code == 0, out + err
    _assert_ok(out, 4, checks=4)


@needs_mpi
def test_rank_list_naming_part_of_the_job_is_a_clear_error_on_every_rank():
    code, out, err = _mpirun(3, "mpi-subset", 3, 3, env=_env())
    assert code != 0, out + err
    errs = _lines(out, "ERR")
    assert sorted(errs) == ["0", "1", "2"], out + err
    for ln in errs.values():
        assert "spans every launched process (3 here)" in ln and "ProcessSet([0, 1])" in ln, ln


@needs_mpi
def test_mpirun_with_a_missing_interface_fails_on_every_rank():
    code, out, err = _mpirun(3, "error", 0, 0, env=_env(HOROVOD_GLOO_IFACE="nosuch0"))
    assert code != 0, out + err
    errs = _lines(out, "ERR")
    assert sorted(errs) == ["0", "1", "2"], out + err
    for ln in errs.values():
        assert "InvalidArgumentError" in ln and "FERROVOD_IFACE=nosuch0" in ln, ln
        assert socket.gethostname() in ln and "lo 127.0.0.1/8" in ln, ln


def test_open_mpi_environment_without_mpi4py_keeps_the_clear_error(tmp_path):
    # An Open MPI rank's environment, and an mpi4py that cannot be imported.
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ImportError('no mpi4py here')\n")
    env = _env(OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=0,
               OMPI_COMM_WORLD_LOCAL_SIZE=2, PYTHONPATH=str(tmp_path))
    code, out, err = _communicate([_spawn([sys.executable, SCRIPT, "error", 0, 0], env)], 30)[0]
    assert code == 3, out + err
    assert "FERROVOD_RENDEZVOUS_ADDR" in out and "mpi4py" in out, out + err


def _tf_job(host, **extra):
    """A chief and two workers on ``host``; only the chief's port is ever bound."""
    cluster = {"chief": [f"{host}:{reserved_port()}"], "ps": [f"{host}:1"],
               "worker": [f"{host}:2", f"{host}:3"]}
    tasks = [("chief", 0), ("worker", 0), ("worker", 1)]
    procs = []
    for rank, (kind, index) in enumerate(tasks):
        tf = {"cluster": cluster, "task": {"type": kind, "index": index}, "environment": "cloud"}
        env = _env(TF_CONFIG=json.dumps(tf), FVTEST_RANK=rank, **extra)
        procs.append(_spawn([sys.executable, SCRIPT, "tf", 3, 3], env))
    outs = _communicate(procs, timeout=50)
    for code, out, err in outs:
        assert code == 0, out + err
    text = "\n".join(o for _, o, _ in outs)
    _assert_ok(text, 3)
    return _rank0_listens(outs[0][1])


def test_tf_config_chief_and_workers():
    # The chief's endpoint is 127.0.0.2 (still loopback): the listeners follow it there.
    listens = _tf_job("127.0.0.2")
    assert "127.0.0.2" in listens and "127.0.0.1" not in listens, listens


def test_tf_config_with_ferrovod_iface_binds_to_that_interface():
    listens = _tf_job("127.0.0.2", FERROVOD_IFACE="lo")
    assert "127.0.0.1" in listens and "127.0.0.2" not in listens, listens


CLUSTER = {"chief": ["127.0.0.1:2222"], "ps": ["127.0.0.1:2223"], "worker": ["127.0.0.1:2224"]}


@pytest.mark.parametrize("tf_config, message", [
    (json.dumps({"cluster": CLUSTER, "task": {"type": "ps", "index": 0}}),
     'this process is a "ps" task; ferrovod runs chief and worker tasks only'),
    (json.dumps({"cluster": {"worker": {"1": "w1:2222"}, "ps": ["p:2222"]},
                 "task": {"type": "worker", "index": 1}}),
     "sparse form a TFJob with enableDynamicWorker gives"),
    ('{"cluster": {"worker": ["w:1"]}, "task": {"type": "worker" "index": 0}}',
     "TF_CONFIG: not valid JSON (expected `,` or `}` at line 1 column"),
    (json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": 1}}),
     "task worker index 1 is out of range: cluster.worker has 1 entries"),
], ids=["ps-task", "sparse-form", "bad-json", "index-out-of-range"])
def test_tf_config_errors(tf_config, message):
    env = _env(TF_CONFIG=tf_config, FVTEST_RANK=0)
    code, out, err = _communicate([_spawn([sys.executable, SCRIPT, "error", 0, 0], env)], 30)[0]
    assert code == 3, out + err
    assert "InvalidArgumentError" in out and message in out, out + err


def test_rank0_picks_an_address_every_host_can_reach():
    from ferrovod._rendezvous import rendezvous_ip as _rendezvous_ip
    from ferrovod.exceptions import InvalidArgumentError

    lo = ("lo", "127.0.0.1", 8)
    h0 = (0, "h0", [lo, ("docker0", "172.17.0.1", 16), ("eth0", "10.1.0.5", 24),
                    ("ib0", "192.168.7.10", 24)])
    h1 = (2, "h1", [lo, ("docker0", "172.18.0.1", 16), ("ib0", "192.168.7.11", 24),
                    ("eth0", "10.1.0.6", 24)])
    h2 = (3, "h2", [lo, ("eth0", "10.2.0.7", 24), ("ib0", "192.168.7.12", 24)])
    # The first of rank 0's interfaces that shares a subnet with every other host.
    assert _rendezvous_ip([h0, h0, h1, h1], 0, None) == "10.1.0.5"
    assert _rendezvous_ip([h1, h0, h2], 1, None) == "192.168.7.10"
    assert _rendezvous_ip([h0, h1], 0, "ib0") == "192.168.7.10"
    # One host: loopback. Two containers with one host name but different addresses are two.
    assert _rendezvous_ip([h0, h0, h0], 1, None) == "127.0.0.1"
    twin = (1, "h0", [lo, ("eth0", "10.1.0.9", 24)])
    assert _rendezvous_ip([h0, twin], 0, None) == "10.1.0.5"
    with pytest.raises(InvalidArgumentError) as e:
        _rendezvous_ip([h0, h2, (4, "h3", [lo, ("eth0", "10.3.0.1", 24)])], 0, None)
    text = str(e.value)
    for host, addr in (("h0", "eth0 10.1.0.5/24"), ("h2", "ib0 192.168.7.12/24"),
                       ("h3", "eth0 10.3.0.1/24")):
        assert f"{host} (" in text and addr in text, text
    with pytest.raises(InvalidArgumentError, match=r"FERROVOD_IFACE=ib0: .* on host h3 \(lo 127"):
        _rendezvous_ip([h0, (4, "h3", [lo, ("eth0", "10.3.0.1", 24)])], 0, "ib0")


def test_rank0_holds_the_port_it_hands_out_until_its_engine_serves_there():
    import socket

    from ferrovod import _rendezvous

    lo = ("lo", "127.0.0.1", 8)
    (status, addr, secret), listener = _rendezvous.answer(
        [(0, "h0", [lo]), (1, "h0", [lo])], 0, {"iface": None, "secret_set": False})
    try:
        assert status == "ok" and len(secret) == 32 and listener is not None, (status, addr)
        host, port = addr.rsplit(":", 1)
        # No other socket can take the port between the answer and the engine's start ...
        with socket.socket() as other, pytest.raises(OSError):
            other.bind((host, int(port)))
        # ... and a rank that connects before the store runs waits in the backlog.
        with socket.create_connection((host, int(port)), timeout=10):
            pass
    finally:
        if listener is not None:
            listener.close()
