"""Every notebook in ``notebooks/`` runs from top to bottom, and its two paired forms
(jupytext: ``.py`` in percent format and ``.ipynb``) hold the same cells.

Notebooks execute in a Jupyter kernel (nbclient, kernel ``python3``: the kernel spec
installed in this environment, which runs this interpreter), in the notebooks
directory, exactly as a reader would run them. A new notebook is picked up
automatically.
"""

from __future__ import annotations

import os
import pathlib

import nbformat
import pytest

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
IPYNB = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
PY = sorted(NOTEBOOKS_DIR.glob("*.py"))


def _ids(paths):
    return [p.stem for p in paths]


def test_there_are_notebooks():
    assert IPYNB, f"no notebooks found in {NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", IPYNB, ids=_ids(IPYNB))
def test_notebook_runs(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    # MindSpore's log lines go to the kernel's stderr, not into the notebook
    env = dict(os.environ, GLOG_v="3")
    client.execute(env=env)  # raises CellExecutionError, naming the cell, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


def _sources(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("path", IPYNB, ids=_ids(IPYNB))
def test_paired_forms_agree(path):
    import jupytext

    py = path.with_suffix(".py")
    assert py.exists(), (f"{path.name} has no paired {py.name}: pair it with "
                         f"`jupytext --set-formats ipynb,py:percent {path.name}`")
    assert _sources(jupytext.read(py)) == _sources(nbformat.read(path, as_version=4)), (
        f"{py.name} and {path.name} differ: run `jupytext --sync {py.name}`")


@pytest.mark.parametrize("path", PY, ids=_ids(PY))
def test_every_script_has_its_notebook(path):
    assert path.with_suffix(".ipynb").exists(), (
        f"{path.name} has no paired notebook: run `jupytext --to ipynb {path.name}`")
