"""The Kubernetes examples run in the worlds their operators build, simulated with network
namespaces (netns.py) — the manifests' own commands, read from the YAML (kube_examples.py):

* MPIJob (kubeflow.org/v2beta1, OpenMPI): a launcher pod and two worker pods named as the
  operator names them (``<job>-worker-<i>.<job>.<ns>.svc``), the hostfile at
  ``/etc/mpi/hostfile`` in the launcher only, the operator's ``OMPI_MCA_*`` variables, ssh on
  port 2222 through the image's ``/etc/ssh/ssh_config`` and a key in every pod; the launcher
  command is run as written (``ferrovodrun`` or plain ``mpirun``);
* PyTorchJob (kubeflow.org/v1): a master and a worker pod with the variables the training
  operator injects (RANK is the node rank), each running its container's ``torchrun`` command
  after Kubernetes' ``$(VAR)`` expansion;
* MXJob (kubeflow.org/v1): scheduler, server and worker pods with the operator's ``MX_CONFIG``
  and ``DMLC_*`` variables, each running the manifest's command in MXNet's interpreter.

Two substitutions only: the image's paths (``/opt/ferrovod/examples``, ``python``,
``ferrovodrun``, ``torchrun``) become this checkout's and its virtual environment's, and the
training runs 2 epochs instead of 20 to keep the suite fast.
"""

import os
import shutil
import signal
import subprocess
import sys

import pytest

import kube_examples as K
from conftest import REPO, mxnet_python
from netns import Cluster, missing_tools

pytestmark = [
    pytest.mark.usefixtures("ferrovod_importable"),
    pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools())),
    # One pytest-xdist worker runs every network-namespace test: the operator's /etc/mpi is
    # made and removed per world, and one module's hosts are shared by its tests.
    pytest.mark.xdist_group("netns"),
]

PY = sys.executable
IMAGE_EXAMPLES = "/opt/ferrovod/examples"
EPOCHS = ["--epochs", "2"]
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI (openmpi-bin)")


def in_checkout(argv):
    """The image's command with this checkout's paths (see the module docstring)."""
    tools = {
        "python": [PY],
        "python3": [PY],
        "ferrovodrun": [PY, "-m", "ferrovod.runner.launch"],
        "torchrun": [PY, "-m", "torch.distributed.run"],
    }
    out = []
    for i, arg in enumerate(argv):
        if i == 0 or (arg in ("python", "python3") and out):
            out += tools.get(arg, [arg])
        else:
            out.append(arg.replace(IMAGE_EXAMPLES, str(REPO / "examples")))
    return out + EPOCHS


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FERROVOD_", "HOROVOD_", "OMPI_", "PMI", "SLURM_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(extra)
    return env


def describe(res):
    return f"exit {res.returncode}\n--- stdout ---\n{res.stdout[-5000:]}\n--- stderr ---\n{res.stderr[-5000:]}"


def trained_on(stdout, ranks):
    """The example's summary line says it trained on ``ranks`` ranks and reports accuracy."""
    return f"ranks: {ranks}" in stdout and "test accuracy:" in stdout


def mpijob_world(manifest, tmp_path):
    launcher = f"{K.load(manifest)['metadata']['name']}-launcher"
    workers = K.mpijob_worker_hosts(manifest)
    cluster = Cluster([launcher, *workers], tmp_path, operator_ssh_config=True)
    return cluster, launcher


@pytest.mark.parametrize("manifest", [
    K.MPIJOB_FERROVODRUN,
    pytest.param(K.MPIJOB_MPIRUN, marks=needs_mpirun),
], ids=["ferrovodrun", "mpirun"])
def test_mpijob(manifest, tmp_path):
    cluster, launcher = mpijob_world(manifest, tmp_path)
    with cluster:
        cluster.put_etc(launcher, "mpi/hostfile", K.mpijob_hostfile(manifest))
        env = clean_env(**K.mpijob_launcher_env(manifest))
        argv = in_checkout(K.launcher_command(manifest))
        res = cluster.run(launcher, argv, timeout=300, env=env)
        assert res.returncode == 0, describe(res)
        slots = K.mpijob_slots(manifest) * len(K.mpijob_worker_hosts(manifest))
        assert trained_on(res.stdout, slots), describe(res)
        assert cluster.leftovers("pytorch_digits.py", within=5) == {}


