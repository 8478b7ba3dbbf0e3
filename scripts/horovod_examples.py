#!/usr/bin/env python3
"""Runs Horovod's own TensorFlow/Keras example scripts, unchanged, on ferrovod.

Each script is read from a snapshot of Horovod's repository (never copied into this one) and
run as a user of Horovod would run it, except that ``horovodrun`` is ``ferrovodrun`` and
``--as-horovod`` makes the script's ``import horovod...`` give ferrovod's modules: not a line
of the script is changed. Keras 2 (``tf_keras``, with ``TF_USE_LEGACY_KERAS=1``) by default,
as Horovod-era scripts need on TensorFlow >= 2.16; ``--keras 3`` runs them on Keras 3.

The MNIST scripts call ``tf.keras.datasets.mnist.load_data``, which downloads. Offline, the
workers get MNIST-shaped data instead: scikit-learn's bundled 8x8 digits scaled to 28x28
(1 500 for training, 297 held out), through a ``sitecustomize`` module on the workers'
``PYTHONPATH`` that replaces ``load_data`` before the script starts. Real digits, so the
accuracy the script prints means something.

Usage: .venv/bin/python scripts/horovod_examples.py HOROVOD_REPO [--ref v0.28.1]
           [--examples NAME,...] [--np 2] [--keras 2|3]
Prints each script's last lines and a table (script, exit code, seconds, last metrics).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parent.parent

# name -> (path in Horovod's repository, arguments, extra launcher flags)
EXAMPLES: Dict[str, Tuple[str, List[str], List[str]]] = {
    "tensorflow2_keras_mnist": ("examples/tensorflow2/tensorflow2_keras_mnist.py", [], []),
    "tensorflow2_keras_synthetic_benchmark": (
        "examples/tensorflow2/tensorflow2_keras_synthetic_benchmark.py",
        ["--model", "MobileNetV2", "--batch-size", "8", "--num-iters", "3",
         "--num-batches-per-iter", "5", "--no-cuda"], []),
    "tensorflow2_mnist": ("examples/tensorflow2/tensorflow2_mnist.py", [], []),
    "tensorflow2_keras_mnist_elastic": (
        "examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py", [],
        ["--min-np", "1", "--max-np", "{np}", "--host-discovery-script", "{discover}"]),
}

SITECUSTOMIZE = '''
"""Offline MNIST for Horovod's examples (scripts/horovod_examples.py): sklearn's digits."""
import sys


def _load_data(path="mnist.npz"):
    import numpy as np
    from sklearn.datasets import load_digits

    d = load_digits()
    big = np.kron(d.images, np.ones((1, 3, 3)))  # 8x8 -> 24x24
    imgs = np.pad(big, ((0, 0), (2, 2), (2, 2))) * (255.0 / 16.0)
    order = np.random.default_rng(0).permutation(len(imgs))
    x, y = imgs[order].astype("uint8"), d.target[order].astype("uint8")
    return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def _patch():
    import importlib

    for name in ("tf_keras.datasets.mnist", "tf_keras.src.datasets.mnist",
                 "tf_keras.api._v2.keras.datasets.mnist", "keras.datasets.mnist",
                 "keras.src.datasets.mnist"):
        try:
            importlib.import_module(name).load_data = _load_data
        except ImportError:
            pass


_patch()
'''


def read(repo: Path, ref: str, path: str) -> str:
    """The file ``path`` at ``ref`` (a git repository), or from a plain directory."""
    if (repo / path).is_file() and not (repo / ".git").exists() and not (repo / "HEAD").exists():
        return (repo / path).read_text()
    return subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def metrics(output: str) -> str:
    """The last loss/accuracy or img/sec the script printed."""
    found = re.findall(r"(loss: [\d.e+-]+(?: - accuracy: [\d.]+)?|Total img/sec[^\n]*|"
                       r"Step #\d+\tLoss: [\d.]+)", output)
    return found[-1].replace("\t", " ") if found else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("repo", type=Path)
    ap.add_argument("--ref", default="v0.28.1")
    ap.add_argument("--examples", default=",".join(EXAMPLES))
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--keras", choices=("2", "3"), default="2")
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="horovod-examples-") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        discover = work / "discover.sh"
        discover.write_text(f"#!/bin/sh\necho localhost:{args.np}\n")
        discover.chmod(0o755)
        for name in args.examples.split(","):
            path, script_args, flags = EXAMPLES[name]
            script = work / Path(path).name
            script.write_text(read(args.repo, args.ref, path))
            flags = [f.format(np=args.np, discover=discover) for f in flags]
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
                       TF_USE_LEGACY_KERAS="1" if args.keras == "2" else "0")
            cmd = [sys.executable, "-m", "ferrovod.runner.launch", "-np", str(args.np),
                   "--as-horovod", *flags, "env", f"PYTHONPATH={work / 'site'}",
                   sys.executable, str(script), *script_args]
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=args.timeout)
            took = time.monotonic() - t0
            out = proc.stdout + proc.stderr
            print(f"== {name} (exit {proc.returncode}, {took:.0f} s)")
            print("\n".join(out.strip().splitlines()[-8:]))
            rows.append((name, proc.returncode, took, metrics(out)))
    print(f"\n| script (Keras {args.keras}, {args.np} ranks) | exit | seconds | last printed |")
    print("|---|---|---|---|")
    for name, rc, took, last in rows:
        print(f"| `{name}.py` | {rc} | {took:.0f} | {last} |")
    return 0 if all(rc == 0 for _, rc, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
