"""DeePMD-kit's TensorFlow backend (``dp --tf train``) trains on 2 ranks of ferrovod through
``ferrovodrun --as-horovod``, exactly as it trains alone on the union of the ranks' data.

DeePMD-kit imports ``horovod.tensorflow`` itself (deepmd/tf/train/run_options.py): with more
than one rank it wraps its ``tf.compat.v1.train.AdamOptimizer`` in ``DistributedOptimizer``,
runs ``broadcast_global_variables(0)`` once after initialising, and only rank 0 writes
``lcurve.out`` and checkpoints. Without Horovod it says "Switch to serial execution due to lack
of horovod module" and every process trains alone. scripts/setup_venv.sh installs it into
.venv (deepmd-kit[cpu] pins the TensorFlow the venv has); these tests skip, saying so, where it
or an MPI library for mpi4py is missing.

Why the two runs must agree. CI cannot fetch DeePMD's example data, so the test writes two
frames, A and B, of a 6-atom water-like system (two molecules in a periodic box; energies and
forces from a Morse pair potential) in DeePMD's ``deepmd/npy`` format. DeePMD gives every rank
the whole of its data (seeding each rank's shuffling differently), so to give the ranks
different data each rank runs ``dp --tf train input.json`` in its own directory
(``sh -c 'cd rank$FERROVOD_RANK && exec dp ...'``), whose training system holds one frame per
set: rank 0 ``set.000 = A, set.001 = B``, rank 1 the other way round. DeePMD walks the sets of
a system in order, and with ``batch_size`` 1 each batch is one whole set, so at every step
rank 0 trains on one frame and rank 1 on the other: together always {A, B}. The serial run
trains on one set holding {A, B} with ``batch_size`` 2. DeePMD's energy loss is the mean over
frames and its force loss the mean over all force components, so with equal atom counts the
loss of {A, B} is the mean of the losses of A and of B, and its gradient the mean of the two
ranks' gradients: what DistributedOptimizer's allreduce (op=Average) hands Adam. The learning
rate is not scaled by the number of workers (``scale_by_worker: none``; DeePMD's default
"linear" would double it on 2 ranks), the data statistics see both frames in both runs
(``data_stat_nbatch`` 2: A and B on a rank, {A, B} twice serially, the same means), the
initial weights come from the same seeds (and rank 0's are broadcast), and the validation
system is {A, B} in both. So the runs compute the same numbers but for the order of the
floating-point sums (float64).

What is compared, and to what tolerance:
- ``lcurve.out``: the same steps and learning rates, and every validation column (``*_val``)
  equal at every step to DeePMD's printed precision (3 significant digits; one unit in the
  last digit is allowed, for two equal numbers on either side of a rounding boundary). The
  training columns (``*_trn``) are rank 0's own batch, one frame: they must differ from the
  serial run's, which shows that rank 0 did not see the serial batch.
- The final checkpoint: every weight and both Adam moments of every weight equal to 1e-9 of
  the tensor's largest entry. Seen: at most 2e-15. Adam's first moment is a running mean of the
  applied gradients and its second of their squares, so this is what tells an average across
  the ranks from anything else: rank 0 alone (no allreduce) differs by 1e-2 in the weights and
  1.2 in the moments (test_without_the_alias_each_rank_trains_alone checks that), a Sum
  instead of the Average by 1e-6 in the weights (Adam hardly sees a scale) but 3.0 in the
  second moment (4 v against v: seen with a shim that passed op=Sum).
- The timeline (``FERROVOD_TIMELINE``, written by rank 0): exactly one allreduce per training
  step, all on one engine name, each a grouped allreduce of one gradient for every trainable
  variable (their shapes, from the checkpoint), and one broadcast for every global variable.
- Both ranks ran distributed: under ferrovodrun mpi4py sees a world of one (no mpirun), so
  DeePMD's summary prints no "World Size"; what shows it is rank 1's "receive global
  variables from task#0" and rank 0's "broadcast global variables to other tasks" (logged only
  when Horovod reports more than one rank, each by its own rank), no "Switch to serial", and
  rank 1 writing no lcurve.out (it knew it was not rank 0).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shlex
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, _env, _run, describe, lines_matching

pytestmark = [
    pytest.mark.usefixtures("ferrovod_importable"),
    # The runs are shared by the tests below (module fixtures): keep them on one worker.
    pytest.mark.xdist_group("deepmd"),
    pytest.mark.timeout(900),
]

# The venv with DeePMD-kit: the tests' own unless DEEPMD_VENV names another.
VENV = REPO / (os.environ.get("DEEPMD_VENV") or Path(sys.executable).parent.parent)
BIN = VENV / "bin"
STEPS = 20
RUN_TIMEOUT = 600  # one `dp` run takes 10-30 s here; a generous bound, not a pacing

BOX = 8.0
TYPES = np.array([0, 0, 1, 1, 1, 1])  # O O H H H H
# Morse parameters per pair of types: depth, width, equilibrium distance.
MORSE = {(0, 0): (0.2, 1.5, 2.9), (0, 1): (0.5, 2.2, 1.0), (1, 1): (0.1, 1.8, 1.6)}


def _frames() -> list[np.ndarray]:
    """Frames A and B: two water molecules, displaced by fixed (not random) offsets."""
    water = np.array([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]])
    base = np.concatenate([water + 2.0, water + [4.6, 3.9, 3.4]])[[0, 3, 1, 2, 4, 5]]
    return [base + 0.12 * np.sin(np.arange(18.0).reshape(6, 3) * (k + 1.3)) for k in range(2)]


def _energy_force(coord: np.ndarray) -> tuple[float, np.ndarray]:
    """Morse pair energy over all pairs (minimum image) and its forces."""
    energy, force = 0.0, np.zeros_like(coord)
    for i in range(len(coord)):
        for j in range(i + 1, len(coord)):
            d = coord[j] - coord[i]
            d -= BOX * np.round(d / BOX)
            r = float(np.linalg.norm(d))
            depth, width, r0 = MORSE[tuple(sorted((int(TYPES[i]), int(TYPES[j]))))]
            x = math.exp(-width * (r - r0))
            energy += depth * (x * x - 2 * x)
            de_dr = 2 * depth * width * (x - x * x)
            force[i] += de_dr * d / r
            force[j] -= de_dr * d / r
    return energy, force


def _write_system(path: Path, sets: list[list[np.ndarray]]) -> None:
    """A system in DeePMD's deepmd/npy format, one set.NNN per list of frames."""
    path.mkdir(parents=True)
    (path / "type.raw").write_text("".join(f"{t}\n" for t in TYPES))
    (path / "type_map.raw").write_text("O\nH\n")
    for k, frames in enumerate(sets):
        d = path / f"set.{k:03d}"
        d.mkdir()
        labels = [_energy_force(c) for c in frames]
        np.save(d / "coord.npy", np.array([c.ravel() for c in frames]))
        np.save(d / "box.npy", np.tile(np.eye(3).ravel() * BOX, (len(frames), 1)))
        np.save(d / "energy.npy", np.array([e for e, _ in labels]))
        np.save(d / "force.npy", np.array([f.ravel() for _, f in labels]))


