"""The Kubernetes examples agree with each other, with the image and with the real launchers.

No cluster is needed: the manifests are read as YAML (through ``kube_examples``), the launcher
commands are parsed by ferrovodrun's and torchrun's own argument parsers, Open MPI's mpirun
maps the mpirun variant's ranks (without launching them) under the MPI operator's environment,
and sshd/ssh evaluate the configuration the Dockerfile writes. Each check fails when one file
is edited and another that depends on it is not.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

import kube_examples as kx
from capabilities import SSHD, mpirun_missing, private_run_missing

MPIJOBS = (kx.MPIJOB_FERROVODRUN, kx.MPIJOB_MPIRUN, kx.MPIJOB_ELASTIC)
README = kx.EXAMPLES / "README.md"


# -- reading the Dockerfile -----------------------------------------------------------------


def _dockerfile_instructions() -> List[Tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: List[Tuple[str, str]] = []
    pending = ""
    for raw in kx.DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def _copies() -> List[Tuple[str, str]]:
    """(source in the build context, destination in the image) of every COPY."""
    pairs = []
    for word, rest in _dockerfile_instructions():
        if word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            assert len(parts) == 2, f"COPY with one source expected: {rest}"
            pairs.append((parts[0], parts[1]))
    return pairs


def _image_path_to_repo(image_path: str) -> Path:
    """The repository file a path inside the image comes from, through the COPY lines."""
    for src, dest in _copies():
        if image_path.startswith(dest.rstrip("/") + "/"):
            return kx.REPO / src.rstrip("/") / image_path[len(dest.rstrip("/")) + 1 :]
    raise AssertionError(f"{image_path} is not copied into the image by any COPY line")


def _config_lines(target: str) -> List[str]:
    """The lines the Dockerfile writes (printf '%s\\n' ... > target) into an ssh config file."""
    for word, rest in _dockerfile_instructions():
        if word != "RUN":
            continue
        for command in re.split(r"&&", rest):
            words = shlex.split(command)
            if words[:2] == ["printf", "%s\\n"] and ">" in words and words[-1] == target:
                return words[2 : words.index(">")]
    raise AssertionError(f"the Dockerfile writes no {target}")


SSHD_DROPIN = "/etc/ssh/sshd_config.d/ferrovod.conf"
SSH_DROPIN = "/etc/ssh/ssh_config.d/ferrovod.conf"


def _option(lines: List[str], key: str) -> str:
    values = [line.split(None, 1)[1] for line in lines if line.split(None, 1)[0].lower() == key]
    assert len(values) == 1, f"{key} set {len(values)} times in {lines}"
    return values[0]


def _sshd_port() -> int:
    return int(_option(_config_lines(SSHD_DROPIN), "port"))


# -- the manifests ---------------------------------------------------------------------------


def test_manifests_are_the_expected_kinds() -> None:
    kinds = {p.name: (kx.load(p)["apiVersion"], kx.load(p)["kind"]) for p in kx.MANIFESTS}
    assert kinds == {
        "mpijob-ferrovodrun.yaml": ("kubeflow.org/v2beta1", "MPIJob"),
        "mpijob-mpirun.yaml": ("kubeflow.org/v2beta1", "MPIJob"),
        "mpijob-elastic.yaml": ("kubeflow.org/v2beta1", "MPIJob"),
        "pytorchjob.yaml": ("kubeflow.org/v1", "PyTorchJob"),
        "pytorchjob-ddp.yaml": ("kubeflow.org/v1", "PyTorchJob"),
    }
    names = [kx.load(p)["metadata"]["name"] for p in kx.MANIFESTS]
    assert len(set(names)) == len(names), f"jobs would replace each other: {names}"
    for name in names:
        # Job names become host names (<job>-worker-0.<job>...): DNS-1123 labels, short.
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 40, name


def _all_containers(path: Path) -> List[dict]:
    job = kx.load(path)
    if job["kind"] == "ClusterTrainingRuntime":
        return [c for r in job["spec"]["template"]["spec"]["replicatedJobs"]
                for c in r["template"]["spec"]["template"]["spec"]["containers"]]
    key = "mpiReplicaSpecs" if job["kind"] == "MPIJob" else "pytorchReplicaSpecs"
    return [c for r in job["spec"][key].values() for c in r["template"]["spec"]["containers"]]


def test_trainer_manifests_are_runtimes_and_trainjobs_that_find_them() -> None:
    kinds = {p.name: (kx.load(p)["apiVersion"], kx.load(p)["kind"]) for p in kx.TRAINER_MANIFESTS}
    assert kinds == {
        "trainer-runtime-mpi.yaml": ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"),
        "trainer-runtime-torch.yaml": ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"),
        "trainjob-mpi.yaml": ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
        "trainjob-torch.yaml": ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
        "trainjob-torch-python.yaml": ("trainer.kubeflow.org/v1alpha1", "TrainJob"),
    }
    names = [kx.load(p)["metadata"]["name"] for p in kx.TRAINJOBS]
    assert len(set(names)) == len(names), names
    for path in kx.TRAINJOBS:
        kx.trainjob_runtime(path)  # raises when the runtimeRef names no example runtime
        # Pod host names are <trainjob>-node-0-<i>.<trainjob>: DNS-1123 labels, short.
        assert len(kx.trainjob_pod_hosts(path)[-1].split(".")[0]) <= 63, path.name
    mpi = kx.load(kx.TRAINER_RUNTIME_MPI)["spec"]["mlPolicy"]["mpi"]
    assert mpi["sshAuthMountPath"] == "/root/.ssh" and mpi["mpiImplementation"] == "OpenMPI"
    # ferrovodrun's -np is every slot of the hostfile Trainer writes.
    argv = kx.trainjob_command(kx.TRAINJOB_MPI)
    np_ = int(argv[argv.index("-np") + 1])
    assert np_ == kx.trainjob_mpi_slots(kx.TRAINJOB_MPI) * kx.trainjob_nodes(kx.TRAINJOB_MPI)
    # One process per pod without torchrun (ferrovod refuses more there).
    assert kx.trainjob_torch_env(kx.TRAINJOB_TORCH_PYTHON, 0)["PET_NPROC_PER_NODE"] == "1"


def test_every_pod_runs_the_one_image_the_readme_builds() -> None:
    images = {c["image"] for p in kx.MANIFESTS + kx.TRAINER_RUNTIMES for c in _all_containers(p)}
    assert len(images) == 1, f"the examples share one image, found {images}"
    image = images.pop()
    readme = README.read_text()
    assert f"-t {image} " in readme, f"README's docker build does not tag {image}"


def test_mpijobs_ssh_as_root_with_the_keys_the_image_accepts() -> None:
    sshd = _config_lines(SSHD_DROPIN)
    assert _option(sshd, "permitrootlogin") == "prohibit-password"
    assert _option(sshd, "passwordauthentication") == "no"
    # The Secret mount is read-only and its modes are not sshd's to check.
    assert _option(sshd, "strictmodes") == "no"
    ssh = _config_lines(SSH_DROPIN)
    assert _option(ssh, "userknownhostsfile") == "/dev/null"
    assert _option(ssh, "stricthostkeychecking") == "no"
    for path in MPIJOBS:
        spec = kx.load(path)["spec"]
        # Root login: the keys must be root's, which also gets them mode 0600 from the operator.
        assert spec["sshAuthMountPath"] == "/root/.ssh", path.name
        assert spec.get("mpiImplementation", "OpenMPI") == "OpenMPI", path.name
        assert spec["launcherCreationPolicy"] == "WaitForWorkersReady", path.name
        for container in _all_containers(path):
            user = (container.get("securityContext") or {}).get("runAsUser", 0)
            assert user == 0, f"{path.name}: {container['name']} runs as uid {user}, not root"


def test_ssh_port_agrees_everywhere() -> None:
    port = _sshd_port()
    assert int(_option(_config_lines(SSH_DROPIN), "port")) == port, "ssh_config and sshd_config"
    exposed = [
        w for word, rest in _dockerfile_instructions() if word == "EXPOSE" for w in rest.split()
    ]
    assert str(port) in exposed
    for path in MPIJOBS:
        worker = kx.mpijob_container(path, "Worker")
        assert worker["readinessProbe"]["tcpSocket"]["port"] == port, path.name
        assert [p["containerPort"] for p in worker["ports"]] == [port], path.name
    args = _ferrovodrun_args()
    assert args.ssh_port == port, "ferrovodrun -p differs from the workers' sshd port"


def test_mpijob_workers_run_sshd_in_the_foreground() -> None:
    for path in MPIJOBS:
        argv = kx.worker_command(path)
        assert argv[0] == "/usr/sbin/sshd", path.name
        assert "-D" in argv or any(a.startswith("-") and "D" in a for a in argv[1:]), path.name


def test_commands_run_files_the_image_really_has() -> None:
    runs = kx.launcher_command(kx.MPIJOB_FERROVODRUN) + kx.launcher_command(kx.MPIJOB_MPIRUN)
    for job in kx.PYTORCHJOBS:
        runs += kx.pytorchjob_container(job, "Master")["command"]
        runs += kx.pytorchjob_container(job, "Worker")["command"]
    for trainjob in kx.TRAINJOBS:
        runs += kx.trainjob_command(trainjob)
    in_image = sorted({a for a in runs if a.startswith("/opt/")})
    assert in_image == ["/opt/ferrovod/examples/pytorch_ddp_digits.py",
                        "/opt/ferrovod/examples/pytorch_digits.py"]
    for image_path in in_image:
        source = _image_path_to_repo(image_path)
        assert source.is_file(), f"{image_path} would come from {source}, which does not exist"
        assert _context_keeps(source.relative_to(kx.REPO).as_posix()), f"{source} is dockerignored"


def test_the_wheel_copy_matches_what_make_wheel_builds() -> None:
    pyproject = (kx.REPO / "pyproject.toml").read_text()
    project = dict(re.findall(r'^(name|version) = "([^"]+)"', pyproject, re.M))
    # The image's ferrovodrun is the wheel's console script.
    assert re.search(r'^ferrovodrun = "ferrovod\.runner\.launch:main"', pyproject, re.M)
    wheel_sources = [src for src, _ in _copies() if src.endswith(".whl")]
    assert wheel_sources == ["dist/ferrovod-*.whl"]
    # The name `make wheel` gives it: the stable ABI's floor (pyo3's abi3-pyXY feature) and
    # both of maturin's platform tags, as test_wheel.py checks on the built wheel.
    floor = re.search(r'"abi3-py(\d+)"', (kx.REPO / "Cargo.toml").read_text()).group(1)
    built = (f"dist/{project['name']}-{project['version']}-cp{floor}-abi3-"
             "manylinux2014_x86_64.manylinux_2_17_x86_64.whl")
    assert fnmatch.fnmatch(built, wheel_sources[0])
    assert _context_keeps(built)
    # The ignore file must keep the context small and the COPY sources in it.
    for heavy in ("target/release/libferrovod.rlib", ".venv/bin/python", ".git/HEAD", "src/lib.rs"):
        assert not _context_keeps(heavy), f"{heavy} would be sent to the builder"


def _context_keeps(path: str) -> bool:
    """Whether Docker's ignore rules (last match wins; a match on a directory covers what is
    inside it) keep ``path`` in the build context."""
    keep = True
    for raw in kx.DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        wildcards = {"**": ".*", "*": "[^/]*", "?": "[^/]"}
        regex = "".join(
            wildcards.get(part, re.escape(part))
            for part in re.split(r"(\*\*|\*|\?)", pattern.strip("/"))
        )
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(re.fullmatch(regex, p) for p in prefixes):
            keep = negate
    return keep


def test_dockerfile_pins_an_open_mpi_that_reads_the_operators_variables() -> None:
    # Open MPI 5 (Debian 13) ignores OMPI_MCA_orte_default_hostfile: mpirun would then start
    # every rank on the launcher. bookworm ships 4.1.
    bases = [rest for word, rest in _dockerfile_instructions() if word == "FROM"]
    assert bases == ["python:3.11-slim-bookworm"]


# -- ferrovodrun launcher ----------------------------------------------------------------------


def _ferrovodrun_args():
    from ferrovod.runner.launch import build_parser

    argv = kx.launcher_command(kx.MPIJOB_FERROVODRUN)
    assert argv[0] == "ferrovodrun"
    return build_parser().parse_args(argv[1:])


def test_ferrovodrun_launcher_places_two_ranks_on_each_worker() -> None:
    from ferrovod.runner.hosts import get_host_assignments, parse_hostfile_text

    args = _ferrovodrun_args()
    assert args.command == ["python", "/opt/ferrovod/examples/pytorch_digits.py"]
    assert args.hostfile == kx.MPI_HOSTFILE
    assert args.hosts is None
    hosts = kx.mpijob_worker_hosts(kx.MPIJOB_FERROVODRUN, "team-a")
    slots = kx.mpijob_slots(kx.MPIJOB_FERROVODRUN)
    assert args.num_proc == len(hosts) * slots, "-np must fill every slot of every worker"
    placed = get_host_assignments(
        parse_hostfile_text(kx.mpijob_hostfile(kx.MPIJOB_FERROVODRUN, "team-a")),
        args.num_proc,
        args.num_proc,
    )
    assert [(s.rank, s.hostname, s.local_rank) for s in placed] == [
        (0, "ferrovod-digits-worker-0.ferrovod-digits.team-a.svc", 0),
        (1, "ferrovod-digits-worker-0.ferrovod-digits.team-a.svc", 1),
        (2, "ferrovod-digits-worker-1.ferrovod-digits.team-a.svc", 0),
        (3, "ferrovod-digits-worker-1.ferrovod-digits.team-a.svc", 1),
    ]


# -- mpirun launcher -----------------------------------------------------------------------


def test_mpirun_launcher_is_plain_open_mpi() -> None:
    argv = kx.launcher_command(kx.MPIJOB_MPIRUN)
    assert argv[0] == "mpirun" and "ferrovodrun" not in argv
    assert "--allow-run-as-root" in argv  # the image runs as root
    assert argv[argv.index("-np") + 1] == str(
        len(kx.mpijob_worker_hosts(kx.MPIJOB_MPIRUN)) * kx.mpijob_slots(kx.MPIJOB_MPIRUN)
    )
    # Hosts come from the operator's environment; a -H or another hostfile would override it.
    assert not {"-H", "-host", "--host", "-hostfile", "--hostfile"} & set(argv)
    assert argv[-2:] == ["python", "/opt/ferrovod/examples/pytorch_digits.py"]
    # The workers have mpi4py, which ferrovod needs to learn a rendezvous address under mpirun.
    runs = [rest for word, rest in _dockerfile_instructions() if word == "RUN"]
    assert any("pip install" in run and "mpi4py" in run for run in runs)


def _display_map(argv: List[str], env: Dict[str, str]) -> Dict[int, str]:
    """rank -> host as Open MPI's mpirun maps ``argv`` without launching anything."""
    prog = argv.index("python")
    dry = argv[:prog] + ["--do-not-launch", "--display-map"] + argv[prog:]
    proc = subprocess.run(dry, env=env, capture_output=True, text=True, timeout=60)
    placed: Dict[int, str] = {}
    node = None
    for line in (proc.stdout + proc.stderr).splitlines():
        m = re.search(r"Data for node: (\S+)", line)
        if m:
            node = m.group(1)
        m = re.search(r"Process rank: (\d+)", line)
        if m:
            placed[int(m.group(1))] = node
    assert placed, f"mpirun printed no map (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return placed


