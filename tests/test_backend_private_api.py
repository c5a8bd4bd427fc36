"""MindSpore's private API (underscore names) is used in one module only:
fshard/backend/mindspore.py. A MindSpore upgrade is then checked in one place."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mindspore import Parameter, Tensor, nn, ops

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = ROOT / "fshard" / "backend" / "mindspore.py"


def _private(parts) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
               for p in parts)


def _ms_private_attributes() -> set[str]:
    """Private attribute names of the MindSpore objects fshard handles (Cells,
    Tensors, Parameters, primitives), class and instance ones."""
    names = set()
    for obj in (nn.Cell, nn.Dense(2, 2), Tensor, Parameter(Tensor([1.0]), name="p"),
                ops.Primitive):
        names.update(n for n in dir(obj) if _private([n]))
        names.update(n for n in getattr(obj, "__dict__", {}) if _private([n]))
    return names


def private_uses(path: Path, attributes: set[str]) -> list[str]:
    """Every use of a private MindSpore name in ``path``: imports of private modules or
    names, private module names as strings (``sys.modules`` lookups), attributes of a
    private name on a MindSpore module, and MindSpore objects' private attributes
    (``cell._params``; not ``self._x``, which is fshard's own)."""
    tree = ast.parse(path.read_text())
    ms_names: set[str] = set()
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "mindspore":
                    ms_names.add(a.asname or "mindspore")
                    if _private(a.name.split(".")):
                        hits.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "mindspore":
            for a in node.names:
                ms_names.add(a.asname or a.name)
                if _private(f"{node.module}.{a.name}".split(".")):
                    hits.append((node.lineno, f"from {node.module} import {a.name}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"mindspore(\.\w+)+", node.value) and _private(
                    node.value.split(".")):
                hits.append((node.lineno, repr(node.value)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in (
                "getattr", "hasattr", "setattr") and len(node.args) >= 2 and isinstance(
                node.args[1], ast.Constant) and node.args[1].value in attributes:
            hits.append((node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"))
        if not isinstance(node, ast.Attribute) or not _private([node.attr]):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in ms_names:
            hits.append((node.lineno, f"{root.id}....{node.attr}"))
        elif node.attr in attributes and not (isinstance(node.value, ast.Name)
                                               and node.value.id in ("self", "cls")):
            hits.append((node.lineno, f"...{node.attr}"))
    return [f"{path.relative_to(ROOT)}:{line}: {what}" for line, what in sorted(set(hits))]


def _sources() -> list[Path]:
    return sorted((ROOT / "fshard").rglob("*.py")) + sorted((ROOT / "transforms").rglob("*.py"))


def _own_attributes(paths) -> set[str]:
    """Private attribute names fshard sets itself (``self._compiled = ...``): those are
    fshard's, even where MindSpore has one of the same name."""
    def flat(targets):
        for t in targets:
            yield from flat(t.elts) if isinstance(t, ast.Tuple) else [t]

    names = set()
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.attr for t in flat(targets) if isinstance(t, ast.Attribute))
            if isinstance(node, ast.ClassDef):  # class attributes (``_load = ...``)
                for stmt in node.body:
                    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                        names.update(t.id for t in flat(targets) if isinstance(t, ast.Name))
    return names


def test_private_mindspore_api_stays_in_the_backend_module():
    attributes = _ms_private_attributes() - _own_attributes(_sources())
    bad = [h for p in _sources() if p != ALLOWED for h in private_uses(p, attributes)]
    assert not bad, ("private MindSpore API outside fshard/backend/mindspore.py (add a "
                     "function there and call it):\n" + "\n".join(bad))


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    src = tmp_path / "sample.py"
    src.write_text(
        "import mindspore._c_expression as cx\n"
        "from mindspore.common.api import _pynative_executor\n"
        "from mindspore import ops\n"
        "import sys\n"
        "sys.modules.get('mindspore.communication._comm_helper')\n"
        "ops.primitive._run_op\n"
        "def f(cell):\n"
        "    return cell._params, self._own, getattr(cell, '_init_flag', True)\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        found = private_uses(src, _ms_private_attributes())
    finally:
        ROOT = root
    assert [h.split(": ", 1)[1] for h in found] == [
        "import mindspore._c_expression",
        "from mindspore.common.api import _pynative_executor",
        "'mindspore.communication._comm_helper'",
        "ops....._run_op".replace(".....", "...."),
        "..._params",
        "getattr(..., '_init_flag')",
    ]
    # the backend module itself does use private API (the scan sees it there)
    assert private_uses(ALLOWED, _ms_private_attributes())
