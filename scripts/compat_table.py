"""Writes ``docs/horovod_compat.md``: every public name of Horovod 0.28.1's Python modules, every
``horovodrun`` flag and every ``HOROVOD_*`` variable, with what ferrovod does with it. Computed
from ferrovod's own code (its modules, ``ferrovodrun``'s parser, the engine's variables table),
so the table cannot drift from what ferrovod does.

Horovod's side is the list in ``scripts/horovod_api.py``, extracted from a snapshot of Horovod's
repository by ``--extract`` (the names only, never its code). A Horovod name that ferrovod
neither provides nor lists below with a reason makes ``--check`` fail (the test suite runs
it), as does a table that is out of date.

Usage: ``python scripts/compat_table.py`` rewrites the document; ``--check`` exits 1 when it is
out of date or a name is unaccounted for; ``--extract HOROVOD_REPO [REF]`` rewrites
``scripts/horovod_api.py`` from a Horovod checkout or bare repository.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import pathlib
import subprocess
import sys
from typing import Dict, List, Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # ferrovod.tensorflow imports TensorFlow

HERE = pathlib.Path(__file__).resolve().parent
DOC = HERE.parent / "docs" / "horovod_compat.md"
API = HERE / "horovod_api.py"

# Horovod module -> the ferrovod module that stands for it.
MODULES = {
    "horovod": "ferrovod",
    "horovod.runner": "ferrovod.runner",
    "horovod.torch": "ferrovod.torch",
    "horovod.torch.elastic": "ferrovod.torch.elastic",
    "horovod.tensorflow": "ferrovod.tensorflow",
    "horovod.tensorflow.elastic": "ferrovod.tensorflow.elastic",
    "horovod.tensorflow.keras": "ferrovod.tensorflow.keras",
    "horovod.tensorflow.keras.callbacks": "ferrovod.tensorflow.keras.callbacks",
    "horovod.tensorflow.keras.elastic": "ferrovod.tensorflow.keras.elastic",
    "horovod.keras": "ferrovod.keras",
    "horovod.keras.callbacks": "ferrovod.keras.callbacks",
    "horovod.keras.elastic": "ferrovod.keras.elastic",
    "horovod.common.exceptions": "ferrovod.common.exceptions",
    "horovod.data": "ferrovod.data",
    "horovod.ray": "ferrovod.ray",
    "horovod.spark": "ferrovod.spark",
}
_SOURCES = {
    "horovod": "horovod/__init__.py",
    "horovod.runner": "horovod/runner/__init__.py",
    "horovod.torch": "horovod/torch/__init__.py",
    "horovod.torch.elastic": "horovod/torch/elastic/__init__.py",
    "horovod.tensorflow": "horovod/tensorflow/__init__.py",
    "horovod.tensorflow.elastic": "horovod/tensorflow/elastic.py",
    "horovod.tensorflow.keras": "horovod/tensorflow/keras/__init__.py",
    "horovod.tensorflow.keras.callbacks": "horovod/tensorflow/keras/callbacks.py",
    "horovod.tensorflow.keras.elastic": "horovod/tensorflow/keras/elastic.py",
    "horovod.keras": "horovod/keras/__init__.py",
    "horovod.keras.callbacks": "horovod/keras/callbacks.py",
    "horovod.keras.elastic": "horovod/keras/elastic.py",
    "horovod.common.exceptions": "horovod/common/exceptions.py",
    "horovod.data": "horovod/data/__init__.py",
    "horovod.ray": "horovod/ray/__init__.py",
    "horovod.spark": "horovod/spark/__init__.py",
}

# -- what ferrovod does not provide, and why -------------------------------------------------

_HELPER = "Horovod's internal helper, reachable only because its module imports it"
NAMES_NOT_PROVIDED: Dict[Tuple[str, str], str] = {
    ("horovod.torch", "check_extension"): _HELPER + " (checks its compiled extension; ferrovod "
                                          "has none per framework)",
    ("horovod.tensorflow", "check_extension"): _HELPER + " (checks its compiled extension)",
    ("horovod.tensorflow", "split_list"): _HELPER,
    ("horovod.tensorflow", "gpu_available"): _HELPER,
    ("horovod.tensorflow", "handle_average_backwards_compatibility"): _HELPER,
    ("horovod.tensorflow", "check_num_rank_power_of_2"): _HELPER + " (for Adasum)",
    ("horovod.tensorflow", "vars_to_refs"): _HELPER,
    ("horovod.tensorflow", "refs_to_vars"): _HELPER,
    ("horovod.tensorflow", "broadcast_object_fn"): _HELPER,
    ("horovod.tensorflow.elastic", "broadcast_object_fn"): _HELPER,
    ("horovod.tensorflow.keras", "is_version_greater_equal_than"): _HELPER,
    ("horovod.tensorflow.keras.callbacks", "is_version_greater_equal_than"): _HELPER,
    ("horovod.common.exceptions", "get_version_mismatch_message"): _HELPER + " (the message "
        "of HorovodVersionMismatchError, which ferrovod's builds itself)",
    ("horovod.torch.elastic", "run_fn"): _HELPER + " (ferrovod's is ferrovod.common.elastic.run_fn)",
    ("horovod.tensorflow.elastic", "run_fn"): _HELPER + " (ferrovod's is "
                                              "ferrovod.common.elastic.run_fn)",
    ("horovod.ray", "BaseHorovodWorker"): "the executor's actor class; ferrovod's is private "
                                          "(state of your own goes in start()'s executable_cls)",
}

FLAGS_NOT_PROVIDED: Dict[str, str] = {}

# HOROVOD_* variables that are not an alias in the engine's variables table.
VARIABLES: Dict[str, str] = {
    "HOROVOD_RANK": "set by ferrovodrun for every worker, with HOROVOD_SIZE, _LOCAL_RANK, "
                    "_LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE and _HOSTNAME (as horovodrun does); "
                    "read as the launch environment of workers started by hand",
    "HOROVOD_SIZE": "as HOROVOD_RANK",
    "HOROVOD_LOCAL_RANK": "as HOROVOD_RANK",
    "HOROVOD_LOCAL_SIZE": "as HOROVOD_RANK",
    "HOROVOD_CROSS_RANK": "as HOROVOD_RANK",
    "HOROVOD_CROSS_SIZE": "as HOROVOD_RANK",
    "HOROVOD_HOSTNAME": "set by ferrovodrun for every worker (its host's name, the elastic key)",
    "HOROVOD_CONTROLLER": "ignored: ferrovod has one controller (its own coordinator over TCP)",
    "HOROVOD_CPU_OPERATIONS": "ignored: ferrovod has one CPU data plane (its own rings over TCP "
                              "and shared memory)",
    "HOROVOD_MPI_THREADS_DISABLE": "ignored: ferrovod does not run on MPI",
    "HOROVOD_ADASUM_MPI_CHUNK_SIZE": "ignored: ferrovod does not run on MPI",
    "HOROVOD_CCL_CACHE": "ignored: no oneCCL backend",
    "HOROVOD_DISABLE_NVTX_RANGES": "ignored: no NVTX ranges",
    "HOROVOD_BATCH_D2D_MEMCOPIES": "ignored: device copies into the fusion buffer are not batched",
    "HOROVOD_ENABLE_XLA_OPS": "ignored: no XLA custom-call ops; TensorFlow ops run as host ops",
    "HOROVOD_ENABLE_ASYNC_COMPLETION": "ignored: GPU ops complete on the framework's stream "
                                       "(an event), without the host blocking",
    "HOROVOD_NUM_NCCL_STREAMS": "ignored: one NCCL communicator per process set",
    "HOROVOD_THREAD_AFFINITY": "ignored: the engine thread is not pinned alone; "
                               "`ferrovodrun --bind-cores` binds each whole worker to its "
                               "share of the cores",
    "HOROVOD_DISABLE_GROUP_FUSION": "ignored: a group is fused only with itself already",
    "HOROVOD_TORUS_ALLREDUCE": "ignored: no torus allreduce (FERROVOD_HIERARCHICAL_ALLREDUCE "
                               "covers hosts)",
    "HOROVOD_HIERARCHICAL_ALLGATHER": "ignored: allgather is flat",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR": "read: workers started by hand with Horovod's variables "
                                    "(no FERROVOD_RENDEZVOUS_ADDR) meet at ADDR:PORT, where rank 0 "
                                    "hosts the store",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "as HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "ignored: ferrovod's autotuner does not use "
                                              "Bayesian optimisation (see FERROVOD_AUTOTUNE)",
    "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "as HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES",
    "HOROVOD_WITH_GLOO": "a variable of Horovod's build (pip install compiles it); ferrovod's "
                         "one wheel is built once, with everything",
    "HOROVOD_WITH_MPI": "as HOROVOD_WITH_GLOO",
    "HOROVOD_SPARK_PYTHONPATH": "not read: ferrovod.spark's ranks inherit their executor's "
                                "environment, PYTHONPATH included",
    "HOROVOD_SPARK_USE_LOCAL_RANK_GPU_INDEX": "not read: ferrovod.spark's ranks see their "
                                              "executor's GPUs as Spark leaves them and pick "
                                              "theirs (e.g. by local rank)",
    "HOROVOD_SPARK_WORK_DIR": "no Spark integration",
}


# -- prose ---------------------------------------------------------------------------------

# How code that cannot be edited gets ferrovod for `import horovod`
# (python/_ferrovod_as_horovod.py).
ALIAS_SECTION = """\
## Code that imports horovod itself

