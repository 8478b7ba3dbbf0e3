"""``python/ferrovod/_core.pyi`` declares exactly what the native module exports: every
function, constant and class, and every public method and property of each class (the stubs
are what type checkers and readers see of the PyO3 layer)."""

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("ferrovod_importable")

STUBS = Path(__file__).resolve().parents[2] / "python" / "ferrovod" / "_core.pyi"


def _declared(body):
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def _public(names):
    return {n for n in names if not n.startswith("_") or n in ("__array_interface__", "__len__")}


def test_every_export_of_the_native_module_is_declared_and_nothing_else():
    from ferrovod import _core

    declared = _declared(ast.parse(STUBS.read_text()).body)
    exported = {n for n in dir(_core) if not n.startswith("__")} | {"__version__"}
    assert sorted(exported - set(declared)) == [], "exported but not in _core.pyi"
    assert sorted(set(declared) - exported) == [], "in _core.pyi but not exported"
    for name, node in declared.items():
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(_core, name)
        members = _public({n for n in vars(cls)})
        stubbed = _public(_declared(node.body)) - {"__init__"}
        assert sorted(members - stubbed) == [], f"{name}: members missing from _core.pyi"
        assert sorted(stubbed - members) == [], f"{name}: _core.pyi declares members it lacks"
