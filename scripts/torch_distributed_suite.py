"""Runs torch's own distributed test suite against the ``ferrovod`` backend, beside gloo.

torch's CI runs ``torch.testing._internal.distributed.distributed_test`` (shipped in every
torch wheel) for gloo through ``test/distributed/test_distributed_spawn.py``: one process per
rank, spawned afresh for every test, forming over ``file://``. This script does the same for
``BACKEND=ferrovod`` and ``BACKEND=gloo`` at the world sizes asked for, and prints a table of
passed / failed / skipped per run and every test whose outcome differs between the two.

ferrovod is held to what gloo is held to: the suite's skips name gloo in two ways, through
``DistTestCases``'s capability sets and through literal comparisons such as
``BACKEND != "gloo"``. Both are widened to let ferrovod in wherever gloo is: the sets gain
``"ferrovod"`` at import, and the module's source is compiled with every comparison of
``BACKEND`` against gloo (and every backend list that names gloo) extended by ferrovod. Nothing
else in torch's tests changes; the rewritten module is built in memory at each import, never
written out.

Usage (from the repository root, after ``make setup``)::

    .venv/bin/python scripts/torch_distributed_suite.py                 # gloo and ferrovod, 2 and 3 ranks
    .venv/bin/python scripts/torch_distributed_suite.py --backends ferrovod --world-sizes 2 -k all_reduce
    .venv/bin/python scripts/torch_distributed_suite.py --workers 2 --report suite.md

The same file is the pytest module each run collects: with ``FERROVOD_TORCH_SUITE`` set it
defines the suite's test class for ``BACKEND`` as ``test_distributed_spawn.py`` does.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

_SUITE_MODULE = "torch.testing._internal.distributed.distributed_test"
_OURS = "ferrovod"
# What torch's test utilities import beyond torch itself.
_TEST_DEPS = ("expecttest", "hypothesis")


def _names_gloo(node: ast.AST) -> bool:
    """Whether ``node`` is the literal ``"gloo"`` or ``dist.Backend.GLOO``."""
    if isinstance(node, ast.Constant) and node.value == "gloo":
        return True
    return isinstance(node, ast.Attribute) and node.attr == "GLOO"


def _backend_list_naming_gloo(node: ast.AST) -> bool:
    return isinstance(node, (ast.List, ast.Set, ast.Tuple)) and any(
        _names_gloo(e) for e in node.elts
    )


def _is_backend(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "BACKEND"


class _HoldAsGloo(ast.NodeTransformer):
    """Widens every place the suite tests for gloo by name so that ferrovod passes too."""

    def __init__(self) -> None:
        self.widened = 0

    def _widen(self, node: ast.List | ast.Set | ast.Tuple) -> None:
        node.elts.append(ast.Constant(_OURS))
        self.widened += 1

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) != 1 or not _is_backend(node.left):
            return node
        op, right = node.ops[0], node.comparators[0]
        if isinstance(op, (ast.Eq, ast.NotEq)) and _names_gloo(right):
            node.ops = [ast.In() if isinstance(op, ast.Eq) else ast.NotIn()]
            node.comparators = [ast.Tuple([right, ast.Constant(_OURS)], ast.Load())]
            self.widened += 1
        elif isinstance(op, (ast.In, ast.NotIn)) and _backend_list_naming_gloo(right):
            self._widen(right)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        func = node.func
        if isinstance(func, ast.Name) and func.id == "require_backend_is_available":
            for arg in node.args:
                if _backend_list_naming_gloo(arg):
                    self._widen(arg)
        return node

    def visit_Module(self, node: ast.Module) -> ast.AST:
        self.generic_visit(node)
        # Module-level allowlists (profiling of collectives and of p2p ops).
        for stmt in node.body:
            if isinstance(stmt, ast.Assign) and _backend_list_naming_gloo(stmt.value):
                self._widen(stmt.value)
        return node


def _load_suite_as_gloo():
    """Imports torch's suite with ferrovod entered wherever gloo is; returns the module."""
    import types

    from torch.testing._internal.common_distributed import DistTestCases

    for backends in DistTestCases.backend_feature.values():
        if "gloo" in backends:
            backends.add(_OURS)
    # require_backend_is_available asks the "plugin" set about backends torch does not know.
    DistTestCases.backend_feature["plugin"].add(_OURS)

    spec = importlib.util.find_spec(_SUITE_MODULE)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    transformer = _HoldAsGloo()
    tree = ast.fix_missing_locations(transformer.visit(ast.parse(source, spec.origin)))
    if transformer.widened < 30:
        raise RuntimeError(
            f"only {transformer.widened} gloo checks found in {spec.origin}: torch's suite "
            "changed shape; look at how it names gloo before trusting this run"
        )
    module = types.ModuleType(_SUITE_MODULE)
    module.__file__ = spec.origin
    module.__spec__ = spec
    sys.modules[_SUITE_MODULE] = module
    # dont_inherit: this file's `from __future__ import annotations` must not turn the suite's
    # annotations into strings (DDP compares a hook's annotation with dist.GradBucket).
    exec(compile(tree, spec.origin, "exec", dont_inherit=True), module.__dict__)
    return module


