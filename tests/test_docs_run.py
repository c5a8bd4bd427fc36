"""Every page's code runs as pasted: the ```python blocks of README.md and docs/*.md,
page by page, each page in a fresh interpreter (its blocks in order, in one namespace,
as if pasted one after the other), at the repository root with FSHARD_DEVICES=8.

Warnings are errors, as in the suite (a page whose example warns shows the reader a
warning the text does not explain). A bare top-level expression prints its value, as
at the interpreter's prompt; a ``>>>`` session (how a page shows an error) runs as a
doctest and its output is compared. A block that is not meant to run as pasted (a
multi-process job, an excerpt of a source file, a warning shown as printed) carries the
comment ``<!-- no-run: reason -->`` on the line before its fence; see
docs/adding_a_primitive.md, "Code blocks in the docs".
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A fence opens with ```python (indented inside a list or an admonition, too); the line
# before it may mark the block with <!-- no-run: reason -->.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
_NO_RUN = re.compile(r"^[ \t]*<!--\s*no-run:\s*(?P<reason>.*?)\s*-->[ \t]*$")

# Each page costs an interpreter start and MindSpore's import (about 2-4 s on two
# cores) plus its examples. The quick run keeps the pages a newcomer reads first (the
# index and the four transforms, 2.5-4 s each, ~20 s together); every other page runs
# with --full.
QUICK = {"index.md", "jit.md", "vmap.md", "autodiff.md", "shard.md", "shard_map.md"}
FULL_ONLY = {p.name for p in PAGES} - QUICK

# Pages whose examples do not run as pasted yet, each xfailed strictly (it fails as
# soon as the page runs, until it is removed from here). Every page runs now.
NOT_YET: set[str] = set()


def code_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """The page's ```python blocks as ``(line, code, no_run_reason)``, in order: ``line``
    is the fence's 1-based line number, ``code`` the block dedented by its fence's
    indentation, ``no_run_reason`` the reason of a ``<!-- no-run: ... -->`` mark on the
    line before the fence (None when the block runs)."""
    lines, blocks, i = text.split("\n"), [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, indent = i, m["indent"]
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i])
            i += 1
        mark = _NO_RUN.match(lines[start - 1]) if start else None
        blocks.append((start + 1, textwrap.dedent("\n".join(body)) if indent else
                       "\n".join(body), mark["reason"] if mark else None))
        i += 1
    return blocks


# Runs in the fresh interpreter: the suite's warning filters (pyproject's
# filterwarnings), then each block in one namespace, as pasted at the prompt (a bare
# top-level expression such as `mesh.shape  # (2, 4)` prints its value; a `>>>`
# session is run as a doctest, its output compared); on an error it names the block.
_RUNNER = r"""
import ast, doctest, json, sys, traceback, warnings
warnings.simplefilter("error")
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="mindspore")
warnings.filterwarnings("ignore", category=RuntimeWarning, module="mindspore")
page, blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__main__"}
for line, code in blocks:
    try:
        if code.lstrip().startswith(">>>"):   # a console session: its output is checked
            test = doctest.DocTestParser().get_doctest(code, {}, page, page, line)
            test.globs = namespace            # (get_doctest copies the namespace)
            runner = doctest.DocTestRunner(
                optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, clear_globs=False)
            if runner.failures:
                raise AssertionError(f"{runner.failures} example(s) printed otherwise")
            continue
        # as the interactive interpreter shows it, a top-level bare expression prints
        # its value (only top-level ones: a loop's calls are not echoed)
        for stmt in ast.parse(code).body:
            tree, mode = ((ast.Interactive(body=[stmt]), "single")
                          if isinstance(stmt, ast.Expr) else
                          (ast.Module(body=[stmt], type_ignores=[]), "exec"))
            exec(compile(tree, f"{page}:{line}", mode), namespace)
    except BaseException:
        sys.stdout.flush()
        first = next((s for s in code.splitlines() if s.strip()), "")
        print(f"\n{page}: the block at line {line} ({first!r}) failed:", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def _param(page: Path):
    marks = []
    if page.name in FULL_ONLY:
        marks.append(pytest.mark.full)
    if page.name in NOT_YET:
        marks.append(pytest.mark.xfail(strict=True, reason="examples not fixed yet"))
    return pytest.param(page, marks=marks, id=page.name)


def test_no_run_marks_are_rare_and_give_a_reason():
    for page in PAGES:
        blocks = code_blocks(page.read_text())
        skipped = [(line, why) for line, _, why in blocks if why is not None]
        for line, why in skipped:
            assert why, f"{page.name}:{line}: a no-run mark needs its reason"
        assert len(skipped) <= max(1, len(blocks) // 2), \
            f"{page.name}: {len(skipped)} of {len(blocks)} blocks do not run"
        # the page opens with a complete runnable example
        if blocks:
            assert blocks[0][2] is None, f"{page.name}: its first block does not run"


def test_code_blocks_reads_marks_and_indented_fences():
    text = ("x\n```python\na = 1\n```\n<!-- no-run: a job script -->\n```python\n"
            "b = 2\n```\n- item\n\n    ```python\n    c = 3\n    ```\n")
    assert code_blocks(text) == [(2, "a = 1", None), (6, "b = 2", "a job script"),
                                 (11, "c = 3", None)]


def _run(name: str, text: str) -> subprocess.CompletedProcess:
    """Run the page ``text``'s blocks (those not marked no-run) in a fresh interpreter."""
    blocks = [(line, code) for line, code, why in code_blocks(text) if why is None]
    env = {**os.environ, "FSHARD_DEVICES": "8"}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", _RUNNER], cwd=ROOT, env=env,
                          input=json.dumps([name, blocks]), capture_output=True,
                          text=True, timeout=600)


def test_a_failing_block_is_named_with_its_page_and_first_line():
    """The runner itself (no MindSpore import: fast): a NameError, a warning, and a
    console session whose output differs each fail, naming the block; a no-run block
    and a matching session pass."""
    ok = ("```python\nx = 2\n```\n<!-- no-run: a sketch -->\n```python\nundefined\n```\n"
          "```python\n>>> x + 1\n3\n```\n")
    assert _run("ok.md", ok).returncode == 0
    for body, message in [("y = 1\nprint(missing)", "NameError"),
                          ("import warnings\nwarnings.warn('w')", "UserWarning"),
                          (">>> 1 + 1\n3", "printed otherwise")]:
        out = _run("bad.md", f"text\n\n```python\n{body}\n```\n")
        assert out.returncode == 1
        first = body.splitlines()[0]
        assert f"bad.md: the block at line 3 ({first!r}) failed" in out.stderr, out.stderr
        assert message in out.stderr


@pytest.mark.parametrize("page", [_param(p) for p in PAGES
                                  if any(why is None for _, _, why in
                                         code_blocks(p.read_text()))])
def test_page_runs_as_pasted(page):
    out = _run(page.name, page.read_text())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
