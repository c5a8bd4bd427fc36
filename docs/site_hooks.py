"""mkdocs hook: let mkdocstrings read fshard's source as it is installed.

``fshard.transforms`` lives in ``transforms/`` (setuptools' ``package-dir``), so the
source tree does not have the package's layout. Before the build, this hook lays the
layout out in a temporary directory of symbolic links (``fshard/*`` and
``fshard/transforms -> transforms/``) and points mkdocstrings' Python handler at it:
the docstrings are then read statically, without importing fshard or MindSpore.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import griffe
from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parents[1]


def _package_layout() -> str:
    tmp = Path(tempfile.mkdtemp(prefix="fshard-docs-src-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    pkg = tmp / "fshard"
    pkg.mkdir()
    for entry in (ROOT / "fshard").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "transforms").symlink_to(ROOT / "transforms")
    return str(tmp)


@event_priority(100)  # before mkdocstrings reads its handlers' configuration
def on_config(config, **kwargs):
    handlers = config["plugins"]["mkdocstrings"].config["handlers"]
    handlers.setdefault("python", {})["paths"] = [_package_layout()]
    return config


# ---------------------------------------------------------------------------
# Docstring examples: fshard's docstrings carry doctest blocks (``>>> ...`` and the
# expected output) in their text, which Markdown would read as nested quotes and
# ``[a][b]`` reference links. A griffe extension fences each block as Python console
# code before mkdocstrings renders it.
# ---------------------------------------------------------------------------

def fence_doctests(text: str) -> str:
    r"""Wrap every doctest block (a ``>>>`` line through the next blank line) of
    ``text`` in a ``pycon`` code fence, keeping its indentation.

    >>> fence_doctests("Add.\n\n>>> 1 + 1\n2\n\nDone.").splitlines()
    ['Add.', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'Done.']
    """
    out, lines, i = [], text.split("\n"), 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[:len(line) - len(line.lstrip())]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    def on_package(self, *, pkg, **kwargs) -> None:
        seen, todo = set(), [pkg]
        while todo:
            obj = todo.pop()
            if obj.is_alias or id(obj) in seen:
                continue
            seen.add(id(obj))
            if obj.docstring is not None and ">>>" in obj.docstring.value:
                obj.docstring.value = fence_doctests(obj.docstring.value)
            todo.extend(obj.members.values())