@pytest.mark.skipif(mpirun_missing() is not None, reason=str(mpirun_missing()))
def test_mpirun_launcher_maps_ranks_to_the_workers_under_the_operators_environment(
    tmp_path: Path,
) -> None:
    from ferrovod.runner.hosts import get_host_assignments, parse_hostfile_text

    hostfile_text = kx.mpijob_hostfile(kx.MPIJOB_MPIRUN, "team-a")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(hostfile_text)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env = {**base, **kx.mpijob_launcher_env(kx.MPIJOB_MPIRUN, str(hostfile))}
    argv = kx.launcher_command(kx.MPIJOB_MPIRUN)
    placed = _display_map(argv, env)
    # Independently: ferrovodrun's assignment of the same hostfile, horovodrun's rule.
    np = int(argv[argv.index("-np") + 1])
    slots = get_host_assignments(parse_hostfile_text(hostfile_text), np, np)
    assert placed == {s.rank: s.hostname for s in slots}
    workers = kx.mpijob_worker_hosts(kx.MPIJOB_MPIRUN, "team-a")
    assert Counter(placed.values()) == {h: kx.mpijob_slots(kx.MPIJOB_MPIRUN) for h in workers}


# -- PyTorchJob -------------------------------------------------------------------------------


@pytest.mark.parametrize("job", kx.PYTORCHJOBS, ids=lambda p: p.name)
def test_pytorchjob_containers_are_named_pytorch_and_declare_the_ports(job: Path) -> None:
    master = kx.pytorchjob_container(job, "Master")
    worker = kx.pytorchjob_container(job, "Worker")
    assert master["name"] == worker["name"] == kx.PYTORCH_CONTAINER
    ports = {p["name"]: p["containerPort"] for p in master["ports"]}
    # Only torchrun's: ferrovod's store and links use free ports agreed at start-up, which
    # pods reach directly (a headless Service filters no port).
    assert list(ports) == [kx.PYTORCH_PORT_NAME]
    assert master["command"] == worker["command"]