def _input(batch_size: int) -> dict:
    """A tiny se_e2_a model (a step takes milliseconds) with fixed seeds."""
    return {
        "model": {
            "type_map": ["O", "H"],
            "data_stat_nbatch": 2,
            "descriptor": {"type": "se_e2_a", "sel": [4, 8], "rcut_smth": 0.5, "rcut": 3.5,
                           "neuron": [4, 8], "axis_neuron": 4, "seed": 1},
            "fitting_net": {"neuron": [8, 8], "seed": 1},
        },
        "learning_rate": {"type": "exp", "start_lr": 1e-3, "stop_lr": 1e-4, "decay_steps": 5,
                          "scale_by_worker": "none"},
        "loss": {"type": "ener", "start_pref_e": 0.2, "limit_pref_e": 1, "start_pref_f": 100,
                 "limit_pref_f": 1, "start_pref_v": 0, "limit_pref_v": 0},
        "training": {
            "training_data": {"systems": ["train"], "batch_size": batch_size},
            "validation_data": {"systems": ["valid"], "batch_size": 2, "numb_btch": 1},
            "numb_steps": STEPS, "seed": 10, "disp_file": "lcurve.out", "disp_freq": 1,
            "save_freq": STEPS,
        },
    }


def _workdir(path: Path, train_sets: list[list[np.ndarray]], batch_size: int) -> Path:
    a, b = _frames()
    _write_system(path / "train", train_sets)
    _write_system(path / "valid", [[a, b]])
    (path / "input.json").write_text(json.dumps(_input(batch_size), indent=1))
    return path


