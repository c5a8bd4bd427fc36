"""The docs site builds (mkdocs --strict, the API reference from the docstrings) and every
relative link of the README and docs/ resolves."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _build_site(root: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def test_the_site_builds_strictly(tmp_path):
    """mkdocs (Material) with the API reference rendered from the docstrings by
    mkdocstrings: no broken link, anchor, reference or docstring, every page in the nav."""
    out = _build_site(ROOT, tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for anchor in ("fshard.jit", "fshard.shard", "fshard.Symbol", "fshard.AutoParallel",
                   "fshard.optim.adam", "fshard.checkpoint.save", "fshard.ops.matmul",
                   "fshard.device_put", "fshard.with_sharding_constraint", "fshard.linearize",
                   "fshard.eval_shape", "fshard.profile", "fshard.optim.scale_by_adam",
                   "fshard.training.checkpoint_manager.CheckpointManager"):
        assert f'id="{anchor}"' in api, f"{anchor} is missing from the API reference"
    assert "<blockquote>" not in api  # doctest examples render as code, not quotes
    # public names only: no _private member of any entry (AutoParallel's helpers, ...)
    private = [i for i in re.findall(r'id="(fshard\.[\w.]+)"', api)
               if i.rsplit(".", 1)[-1].startswith("_")]
    assert not private, f"private members in the API reference: {private[:5]}"
    # signatures formatted by Ruff: fs.jit's, too long for one line, one parameter a line
    sig = api.split('id="fshard.jit"', 1)[1].split("</code>", 1)[0]
    assert sig.count("\n") > 5, "fs.jit's signature was not formatted (install ruff)"


@pytest.mark.full  # a second site build (~20 s on two busy cores)
def test_a_broken_link_fails_the_site_build(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "mkdocs.yml", root / "mkdocs.yml")
    (root / "fshard").symlink_to(ROOT / "fshard")
    (root / "transforms").symlink_to(ROOT / "transforms")
    index = root / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](no_such_page.md).\n")
    out = _build_site(root, tmp_path / "site")
    assert out.returncode != 0 and "no_such_page.md" in out.stdout + out.stderr


def test_the_nav_lists_every_page():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f": {page.name}" in nav, f"docs/{page.name} is not in mkdocs.yml's nav"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to missing {target}"


def test_every_public_transform_is_documented_in_a_guide():
    text = "\n".join(p.read_text() for p in PAGES)
    for name in ("jit", "vmap", "grad", "value_and_grad", "jvp", "vjp", "jacfwd", "jacrev",
                 "hessian", "custom_jvp", "custom_vjp", "shard", "shard_map", "make_ir",
                 "visualize_sharding", "Mesh", "Layout", "psum", "all_gather",
                 "psum_scatter", "all_to_all", "ppermute", "axis_index", "device_put",
                 "block_until_ready", "eval_shape", "with_sharding_constraint", "linearize",
                 "disable_jit", "profile"):
        assert f"fs.{name}" in text, f"fs.{name} is not mentioned in README or docs/"


def test_the_site_hook_fences_doctest_examples():
    import doctest
    import importlib.util

    spec = importlib.util.spec_from_file_location("site_hooks", ROOT / "docs" / "site_hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert doctest.testmod(hooks).failed == 0
    assert hooks.fence_doctests("  >>> f(1)\n  [1][2]\n") == "  ```pycon\n  >>> f(1)\n  [1][2]\n  ```\n"