@pytest.mark.parametrize("path, script", [(kx.PYTORCHJOB, "pytorch_digits.py"),
                                          (kx.PYTORCHJOB_DDP, "pytorch_ddp_digits.py")],
                         ids=lambda v: v.name if isinstance(v, Path) else None)
def test_pytorchjob_pods_run_torchrun_with_one_rank_per_process(path: Path, script: str) -> None:
    from torch.distributed.run import get_args_parser

    job = kx.load(path)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    nproc = int(job["spec"]["nprocPerNode"])
    pods = [(t, i) for t in ("Master", "Worker") for i in range(int(replicas[t]["replicas"]))]
    ranks = []
    for replica_type, index in pods:
        env = kx.pytorchjob_env(path, replica_type, index)
        argv = kx.pytorchjob_argv(path, replica_type, index)
        assert not any("$(" in a for a in argv), f"unexpanded variable in {argv}"
        assert argv[0] == "torchrun"
        args = get_args_parser().parse_args(argv[1:])
        assert int(args.nproc_per_node) == nproc, "--nproc_per_node differs from nprocPerNode"
        assert int(args.nnodes) == len(pods) == int(env["PET_NNODES"])
        # RANK is the node rank under a PyTorchJob; torchrun turns it into process ranks.
        assert args.node_rank == int(env["RANK"])
        assert (args.master_addr, args.master_port) == (
            f"{job['metadata']['name']}-master-0",
            kx._pytorch_master_port(job),
        )
        assert args.training_script == f"/opt/ferrovod/examples/{script}"
        assert _image_path_to_repo(args.training_script).is_file()
        ranks += [args.node_rank * nproc + local for local in range(nproc)]
    world = int(kx.pytorchjob_env(path, "Master", 0)["WORLD_SIZE"])
    assert sorted(ranks) == list(range(world)), f"process ranks {ranks} for WORLD_SIZE {world}"