def _layout(root: Path) -> Path:
    """serial/ ({A, B} in one set, batch 2), rank0/ (A, B) and rank1/ (B, A), batch 1."""
    a, b = _frames()
    _workdir(root / "serial", [[a, b]], 2)
    _workdir(root / "rank0", [[a], [b]], 1)
    _workdir(root / "rank1", [[b], [a]], 1)
    return root


def _job_env(extra: dict | None = None) -> dict:
    # No launch environment of the test run's own; dp and ferrovodrun from the DeePMD venv; one
    # TensorFlow thread pool each (2 ranks on a 2-core machine, as DeePMD's docs advise).
    env = _env({"DP_INTRA_OP_PARALLELISM_THREADS": "1", "DP_INTER_OP_PARALLELISM_THREADS": "1",
                "OMP_NUM_THREADS": "1", **(extra or {})}, plain=True)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VIRTUAL_ENV", None)
    return env


def _dp_in(directory: str) -> str:
    return f"cd {directory} && exec dp --tf train input.json"


def _two_ranks(root: Path, as_horovod: bool, timeline: Path):
    flags = ["--as-horovod"] if as_horovod else []
    cmd = [str(BIN / "ferrovodrun"), "-np", "2", *flags, "sh", "-c",
           _dp_in(shlex.quote(str(root)) + "/rank$FERROVOD_RANK")]
    return _run(cmd, _job_env({"FERROVOD_TIMELINE": str(timeline)}), RUN_TIMEOUT)