def test_elastic_mpijob_goes_on_when_a_worker_pod_is_lost(tmp_path):
    """The elastic MPIJob: the operator's discover_hosts.sh (bare pod names, no slots) in the
    launcher, ssh on 2222. Once training runs, one rank of worker pod 1 is SIGKILLed (a pod
    losing a process; the host is then blacklisted and its other rank leaves): the job goes
    on with worker pod 0's two ranks and ends well."""
    manifest = K.MPIJOB_ELASTIC
    cluster, launcher = mpijob_world(manifest, tmp_path)
    workers = K.mpijob_worker_hosts(manifest)
    with cluster:
        cluster.put_etc(launcher, "mpi/discover_hosts.sh", K.mpijob_discover_hosts(manifest))
        os.chmod(f"/etc/netns/{cluster.hosts[launcher].ns}/mpi/discover_hosts.sh", 0o755)
        env = clean_env(**K.mpijob_launcher_env(manifest))
        argv = in_checkout(K.launcher_command(manifest))
        proc = cluster.popen(launcher, argv, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        out, killed = [], False
        try:
            for line in proc.stdout:
                out.append(line)
                if not killed and "epoch 0: test accuracy" in line:
                    victims = cluster.processes(workers[1], "pytorch_digits_elastic.py")
                    assert victims, "".join(out)
                    os.kill(int(victims[0].split(":", 1)[0]), signal.SIGKILL)
                    killed = True
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
        text = "".join(out)
        assert proc.returncode == 0 and killed, text
        assert "training on 4 workers" in text and "training on 2 workers" in text, text
        assert "test accuracy:" in text, text
        assert cluster.leftovers("pytorch_digits_elastic.py", within=5) == {}


def test_pytorchjob(tmp_path):
    manifest = K.PYTORCHJOB
    name = K.load(manifest)["metadata"]["name"]
    pods = [("Master", 0, f"{name}-master-0"), ("Worker", 0, f"{name}-worker-0")]
    with Cluster([pod for _, _, pod in pods], tmp_path) as cluster:
        procs = []
        for kind, index, pod in pods:
            env = clean_env(PYTHONUNBUFFERED="1", **K.pytorchjob_env(manifest, kind, index))
            argv = in_checkout(K.pytorchjob_argv(manifest, kind, index))
            procs.append(cluster.popen(pod, argv, env=env, stdout=-1, stderr=-1, text=True))
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, f"{out[-4000:]}\n{err[-6000:]}"
        world = int(K.pytorchjob_env(manifest, "Master", 0)["WORLD_SIZE"])
        assert trained_on(outs[0][0], world), outs[0]


# -- Kubeflow Trainer v2: TrainJob on a ClusterTrainingRuntime ---------------------------------


def test_trainjob_on_the_mpi_runtime(tmp_path):
    """The MPI policy: Trainer's pod names (<job>-launcher-0-0, <job>-node-0-<i>, under the
    job's subdomain), the hostfile in the launcher only, its OMPI_MCA_* variables, ssh on 2222
    through the image's ssh_config; the TrainJob's command (ferrovodrun) runs in the launcher."""
    job = K.TRAINJOB_MPI
    launcher = K.trainjob_pod_hosts(job, "launcher")[0]
    nodes = K.trainjob_pod_hosts(job)
    with Cluster([launcher, *nodes], tmp_path, operator_ssh_config=True) as cluster:
        cluster.put_etc(launcher, "mpi/hostfile", K.trainjob_mpi_hostfile(job))
        env = clean_env(**K.trainjob_mpi_launcher_env(job))
        res = cluster.run(launcher, in_checkout(K.trainjob_command(job)), timeout=300, env=env)
        assert res.returncode == 0, describe(res)
        assert trained_on(res.stdout, K.trainjob_mpi_slots(job) * len(nodes)), describe(res)
        assert cluster.leftovers("pytorch_digits.py", within=5) == {}


@pytest.mark.parametrize("trainjob", [K.TRAINJOB_TORCH, K.TRAINJOB_TORCH_PYTHON],
                         ids=["torchrun", "python"])
def test_trainjob_on_the_torch_runtime(trainjob, tmp_path):
    """The Torch policy: every node pod runs the trainer command with the PET_* variables
    Trainer sets: torchrun (2 processes per pod, placed by torchrun), or the script itself (one
    process per pod, placed by ferrovod from PET_NODE_RANK and PET_NNODES)."""
    pods = K.trainjob_pod_hosts(trainjob)
    with Cluster(pods, tmp_path) as cluster:
        procs = []
        for i, pod in enumerate(pods):
            env = clean_env(PYTHONUNBUFFERED="1", **K.trainjob_torch_env(trainjob, i))
            procs.append(cluster.popen(pod, in_checkout(K.trainjob_command(trainjob)), env=env,
                                       stdout=-1, stderr=-1, text=True))
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, f"{out[-4000:]}\n{err[-6000:]}"
        env0 = K.trainjob_torch_env(trainjob, 0)
        world = int(env0["PET_NNODES"]) * int(env0["PET_NPROC_PER_NODE"])
        assert trained_on(outs[0][0], world), outs[0]


# -- MXJob ---------------------------------------------------------------------------------------


def test_mxjob(tmp_path):
    """The MXJob: scheduler, server and two worker pods named as the operator names them, each
    with its MX_CONFIG and DMLC_* variables, all running the manifest's one command in MXNet's
    interpreter (.venv-mxnet): the workers train together from MX_CONFIG, the scheduler and
    the server end at once, successfully, saying they are not needed."""
    mxpy = mxnet_python()
    manifest = K.MXJOB
    pods = K.mxjob_pods(manifest)
    with Cluster([pod for _, _, pod in pods], tmp_path) as cluster:
        procs = []
        for rtype, index, pod in pods:
            env = clean_env(PYTHONUNBUFFERED="1", **K.mxjob_env(manifest, rtype, index))
            argv = [mxpy if a in ("python", "python3") else a
                    for a in K.mxjob_container(manifest, rtype)["command"]]
            argv = [a.replace(IMAGE_EXAMPLES, str(REPO / "examples")) for a in argv] + EPOCHS
            procs.append(cluster.popen(pod, argv, env=env, stdout=-1, stderr=-1, text=True))
        outs = [p.communicate(timeout=300) for p in procs]
    workers = 0
    for (rtype, index, _), p, (out, err) in zip(pods, procs, outs):
        assert p.returncode == 0, f"{rtype} {index}: {out[-4000:]}\n{err[-6000:]}"
        if rtype == "Worker":
            workers += 1
        else:
            assert "need no" in err and out == "", f"{rtype}: {out}\n{err}"
    worker0 = next(o for (t, i, _), o in zip(pods, outs) if t == "Worker" and i == 0)
    assert trained_on(worker0[0], workers), worker0