if os.environ.get("FERROVOD_TORCH_SUITE") and os.environ.get("BACKEND"):
    import torch

    if os.environ["BACKEND"] == _OURS:
        import ferrovod.torch  # noqa: F401  (registers the backend in every spawned rank)
        _suite = _load_suite_as_gloo()
    else:
        import torch.testing._internal.distributed.distributed_test as _suite

    class TestDistBackendWithSpawn(_suite.TestDistBackend, _suite.DistributedTest._DistTestBase):
        """torch's suite for ``BACKEND``, one spawned process per rank, as torch's CI runs it."""

        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()
            torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


def _run_one(
    backend: str, world_size: int, args: argparse.Namespace, out_dir: Path
) -> dict[str, str]:
    """Runs the suite once; returns each test's outcome (passed / failed / skipped)."""
    junit = out_dir / f"{backend}-{world_size}.xml"
    env = dict(os.environ)
    env.update(
        FERROVOD_TORCH_SUITE="1",
        BACKEND=backend,
        WORLD_SIZE=str(world_size),
        TEMP_DIR=str(out_dir),
        DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(args.timeout),
        # One thread per rank, as ranks on a shared host are run.
        OMP_NUM_THREADS="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        __file__,
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        f"--junitxml={junit}",
        "-o",
        "junit_family=xunit1",
    ]
    if args.workers > 1:
        cmd += ["-n", str(args.workers)]
    if args.k:
        cmd += ["-k", args.k]
    started = time.monotonic()
    log = out_dir / f"{backend}-{world_size}.log"
    with open(log, "w") as f:
        subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, check=False)
    print(
        f"{backend} WORLD_SIZE={world_size}: {time.monotonic() - started:.0f} s, log {log}",
        flush=True,
    )
    outcomes: dict[str, str] = {}
    if not junit.exists():
        return outcomes
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name", "")
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[name] = "failed"
        elif case.find("skipped") is not None:
            outcomes[name] = "skipped"
        else:
            outcomes[name] = "passed"
    return outcomes


def _table(results: dict[tuple[str, int], dict[str, str]], backends: list[str]) -> str:
    lines = ["| backend | ranks | passed | failed | skipped |", "|---|---|---|---|---|"]
    for (backend, ws), outcomes in results.items():
        counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "skipped")}
        lines.append(
            f"| {backend} | {ws} | {counts['passed']} | {counts['failed']} | {counts['skipped']} |"
        )
    if len(backends) == 2:
        a, b = backends
        for ws in sorted({ws for _, ws in results}):
            if (a, ws) not in results or (b, ws) not in results:
                continue
            ra, rb = results[(a, ws)], results[(b, ws)]
            diff = sorted(t for t in set(ra) | set(rb) if ra.get(t) != rb.get(t))
            lines += ["", f"Differences at {ws} ranks ({a} / {b}):", ""]
            lines += [f"- `{t}`: {ra.get(t, 'absent')} / {rb.get(t, 'absent')}" for t in diff]
            if not diff:
                lines.append("- none")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="gloo,ferrovod", help="comma-separated")
    parser.add_argument("--world-sizes", default="2,3", help="comma-separated")
    parser.add_argument("-k", default="", help="pytest -k expression selecting tests")
    parser.add_argument("--workers", type=int, default=1, help="tests run at once (xdist)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--report", type=Path, help="also write the table to this file")
    parser.add_argument("--keep", type=Path, help="directory for logs and junit files")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    sizes = [int(s) for s in args.world_sizes.split(",") if s]
    missing = [m for m in _TEST_DEPS if importlib.util.find_spec(m) is None]
    if missing:
        print(f"installing torch's test dependencies: {' '.join(missing)}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *missing], check=True)
    out_dir = args.keep or Path(tempfile.mkdtemp(prefix="torch-suite-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "barrier").mkdir(exist_ok=True)
    results: dict[tuple[str, int], dict[str, str]] = {}
    # Alternate the backends per world size so a slow window on the machine hits both alike.
    for ws in sizes:
        for backend in backends:
            results[(backend, ws)] = _run_one(backend, ws, args, out_dir)
    table = _table(results, backends)
    print(table)
    if args.report:
        args.report.write_text(table + "\n")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
