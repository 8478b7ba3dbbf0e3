"""The Kubernetes examples (examples/kubernetes/) as data, and the world the operators build.

Tests that simulate an MPIJob or a PyTorchJob (hosts as network namespaces) run the exact
commands of the manifests through these helpers, so an edit to a manifest is what gets tested:

- ``launcher_command(path)``: the MPIJob launcher's argv (``command`` + ``args``);
- ``worker_command(path)``: the MPIJob workers' argv;
- ``mpijob_hostfile(path, namespace)`` and ``mpijob_launcher_env(path, hostfile_path)``: the
  hostfile and launcher environment the MPI operator (v2beta1, OpenMPI) creates;
- ``pytorchjob_container(path, replica_type)``: the PyTorchJob container (name, image, command,
  args, env, ports);
- ``pytorchjob_env(path, replica_type, index)``: the variables the training operator injects;
- ``pytorchjob_argv(path, replica_type, index)``: that container's argv after Kubernetes'
  ``$(VAR)`` expansion, i.e. what the pod really runs;
- ``mxjob_pods(path)`` and ``mxjob_env(path, replica_type, index)``: an MXJob's pods and the
  ``MX_CONFIG`` and ``DMLC_*`` variables the operator gives each (mxnet-operator v1
  ``SetClusterSpec``).

What the operators do is taken from their sources (mpi-operator v2beta1 ``newConfigMap`` /
``newLauncherPodTemplate``; training-operator v1.9 ``pytorch/envvar.go`` and ``master.go``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "kubernetes"
DOCKERFILE = EXAMPLES / "Dockerfile"
DOCKERIGNORE = EXAMPLES / "Dockerfile.dockerignore"
MPIJOB_FERROVODRUN = EXAMPLES / "mpijob-ferrovodrun.yaml"
MPIJOB_MPIRUN = EXAMPLES / "mpijob-mpirun.yaml"
MPIJOB_ELASTIC = EXAMPLES / "mpijob-elastic.yaml"
PYTORCHJOB = EXAMPLES / "pytorchjob.yaml"
# DDP on backend="ferrovod": the same pods and torchrun, another script.
PYTORCHJOB_DDP = EXAMPLES / "pytorchjob-ddp.yaml"
PYTORCHJOBS = (PYTORCHJOB, PYTORCHJOB_DDP)
MANIFESTS = (MPIJOB_FERROVODRUN, MPIJOB_MPIRUN, MPIJOB_ELASTIC, PYTORCHJOB, PYTORCHJOB_DDP)

# Where the MPI operator mounts its ConfigMap in the launcher (configMountPath + key).
MPI_HOSTFILE = "/etc/mpi/hostfile"
# training-operator's PyTorchJobDefaultContainerName / PortName / Port.
PYTORCH_CONTAINER = "pytorch"
PYTORCH_PORT_NAME = "pytorchjob-port"
PYTORCH_DEFAULT_PORT = 23456


def load(path: Path) -> Dict[str, Any]:
    """The manifest at ``path``; exactly one YAML document is expected."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    if len(docs) != 1:
        raise ValueError(f"{path}: expected one YAML document, found {len(docs)}")
    return docs[0]


def _argv(container: Dict[str, Any]) -> List[str]:
    return [str(a) for a in (container.get("command") or []) + (container.get("args") or [])]


def _only_container(job: Dict[str, Any], replicas_key: str, replica_type: str) -> Dict[str, Any]:
    containers = job["spec"][replicas_key][replica_type]["template"]["spec"]["containers"]
    if len(containers) != 1:
        raise ValueError(f"{replica_type}: expected one container, found {len(containers)}")
    return containers[0]


def mpijob_container(path: Path, replica_type: str) -> Dict[str, Any]:
    """The container of an MPIJob's ``Launcher`` or ``Worker`` (a copy)."""
    return copy.deepcopy(_only_container(load(path), "mpiReplicaSpecs", replica_type))


def launcher_command(path: Path) -> List[str]:
    """The MPIJob launcher's argv, e.g. ``["ferrovodrun", "-np", "4", ...]``."""
    return _argv(mpijob_container(path, "Launcher"))


def worker_command(path: Path) -> List[str]:
    """The MPIJob workers' argv (the operator's default, ``sshd -De``, when none is given)."""
    return _argv(mpijob_container(path, "Worker")) or ["/usr/sbin/sshd", "-De"]