@pytest.fixture(scope="module")
def deepmd() -> None:
    """Skips, saying why, where DeePMD-kit or an MPI library for mpi4py is missing."""
    py = BIN / "python"
    probe = subprocess.run(
        [str(py), "-c", "import importlib.util as u, sys; "
                        "sys.exit(u.find_spec('deepmd') is None)"],
        capture_output=True, text=True, timeout=120) if py.exists() else None
    if probe is None or probe.returncode != 0 or not (BIN / "dp").exists():
        pytest.skip(f"DeePMD-kit is not installed in {VENV}: run scripts/setup_venv.sh "
                    "(make setup does)")
    # DeePMD imports mpi4py's MPI (its host list, and its logging when Horovod reports more
    # than one rank) and catches only ImportError: an mpi4py that finds no libmpi stops dp.
    mpi = subprocess.run([str(py), "-c", "from mpi4py import MPI"], capture_output=True,
                         text=True, timeout=120, env=_job_env())
    if mpi.returncode != 0:
        pytest.skip("mpi4py cannot load an MPI library, and DeePMD's dp stops without one "
                    "(scripts/system_deps.sh installs Open MPI): "
                    + mpi.stderr.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(deepmd, tmp_path_factory):
    """The serial reference run and the 2-rank run, once for the module."""
    root = _layout(tmp_path_factory.mktemp("deepmd"))
    serial = _run(["sh", "-c", _dp_in(shlex.quote(str(root / "serial")))], _job_env(),
                  RUN_TIMEOUT)
    assert serial.returncode == 0, f"serial dp failed\n{describe(serial)}"
    timeline = root / "timeline.json"
    two = _two_ranks(root, as_horovod=True, timeline=timeline)
    assert two.returncode == 0, f"2-rank dp failed\n{describe(two)}"
    print(f"serial run {serial.elapsed:.1f} s, 2-rank run {two.elapsed:.1f} s")
    return {"root": root, "serial": serial, "two": two, "timeline": timeline}


def _lcurve(path: Path) -> dict[str, list[str]]:
    """lcurve.out's columns by header name, as printed."""
    lines = path.read_text().splitlines()
    header = lines[0].lstrip("#").split()
    rows = [ln.split() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert rows and all(len(r) == len(header) for r in rows), path.read_text()
    return {name: [r[i] for r in rows] for i, name in enumerate(header)}


def _same_printed(a: str, b: str) -> bool:
    """Equal as printed with 3 significant digits, or one unit apart in the last one."""
    x, y = float(a), float(b)
    if a == b:
        return True
    if not (math.isfinite(x) and math.isfinite(y)) or x == 0 or y == 0:
        return False
    unit = 10.0 ** (math.floor(math.log10(max(abs(x), abs(y)))) - 2)
    return abs(x - y) <= 1.001 * unit


_DUMP = textwrap.dedent("""
    import pickle, sys
    import tensorflow as tf
    out = {}
    for d in sys.argv[2:]:
        reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(d))
        out[d] = {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    with open(sys.argv[1], "wb") as f:
        pickle.dump(out, f)
""")


def _checkpoints(root: Path, *dirs: Path) -> list[dict[str, np.ndarray]]:
    """Every variable of each directory's latest checkpoint (read in the DeePMD venv)."""
    out = root / "checkpoints.pkl"
    proc = subprocess.run([str(BIN / "python"), "-c", _DUMP, str(out), *map(str, dirs)],
                          capture_output=True, text=True, timeout=300,
                          env=_job_env({"TF_CPP_MIN_LOG_LEVEL": "3"}))
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, "rb") as f:
        got = pickle.load(f)
    return [got[str(d)] for d in dirs]


def _worst(a: dict[str, np.ndarray], b: dict[str, np.ndarray], kind: str) -> tuple[float, str]:
    """The largest difference, relative to the tensor's largest entry, over the weights
    (``kind`` "weights": variables Adam has slots for) or their Adam moments ("moments")."""
    worst, where = 0.0, ""
    for name, x in a.items():
        moment = "/Adam" in name
        weight = f"{name}/Adam" in a
        if (kind == "moments" and not moment) or (kind == "weights" and not weight):
            continue
        scale = float(np.max(np.abs(x))) or 1.0
        rel = float(np.max(np.abs(x - b[name]))) / scale
        if rel >= worst:
            worst, where = rel, name
    assert where, f"no {kind} in the checkpoint: {sorted(a)}"
    return worst, where


@pytest.fixture(scope="module")
def checkpoints(runs):
    return _checkpoints(runs["root"], runs["root"] / "serial", runs["root"] / "rank0")


def test_two_ranks_ran_distributed(runs):
    two = runs["two"]
    assert "Switch to serial execution" not in two.stdout + two.stderr, describe(two)
    assert lines_matching(two, 0, r"DEEPMD INFO\s+broadcast global variables to other tasks"), \
        describe(two)
    assert lines_matching(two, 1, r"DEEPMD INFO\s+receive global variables from task#0"), \
        describe(two)
    root = runs["root"]
    assert (root / "rank0" / "lcurve.out").is_file()
    assert not (root / "rank1" / "lcurve.out").exists(), "rank 1 wrote lcurve.out as if rank 0"
    assert not list((root / "rank1").glob("model.ckpt*")), "rank 1 saved a checkpoint"


def test_lcurve_matches_the_serial_run_at_every_step(runs):
    serial = _lcurve(runs["root"] / "serial" / "lcurve.out")
    two = _lcurve(runs["root"] / "rank0" / "lcurve.out")
    assert list(serial) == list(two), (list(serial), list(two))
    assert serial["step"] == two["step"] == [str(s) for s in range(STEPS + 1)], serial["step"]
    assert serial["lr"] == two["lr"]
    val = [c for c in serial if c.endswith("_val")]
    assert {"rmse_val", "rmse_e_val", "rmse_f_val"} <= set(val), val
    for col in val:
        bad = [(s, x, y) for s, x, y in zip(serial["step"], serial[col], two[col])
               if not _same_printed(x, y)]
        assert not bad, f"{col} differs (step, serial, 2 ranks): {bad}"
    # rank 0's own batch, one frame, is not the serial batch: its training error differs.
    same = [s for s, x, y in zip(serial["step"], serial["rmse_trn"], two["rmse_trn"])
            if abs(float(x) - float(y)) <= 0.1 * abs(float(x))]
    assert not same, f"rank 0's training batch looks like the serial one at steps {same}"
    print("step  rmse_val serial / 2 ranks  rmse_trn serial / rank 0")
    for i in (0, 1, 2, 10, STEPS):
        print(f"{serial['step'][i]:>4}  {serial['rmse_val'][i]} / {two['rmse_val'][i]}"
              f"  {serial['rmse_trn'][i]} / {two['rmse_trn'][i]}")


def test_weights_and_adam_moments_match_the_serial_run(checkpoints):
    serial, two = checkpoints
    assert sorted(serial) == sorted(two)
    for kind in ("weights", "moments"):
        worst, where = _worst(serial, two, kind)
        print(f"{kind}: largest relative difference {worst:.1e} ({where})")
        assert worst <= 1e-9, f"{kind} differ from the serial run's: {worst:.3e} at {where}"


def _track_activities(events: list[dict]) -> dict[str, list[tuple[str, dict]]]:
    """Per engine name: each activity's name and the args its closing event carries."""
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    open_, done = {}, {}
    for e in events:
        if e.get("ph") == "B":
            open_.setdefault(e["pid"], []).append(e["name"])
        elif e.get("ph") == "E":
            stack = open_.get(e["pid"])
            assert stack, f"an end without a begin: {e}"
            done.setdefault(names[e["pid"]], []).append((stack.pop(), e.get("args") or {}))
    assert not any(open_.values()), f"unclosed activities: {open_}"
    return done


def test_timeline_holds_one_grouped_allreduce_per_step(runs, checkpoints):
    events = json.loads(runs["timeline"].read_text())
    tracks = _track_activities(events)
    reduces = {name: [args for act, args in acts if act == "ALLREDUCE"]
               for name, acts in tracks.items()}
    reduces = {name: r for name, r in reduces.items() if r}
    counts = {k: len(v) for k, v in reduces.items()}
    assert len(reduces) == 1, f"allreduces under several engine names: {counts}"
    (name, steps), = reduces.items()
    assert len(steps) == STEPS, f"{len(steps)} allreduces of {name} for {STEPS} training steps"
    # Each one reduces a gradient for every trainable variable (those Adam keeps slots for).
    _, two = checkpoints
    want = Counter(f"{v.dtype.name} {list(v.shape)}" for k, v in two.items()
                   if f"{k}/Adam" in two)
    for args in steps:
        got = Counter(t.strip() for t in args["tensors"].split(";"))
        assert got == want, f"{name} reduced {sorted(got.elements())}, " \
                            f"want {sorted(want.elements())}"
    # broadcast_global_variables(0): one broadcast for every global variable, once.
    bcasts = Counter(track for track, acts in tracks.items()
                     for act, _ in acts if act == "BROADCAST")
    assert len(bcasts) == len(two) and set(bcasts.values()) == {1}, (len(bcasts), len(two))
    print(f"timeline: {len(steps)} grouped allreduces of {sum(want.values())} gradients "
          f"({name}) for {STEPS} steps, {len(bcasts)} broadcasts")


def test_without_the_alias_each_rank_trains_alone(runs):
    """The same job without --as-horovod: DeePMD finds no Horovod, each rank trains alone on
    its own frame per step, and rank 0's model is no longer the serial one."""
    root = _layout(runs["root"] / "no-alias")
    timeline = root / "timeline.json"
    res = _two_ranks(root, as_horovod=False, timeline=timeline)
    assert res.returncode == 0, describe(res)
    for rank in (0, 1):
        assert lines_matching(res, rank, r"Switch to serial execution due to lack of horovod"), \
            describe(res)
    assert (root / "rank1" / "lcurve.out").is_file(), "rank 1 trained alone, as rank 0 of one"
    assert not timeline.exists(), "ferrovod ran although nothing imported it"
    serial, alone = _checkpoints(root, runs["root"] / "serial", root / "rank0")
    worst, where = _worst(serial, alone, "weights")
    print(f"rank 0 alone: weights differ from the serial run's by {worst:.1e} ({where})")
    assert worst > 1e-4, f"rank 0 alone matches the serial run ({worst:.1e}): the test is blind"