For code that imports Horovod and that you cannot edit (a library doing `import horovod.torch`,
a vendored training script, Horovod's own tests), set `FERROVOD_AS_HOROVOD=1` in the
environment of every process, or launch with `ferrovodrun --as-horovod`, which sets it for every
worker, those started over ssh included:

```sh
ferrovodrun -np 4 --as-horovod python train.py   # train.py: import horovod.torch as hvd
FERROVOD_AS_HOROVOD=1 python train.py            # any value but empty, 0 or false
```

**What it maps.** Every module name `horovod[.X.Y]` to `ferrovod[.X.Y]`: `horovod`,
`horovod.torch`, `horovod.tensorflow`, `horovod.tensorflow.keras`, `horovod.keras`,
`horovod.mxnet`, `horovod.ray`, `horovod.spark`, `horovod.runner`, `horovod.common.util`, ...
The module is the very same object (`horovod.torch is ferrovod.torch`, one entry in
`sys.modules` under both names), and keeps its own name, `ferrovod.torch`. Which names each
module has is in the tables below. A `horovod.X` that ferrovod lacks fails with
`ModuleNotFoundError: No module named 'horovod.foo': FERROVOD_AS_HOROVOD maps horovod.* to
ferrovod.*, and ferrovod has no 'ferrovod.foo'`. `python -m horovod.runner.launch` runs
ferrovodrun; there is no `horovodrun` command.

**How.** The wheel installs `ferrovod_as_horovod.pth` into site-packages, whose one line Python
runs at every start-up: it reads the variable and, only when it is set, puts an import hook
(the module `_ferrovod_as_horovod`) on `sys.meta_path`. ferrovod itself is imported only when
the code imports horovod. Without the variable nothing changes: `import horovod` fails as it
did. As the hook is installed at start-up, the variable must be in the process's environment
when Python starts; setting `os.environ` inside the script is too late (call
`import _ferrovod_as_horovod; _ferrovod_as_horovod.install()` there, or under `python -S`, which
runs no .pth file). `maturin develop` does not install the .pth; `scripts/setup_venv.sh`
copies it into the project's venv.

**When Horovod is installed.** Where `import horovod` would find a Horovod of its own (installed
beside ferrovod, or on `PYTHONPATH`), the variable changes nothing: that Horovod is imported, and
the first `import horovod` prints one line on stderr, ``ferrovod: FERROVOD_AS_HOROVOD is set
but Horovod itself is installed at <path>; leaving `import horovod` to it``. Uninstall Horovod,
or use an environment without it, to run the code on ferrovod.

**Other launchers.** Under `mpirun`, `torchrun`, Slurm or Kubernetes, put the variable in the
environment the launcher starts every worker with: `mpirun -x FERROVOD_AS_HOROVOD=1 ...` (Open
MPI; MPICH and Intel MPI: `-genv FERROVOD_AS_HOROVOD 1`), `FERROVOD_AS_HOROVOD=1 torchrun ...` or
`srun` (their workers inherit their environment), and on Kubernetes an `env` entry
(`name: FERROVOD_AS_HOROVOD`, `value: "1"`) in the container of each pod that runs the training
script (a PyTorchJob's master and workers). An MPIJob's workers are started by the launcher
pod's mpirun, not by their pods' command: pass it with `mpirun -x FERROVOD_AS_HOROVOD=1` there,
or run `ferrovodrun --as-horovod` in the launcher pod.
"""


# -- extraction from Horovod's sources -------------------------------------------------------


def _module_names(source: str) -> List[str]:
    """Public names a Horovod module defines or imports from Horovod at module level (also
    inside if/try blocks, as its framework modules guard their imports)."""
    out: List[str] = []

    def visit(body: list) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(
                    "horovod")):
                out.extend(a.asname or a.name for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                out.append(node.name)
            elif isinstance(node, ast.Assign):
                out.extend(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(source).body)
    return list(dict.fromkeys(n for n in out if not n.startswith("_")))


def _flags(source: str) -> List[str]:
    """Every option string horovodrun's parser declares."""
    flags: List[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags.extend(a.value for a in node.args if isinstance(a, ast.Constant)
                         and isinstance(a.value, str) and a.value.startswith("-"))
    return flags


def extract(repo: str, ref: str) -> str:
    def show(path: str) -> str:
        return subprocess.run(["git", "-C", repo, "show", f"{ref}:{path}"], check=True,
                              capture_output=True, text=True).stdout

    import re

    names = {mod: _module_names(show(path)) for mod, path in _SOURCES.items()}
    flags = _flags(show("horovod/runner/launch.py"))
    variables = set(re.findall(r'"(HOROVOD_[A-Z0-9_]+)"', show("horovod/common/common.h")))
    for path in ("horovod/runner/gloo_run.py", "horovod/runner/common/util/config_parser.py",
                 "horovod/runner/elastic/driver.py", "horovod/runner/util/network.py",
                 "horovod/runner/common/util/settings.py", "horovod/spark/runner.py",
                 "horovod/runner/launch.py"):
        variables |= set(re.findall(r"\b(HOROVOD_[A-Z0-9_]+)\b", show(path)))
    variables = {v for v in variables if not v.endswith("_")}
    lines = ['"""Horovod 0.28.1\'s public Python names, horovodrun flags and HOROVOD_* variables:',
             "the names only, extracted by ``scripts/compat_table.py --extract`` from Horovod's",
             'repository. Data for that script; nothing here is Horovod\'s code."""', "",
             "NAMES = {"]
    for mod, found in names.items():
        lines.append(f"    {mod!r}: [")
        lines.extend(f"        {n!r}," for n in found)
        lines.append("    ],")
    lines += ["}", "", "FLAGS = ["]
    lines.extend(f"    {f!r}," for f in flags)
    lines += ["]", "", "VARIABLES = ["]
    lines.extend(f"    {v!r}," for v in sorted(variables))
    lines += ["]", ""]
    return "\n".join(lines)


# -- the table -------------------------------------------------------------------------------


def _load_api() -> Tuple[Dict[str, List[str]], List[str], List[str]]:
    sys.path.insert(0, str(HERE))
    import horovod_api  # type: ignore[import-not-found]

    return horovod_api.NAMES, horovod_api.FLAGS, horovod_api.VARIABLES


def render() -> Tuple[str, List[str]]:
    """The document, and every Horovod name/flag/variable neither handled nor explained."""
    names, flags, variables = _load_api()
    unexplained: List[str] = []
    out = ["# Horovod's surface in ferrovod", "",
           "Generated by `scripts/compat_table.py` from ferrovod's code (do not edit by hand). "
           "Horovod 0.28.1's side is `scripts/horovod_api.py`. A test fails when a Horovod name "
           "is neither provided here nor listed with a reason.", "", ALIAS_SECTION]
    provided = missing = 0
    rows: List[str] = []
    for hmod, hnames in names.items():
        fmod = importlib.import_module(MODULES[hmod])
        for name in hnames:
            if hasattr(fmod, name):
                provided += 1
                rows.append(f"| `{hmod}.{name}` | provided (`{MODULES[hmod]}.{name}`) |")
                continue
            missing += 1
            why = NAMES_NOT_PROVIDED.get((hmod, name))
            if why is None:
                unexplained.append(f"name {hmod}.{name}")
                why = "**missing, no reason given**"
            rows.append(f"| `{hmod}.{name}` | not provided: {why} |")
    out += [f"## Python names ({provided} provided, {missing} not)", "",
            "| Horovod | ferrovod |", "|---|---|", *rows, ""]

    from ferrovod.runner import launch
    from ferrovod.runner.flags import build_parser

    ours = {opt: action for action in build_parser()._actions for opt in action.option_strings}
    ignored_dests = {dest for dest, _ in launch._IGNORED_FLAGS}
    rows = []
    for flag in flags:
        action = ours.get(flag)
        if action is None:
            why = FLAGS_NOT_PROVIDED.get(flag)
            if why is None:
                unexplained.append(f"flag {flag}")
                why = "**missing, no reason given**"
            rows.append(f"| `{flag}` | not accepted: {why} |")
        elif action.dest in ignored_dests:
            rows.append(f"| `{flag}` | accepted, no effect in ferrovod (noted with `--verbose`) |")
        else:
            rows.append(f"| `{flag}` | same |")
    out += ["## horovodrun flags (`ferrovodrun`)", "", "| flag | ferrovod |", "|---|---|",
            *rows, ""]

    from ferrovod import _core

    aliases = {alias: name for name, alias, _default, _doc in _core.env_vars() if alias}
    rows = []
    for var in variables:
        if var in aliases:
            rows.append(f"| `{var}` | read, as `{aliases[var]}` (see the README's table) |")
        elif var in VARIABLES:
            rows.append(f"| `{var}` | {VARIABLES[var]} |")
        else:
            unexplained.append(f"variable {var}")
            rows.append(f"| `{var}` | **not handled, no reason given** |")
    out += ["## HOROVOD_* variables", "", "| variable | ferrovod |", "|---|---|", *rows, ""]
    return "\n".join(out), unexplained


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--extract", nargs="+", metavar=("HOROVOD_REPO", "REF"))
    args = ap.parse_args()
    if args.extract:
        repo, ref = args.extract[0], (args.extract[1] if len(args.extract) > 1 else "HEAD")
        API.write_text(extract(repo, ref))
        return 0
    text, unexplained = render()
    for item in unexplained:
        print(f"compat_table: Horovod's {item} is neither provided nor explained", file=sys.stderr)
    if args.check:
        stale = not DOC.exists() or DOC.read_text() != text
        if stale:
            print(f"compat_table: {DOC.name} is out of date; run scripts/compat_table.py",
                  file=sys.stderr)
        return 1 if (stale or unexplained) else 0
    DOC.write_text(text)
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