def mpijob_worker_hosts(path: Path, namespace: str = "default") -> List[str]:
    """The workers' names as the hostfile gives them: ``<job>-worker-<i>.<job>.<ns>.svc``."""
    job = load(path)
    name = job["metadata"]["name"]
    replicas = int(job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"])
    return [f"{name}-worker-{i}.{name}.{namespace}.svc" for i in range(replicas)]


def mpijob_slots(path: Path) -> int:
    """``slotsPerWorker`` (the operator's default is 1)."""
    return int(load(path)["spec"].get("slotsPerWorker", 1))


def mpijob_hostfile(path: Path, namespace: str = "default") -> str:
    """The hostfile the MPI operator writes for an OpenMPI MPIJob (no runLauncherAsWorker)."""
    job = load(path)
    impl = job["spec"].get("mpiImplementation", "OpenMPI")
    if impl != "OpenMPI":
        raise ValueError(f"{path}: only mpiImplementation OpenMPI is modelled, got {impl}")
    if job["spec"].get("runLauncherAsWorker"):
        raise ValueError(f"{path}: runLauncherAsWorker is not modelled")
    slots = mpijob_slots(path)
    return "".join(f"{host} slots={slots}\n" for host in mpijob_worker_hosts(path, namespace))


def mpijob_discover_hosts(path: Path, namespace: str = "default") -> str:
    """The ``discover_hosts.sh`` the MPI operator mounts in an elastic MPIJob's launcher, with
    every worker pod running: one bare host name per line, no slots."""
    lines = "".join(f"echo {host}\n" for host in mpijob_worker_hosts(path, namespace))
    return "#!/bin/sh\n" + lines


def mpijob_launcher_env(path: Path, hostfile_path: str = MPI_HOSTFILE) -> Dict[str, str]:
    """The variables the MPI operator adds to an OpenMPI launcher (plus the container's own).

    ``hostfile_path`` replaces ``/etc/mpi/hostfile`` where a test keeps the file elsewhere.
    """
    container = mpijob_container(path, "Launcher")
    env = {e["name"]: str(e.get("value", "")) for e in container.get("env") or []}
    env.update(
        {
            "K_MPI_JOB_ROLE": "launcher",
            "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
            "OMPI_MCA_orte_default_hostfile": hostfile_path,
            "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
            "OMPI_MCA_orte_set_default_slots": str(mpijob_slots(path)),
            "NVIDIA_VISIBLE_DEVICES": "",
            "NVIDIA_DRIVER_CAPABILITIES": "",
        }
    )
    return env


def pytorchjob_container(path: Path, replica_type: str = "Master") -> Dict[str, Any]:
    """The PyTorchJob container of ``Master`` or ``Worker``: a copy with ``command``, ``args``,
    ``env`` and ``ports`` always present (lists, possibly empty)."""
    container = copy.deepcopy(_only_container(load(path), "pytorchReplicaSpecs", replica_type))
    for key in ("command", "args", "env", "ports"):
        container[key] = list(container.get(key) or [])
    return container


def _pytorch_master_port(job: Dict[str, Any]) -> int:
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    for container in master:
        if container.get("name") == PYTORCH_CONTAINER:
            for port in container.get("ports") or []:
                if port.get("name") == PYTORCH_PORT_NAME:
                    return int(port["containerPort"])
    return PYTORCH_DEFAULT_PORT


def pytorchjob_env(path: Path, replica_type: str, index: int) -> Dict[str, str]:
    """The environment of pod ``<job>-<type>-<index>``: the container's env, then what the
    training operator appends (MASTER_*, WORLD_SIZE, RANK = node rank, PET_*)."""
    job = load(path)
    spec = job["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    if "Master" not in replicas:
        raise ValueError(f"{path}: only jobs with a Master replica are modelled")
    if spec.get("elasticPolicy"):
        raise ValueError(f"{path}: elasticPolicy is not modelled")
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())
    nproc_text = str(spec.get("nprocPerNode", "auto"))
    nproc = int(nproc_text) if nproc_text.isdigit() else 1  # "auto"/"gpu" count as 1
    node_rank = index + 1 if replica_type == "Worker" else index
    master_addr = f"{job['metadata']['name']}-master-0"
    master_port = str(_pytorch_master_port(job))
    container = pytorchjob_container(path, replica_type)
    env = {e["name"]: str(e.get("value", "")) for e in container["env"]}
    env.update(
        {
            "MASTER_PORT": master_port,
            "PET_MASTER_PORT": master_port,
            "MASTER_ADDR": master_addr,
            "PET_MASTER_ADDR": master_addr,
            "WORLD_SIZE": str(total * nproc),
            "RANK": str(node_rank),
            "PET_NPROC_PER_NODE": nproc_text,
            "PET_NODE_RANK": str(node_rank),
            "PET_NNODES": str(total),
        }
    )
    return env


def expand_k8s_vars(text: str, env: Dict[str, str]) -> str:
    """Kubernetes' expansion of ``command``/``args``: ``$(NAME)`` becomes NAME's value when
    NAME is defined and stays as written otherwise; ``$$`` is a literal ``$``."""
    out: List[str] = []
    i = 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2 : end]
                    out.append(env[name] if name in env else text[i : end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def pytorchjob_argv(path: Path, replica_type: str, index: int) -> List[str]:
    """What pod ``<job>-<type>-<index>`` runs: its command + args with ``$(VAR)`` expanded."""
    env = pytorchjob_env(path, replica_type, index)
    return [expand_k8s_vars(a, env) for a in _argv(pytorchjob_container(path, replica_type))]


# -- Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1): ClusterTrainingRuntime + TrainJob -------
#
# What Trainer does is taken from its sources (pkg/runtime/framework/plugins: jobset.go's pod
# endpoints "<trainjob>-<replicatedJob>-<replica>-<pod>.<trainjob>", mpi.go's hostfile and
# OMPI_MCA_* variables, torch.go's PET_* variables; pkg/constants).

TRAINER_RUNTIME_MPI = EXAMPLES / "trainer-runtime-mpi.yaml"
TRAINER_RUNTIME_TORCH = EXAMPLES / "trainer-runtime-torch.yaml"
TRAINJOB_MPI = EXAMPLES / "trainjob-mpi.yaml"
TRAINJOB_TORCH = EXAMPLES / "trainjob-torch.yaml"
TRAINJOB_TORCH_PYTHON = EXAMPLES / "trainjob-torch-python.yaml"
TRAINER_RUNTIMES = (TRAINER_RUNTIME_MPI, TRAINER_RUNTIME_TORCH)
TRAINJOBS = (TRAINJOB_MPI, TRAINJOB_TORCH, TRAINJOB_TORCH_PYTHON)
TRAINER_MANIFESTS = TRAINER_RUNTIMES + TRAINJOBS
# Trainer's constants: ContainerTrainerPort, the MPI rsh arguments, the ancestor label.
TRAINER_PORT = 29500
TRAINER_RSH_ARGS = "-o ConnectionAttempts=10"
_ANCESTOR = "trainer.kubeflow.org/trainjob-ancestor-step"


def trainjob_runtime(trainjob: Path) -> Dict[str, Any]:
    """The ClusterTrainingRuntime a TrainJob's runtimeRef names (among the examples)."""
    name = load(trainjob)["spec"]["runtimeRef"]["name"]
    for path in TRAINER_RUNTIMES:
        runtime = load(path)
        if runtime["metadata"]["name"] == name:
            return runtime
    raise ValueError(f"{trainjob}: no example runtime is named {name!r}")


def _replicated_jobs(runtime: Dict[str, Any]) -> List[Dict[str, Any]]:
    return runtime["spec"]["template"]["spec"]["replicatedJobs"]


def _trainer_container(runtime: Dict[str, Any]) -> Dict[str, Any]:
    """The container the TrainJob's trainer settings go to: "node" in the replicated job
    labelled as the trainer ancestor."""
    for rjob in _replicated_jobs(runtime):
        labels = rjob["template"].get("metadata", {}).get("labels", {})
        if labels.get(_ANCESTOR) == "trainer":
            for c in rjob["template"]["spec"]["template"]["spec"]["containers"]:
                if c["name"] == "node":
                    return c
    raise ValueError("the runtime has no trainer-ancestor container named node")


def trainjob_nodes(trainjob: Path) -> int:
    job, runtime = load(trainjob), trainjob_runtime(trainjob)
    return int(job["spec"].get("trainer", {}).get("numNodes")
               or runtime["spec"]["mlPolicy"].get("numNodes", 1))


def trainjob_pod_hosts(trainjob: Path, replicated_job: str = "node") -> List[str]:
    """The pods of a replicated job, as other pods reach them: node pods (numNodes of them,
    one replica of the job with that many pods) or the one launcher."""
    name = load(trainjob)["metadata"]["name"]
    count = trainjob_nodes(trainjob) if replicated_job == "node" else 1
    return [f"{name}-{replicated_job}-0-{i}.{name}" for i in range(count)]


def trainjob_mpi_slots(trainjob: Path) -> int:
    job, runtime = load(trainjob), trainjob_runtime(trainjob)
    given = job["spec"].get("trainer", {}).get("numProcPerNode")
    return int(given if given is not None else runtime["spec"]["mlPolicy"]["mpi"]["numProcPerNode"])


def trainjob_mpi_hostfile(trainjob: Path) -> str:
    """/etc/mpi/hostfile as Trainer writes it in the launcher (runLauncherAsNode off: the node
    pods only)."""
    runtime = trainjob_runtime(trainjob)
    if runtime["spec"]["mlPolicy"]["mpi"].get("runLauncherAsNode"):
        raise ValueError("the examples keep ranks off the launcher")
    slots = trainjob_mpi_slots(trainjob)
    return "".join(f"{h} slots={slots}\n" for h in trainjob_pod_hosts(trainjob))


def trainjob_mpi_launcher_env(trainjob: Path, hostfile_path: str = MPI_HOSTFILE) -> Dict[str, str]:
    """The variables Trainer's MPI plugin gives the launcher's container."""
    return {
        "OMPI_MCA_orte_default_hostfile": hostfile_path,
        "OMPI_MCA_orte_keep_fqdn_hostnames": "true",
        "OMPI_MCA_orte_set_default_slots": str(trainjob_mpi_slots(trainjob)),
        "OMPI_MCA_plm_rsh_args": TRAINER_RSH_ARGS,
    }


def trainjob_torch_env(trainjob: Path, node: int) -> Dict[str, str]:
    """The PET_* variables Trainer's Torch plugin gives node pod ``node``'s container
    (numProcPerNode "auto" without GPUs: the CPUs the container requests)."""
    job = load(trainjob)
    name = job["metadata"]["name"]
    per_node = job["spec"].get("trainer", {}).get("numProcPerNode")
    if per_node is None:
        cpu = _trainer_container(trainjob_runtime(trainjob)).get("resources", {}).get(
            "requests", {}).get("cpu", "1")
        per_node = max(1, int(str(cpu)))
    return {
        "PET_NNODES": str(trainjob_nodes(trainjob)),
        "PET_NPROC_PER_NODE": str(per_node),
        "PET_NODE_RANK": str(node),
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": str(TRAINER_PORT),
    }


def trainjob_command(trainjob: Path) -> List[str]:
    """What the trainer container runs: the TrainJob's command and args when it gives them,
    else the runtime container's."""
    trainer = load(trainjob)["spec"].get("trainer", {})
    if trainer.get("command"):
        return [str(a) for a in trainer["command"] + (trainer.get("args") or [])]
    return _argv(_trainer_container(trainjob_runtime(trainjob)))


# -- Kubeflow Training Operator: MXJob ---------------------------------------------------------

MXJOB = EXAMPLES / "mxjob.yaml"
DOCKERFILE_MXNET = EXAMPLES / "Dockerfile.mxnet"
MXNET_CONTAINER = "mxnet"
MXNET_PORT_NAME = "mxjob-port"


def mxjob_container(path: Path, replica_type: str) -> Dict[str, Any]:
    return _only_container(load(path), "mxReplicaSpecs", replica_type)


def mxjob_pods(path: Path) -> List[Tuple[str, int, str]]:
    """``(replica type, index, pod name)`` of every pod, as the operator names them
    (``<job>-<type>-<index>``, the type in lower case)."""
    job = load(path)
    name = job["metadata"]["name"]
    return [(rtype, i, f"{name}-{rtype.lower()}-{i}")
            for rtype, spec in job["spec"]["mxReplicaSpecs"].items()
            for i in range(int(spec.get("replicas", 1)))]


def mxjob_env(path: Path, replica_type: str, index: int) -> Dict[str, str]:
    """The environment of pod ``<job>-<type>-<index>``: the container's env, then what the
    operator appends: ``MX_CONFIG`` (every replica's ``{url, port}`` by type, this pod's type
    and index) and ``DMLC_PS_ROOT_URI``/``_PORT`` (the scheduler's), ``DMLC_NUM_SERVER``,
    ``DMLC_NUM_WORKER``, ``DMLC_ROLE`` and ``DMLC_USE_KUBERNETES``."""
    job = load(path)
    name = job["metadata"]["name"]
    cluster: Dict[str, List[Dict[str, Any]]] = {}
    for rtype, spec in job["spec"]["mxReplicaSpecs"].items():
        container = mxjob_container(path, rtype)
        port = next(p["containerPort"] for p in container["ports"]
                    if p["name"] == MXNET_PORT_NAME)
        cluster[rtype.lower()] = [{"url": f"{name}-{rtype.lower()}-{i}", "port": port}
                                  for i in range(int(spec.get("replicas", 1)))]
    config = {"cluster": cluster, "labels": {t: "" for t in cluster},
              "task": {"type": replica_type.lower(), "index": index}}
    container = mxjob_container(path, replica_type)
    env = {e["name"]: str(e.get("value", "")) for e in container.get("env", [])}
    scheduler = cluster.get("scheduler", [{"url": "", "port": 0}])[0]
    env.update({
        "MX_CONFIG": json.dumps(config),
        "DMLC_PS_ROOT_PORT": str(scheduler["port"]),
        "DMLC_PS_ROOT_URI": scheduler["url"],
        "DMLC_NUM_SERVER": str(len(cluster.get("server", []))),
        "DMLC_NUM_WORKER": str(len(cluster.get("worker", []))),
        "DMLC_ROLE": replica_type.lower(),
        "DMLC_USE_KUBERNETES": "1",
    })
    return env
