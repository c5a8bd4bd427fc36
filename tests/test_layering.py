"""Packaging and layering invariants."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np

import fshard as fs

ROOT = Path(__file__).resolve().parents[1]


def test_packages_list_covers_every_package_directory():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for pkg, d in dirs.items():
        for init in (ROOT / d).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / d)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found <= listed, f"packages missing from pyproject.toml: {found - listed}"


def test_transforms_is_only_importable_as_fshard_transforms():
    out = subprocess.run([sys.executable, "-c", "import transforms"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "import it under that name" in out.stderr


# The layers of fshard, lowest first. A module may import (at module level or inside a
# function) only modules of its own layer or of a lower one; the longest matching
# prefix gives a module's layer.
LAYERS = [
    # fshard/core/: types, dimensions, pytrees, contextvars, rule tables, tracing, the IR
    ("fshard.errors", "fshard.core", "fshard.core.dtypes", "fshard.core.context",
     "fshard.core.tree", "fshard.core.dims", "fshard.core.array_types"),
    ("fshard.core.rules", "fshard.core.factors"),
    ("fshard.core.tracing",),
    ("fshard.core.ir",),
    ("fshard.core.interpret", "fshard.core.staging", "fshard.core.annotations"),
    ("fshard.backend",),
    # fshard/meshes/: layouts, meshes, the process world
    ("fshard.meshes",),
    ("fshard.backend.collectives",),
    # the primitive families, each on the ones below it
    ("fshard.primitives.base",),
    ("fshard.primitives.elementwise",),
    ("fshard.primitives.structural", "fshard.primitives.reductions"),
    ("fshard.primitives.linalg", "fshard.primitives.nn", "fshard.primitives.collectives",
     "fshard.primitives.pipeline", "fshard.primitives.scans", "fshard.primitives.composite",
     "fshard.primitives.conv"),
    ("fshard.primitives.spmd", "fshard.primitives.control"),
    ("fshard.primitives.remat",),
    ("fshard.primitives", "fshard.primitives.passes"),
    ("fshard.sharding",),
    ("fshard.debug",),
    # fshard.ops and fshard/adapter/: what makes MindSpore code trace
    ("fshard.ops", "fshard.adapter"),
    ("fshard.random", "fshard.nn"),
    ("fshard.transforms",),
    # fshard/training/: optim, checkpoint, amp, parallel
    ("fshard.training",),
    ("fshard.launch", "fshard.testing", "fshard.profiling"),
]

def _modules() -> dict[str, Path]:
    mods = {}
    for base, pkg in ((ROOT / "fshard", ("fshard",)), (ROOT / "transforms",
                                                        ("fshard", "transforms"))):
        for path in base.rglob("*.py"):
            parts = pkg + path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def _imports(path: Path, known: dict) -> set[str]:
    """Every fshard module ``path`` imports, anywhere in the file (not under
    ``if TYPE_CHECKING:``, which never runs)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n in known}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) - {m} for m, p in mods.items()}


def _layer(mod: str) -> int | None:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (mod == prefix or mod.startswith(prefix + ".")) and (
                    best is None or len(prefix) > best[1]):
                best = (i, len(prefix))
    return None if best is None else best[0]


def test_every_module_has_a_layer():
    missing = sorted(m for m in _graph() if m != "fshard" and _layer(m) is None)
    assert not missing, f"add these modules to LAYERS in tests/test_layering.py: {missing}"


def test_imports_only_go_down_the_layers():
    up = [f"{m} -> {o}" for m, outs in sorted(_graph().items()) if m != "fshard"
          for o in sorted(outs) if _layer(o) is not None and _layer(m) is not None
          and _layer(o) > _layer(m)]
    assert not up, "imports from a lower layer into a higher one:\n" + "\n".join(up)


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    state: dict = {}
    cycles = []

    def visit(m, path):
        state[m] = "open"
        for o in sorted(graph[m]):
            if state.get(o) == "open":
                cycles.append(path[path.index(o):] + [o])
            elif o not in state:
                visit(o, path + [o])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_layer_check_sees_function_level_imports(tmp_path):
    mods = _modules()
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    import fshard.core.ir\n"
                   "def f():\n    from fshard.primitives import structural\n"
                   "    import fshard.core.tree\n")
    assert _imports(src, mods) == {"fshard.primitives.structural", "fshard.core.tree"}


def test_fshard_names_its_own_modules_by_their_file_paths():
    # fshard/__init__.py keeps the public short paths (fshard.optim, fshard.tree, ...)
    # importable for users; inside the library every import names a module's real path,
    # which is what the layer check above reads.
    mods = _modules()
    bad = []
    for m, path in sorted(mods.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module.split(".")[0] == "fshard"):
                if node.module not in mods:
                    bad.append(f"{m}: from {node.module} import ...")
                elif node.module == "fshard":
                    bad += [f"{m}: from fshard import {a.name}" for a in node.names
                            if f"fshard.{a.name}" not in mods]
            elif isinstance(node, ast.Import):
                bad += [f"{m}: import {a.name}" for a in node.names
                        if a.name.split(".")[0] == "fshard" and a.name not in mods]
    assert not bad, "imports of paths that are not files of fshard:\n" + "\n".join(bad)


def test_the_public_module_paths_stay_importable():
    import fshard.tree
    from fshard.checkpoint import CheckpointManager, save
    from fshard.optim import adam

    from fshard.parallel import ParallelMode
    from fshard.parallel.ms_optimizers import from_mindspore

    assert fshard.tree is fs.tree and save is fs.checkpoint.save
    assert ParallelMode is fs.parallel.ParallelMode
    assert from_mindspore is fs.parallel.ms_optimizers.from_mindspore
    assert adam is fs.optim.adam and CheckpointManager is fs.checkpoint.CheckpointManager
    for name in ("dtypes", "rules", "distributed", "amp", "nn", "random", "ops", "debug",
                 "errors", "parallel", "launch", "testing", "profiling", "transforms"):
        mod = importlib.import_module(f"fshard.{name}")
        assert getattr(fs, name, mod) is mod, name


def test_the_layer_picture_is_current():
    spec = importlib.util.spec_from_file_location("gen_layers", ROOT / "docs" / "gen_layers.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "layers.svg").read_text() == gen.render(), (
        "docs/layers.svg is stale: run `python docs/gen_layers.py`")


def test_core_stays_small():
    # A line budget keeps the core readable (autodidax is ~3k lines in all).
    budget = {"tracing.py": 400, "ir.py": 250, "rules.py": 200, "interpret.py": 150,
              "staging.py": 350}
    for name, limit in budget.items():
        n = len((ROOT / "fshard" / "core" / name).read_text().splitlines())
        assert n <= limit, f"fshard/core/{name} has {n} lines (budget {limit})"


def test_functional_cell_applies_eagerly_with_new_parameters():
    from mindspore import Tensor, nn

    net = nn.SequentialCell([nn.Dense(3, 4), nn.ReLU(), nn.Dense(4, 2)])
    apply, params = fs.functional(net)
    x = Tensor(np.ones((5, 3), np.float32))
    ones = {k: Tensor(np.ones(v.shape, np.float32)) for k, v in params.items()}
    np.testing.assert_allclose(apply(ones, x).asnumpy(), np.full((5, 2), 17.0))
    np.testing.assert_allclose(apply(params, x).asnumpy(), net(x).asnumpy())