def test_k8s_expansion_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "x y"}
    assert kx.expand_k8s_vars("--n=$(A)", env) == "--n=1"
    assert kx.expand_k8s_vars("$(B)$(A)", env) == "x y1"
    assert kx.expand_k8s_vars("$(MISSING)", env) == "$(MISSING)"
    assert kx.expand_k8s_vars("$$(A)", env) == "$(A)"
    assert kx.expand_k8s_vars("$A $(A", env) == "$A $(A"


# -- the image's ssh configuration, as sshd and ssh read it -----------------------------------


@pytest.mark.skipif(
    not (os.access(SSHD, os.X_OK) and shutil.which("ssh") and shutil.which("ssh-keygen")),
    reason="needs openssh-server and openssh-client (sshd, ssh, ssh-keygen), which are not all "
           "installed (make test installs them as root with scripts/system_deps.sh)",
)
def test_ssh_settings_override_debian_defaults(tmp_path: Path) -> None:
    # The image's main files Include the drop-ins first; later defaults must not win.
    (tmp_path / "sshd.d").mkdir()
    (tmp_path / "sshd.d" / "ferrovod.conf").write_text("\n".join(_config_lines(SSHD_DROPIN)) + "\n")
    (tmp_path / "sshd_config").write_text(
        f"Include {tmp_path}/sshd.d/*.conf\nPort 22\nUsePAM yes\nStrictModes yes\n"
        "PasswordAuthentication yes\nPermitRootLogin yes\n"
    )
    (tmp_path / "ssh.d").mkdir()
    (tmp_path / "ssh.d" / "ferrovod.conf").write_text("\n".join(_config_lines(SSH_DROPIN)) + "\n")
    (tmp_path / "ssh_config").write_text(
        f"Include {tmp_path}/ssh.d/*.conf\nHost *\n    StrictHostKeyChecking ask\n    Port 22\n"
    )
    key = tmp_path / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    sshd_t = [SSHD, "-T", "-f", str(tmp_path / "sshd_config"), "-h", str(key)]
    if not os.path.isdir("/run/sshd"):
        # sshd insists on its privilege-separation directory (the image creates it): give it
        # one on a private /run rather than touching this machine's.
        if private_run_missing():
            pytest.skip(f"/run/sshd is missing, and {private_run_missing()}")
        sshd_t = ["unshare", "--mount", "sh", "-c",
                  'mount -t tmpfs tmpfs /run && mkdir /run/sshd && exec "$@"', "sh", *sshd_t]
    sshd = subprocess.run(sshd_t, capture_output=True, text=True, timeout=30)
    assert sshd.returncode == 0, sshd.stderr
    effective = set(sshd.stdout.splitlines())
    port = _sshd_port()
    assert {f"port {port}", "strictmodes no", "usepam no", "passwordauthentication no"} <= effective
    assert effective & {"permitrootlogin prohibit-password", "permitrootlogin without-password"}
    ssh = subprocess.run(
        ["ssh", "-G", "-F", str(tmp_path / "ssh_config"), "ferrovod-digits-worker-0"],
        capture_output=True, text=True, timeout=30,
    )
    assert ssh.returncode == 0, ssh.stderr
    client = set(ssh.stdout.splitlines())
    assert {f"port {port}", "stricthostkeychecking false", "userknownhostsfile /dev/null",
            "batchmode yes"} <= client


# -- the guide -------------------------------------------------------------------------------


def test_readme_build_command_and_files_match() -> None:
    readme = README.read_text()
    header = kx.DOCKERFILE.read_text()
    build = re.search(r"docker build -f (\S+) -t \S+ \.", header)
    assert build and build.group(1) == "examples/kubernetes/Dockerfile"
    assert re.search(rf"docker build -f {re.escape(build.group(1))} -t \S+ \.", readme)
    for path in kx.MANIFESTS:
        assert f"examples/kubernetes/{path.name}" in readme, f"README does not apply {path.name}"


# -- MXJob ---------------------------------------------------------------------------------------


def test_mxjob_runs_one_command_in_the_mxnet_image() -> None:
    job = kx.load(kx.MXJOB)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "MXJob")
    assert job["spec"]["jobMode"] == "MXTrain"
    replicas = job["spec"]["mxReplicaSpecs"]
    assert set(replicas) == {"Scheduler", "Server", "Worker"}
    containers = [kx.mxjob_container(kx.MXJOB, t) for t in replicas]
    # The operator reads the port of the container named "mxnet", port name "mxjob-port".
    for c in containers:
        assert c["name"] == kx.MXNET_CONTAINER
        assert [p["name"] for p in c["ports"]] == [kx.MXNET_PORT_NAME]
    assert {tuple(c["command"]) for c in containers} == {
        ("python", "/opt/ferrovod/examples/mxnet_digits.py")}
    images = {c["image"] for c in containers}
    assert len(images) == 1, images
    image = images.pop()
    build = f"docker build -f examples/kubernetes/Dockerfile.mxnet -t {image} ."
    assert build in kx.MXJOB.read_text() and build in (kx.EXAMPLES / "README.md").read_text()
    # The image holds the example and the versions the tests run with.
    docker = kx.DOCKERFILE_MXNET.read_text()
    assert "COPY examples/ /opt/ferrovod/examples/" in docker
    setup = (kx.REPO / "scripts" / "setup_mxnet_venv.sh").read_text()
    for pin in ("mxnet==1.9.1", "numpy==1.23.5", "scikit-learn==1.3.2", "scipy==1.11.4"):
        assert pin in docker and pin in setup, pin
    # Scheduler and server pods end in `import ferrovod.mxnet`, before MXNet would start them.
    script = (kx.REPO / "examples" / "mxnet_digits.py").read_text()
    assert script.index("import ferrovod.mxnet") < script.index("import mxnet")
