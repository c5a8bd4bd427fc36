"""Every notebook in ``notebooks/`` runs from top to bottom, and its two paired forms
(jupytext: ``.py`` in percent format and ``.ipynb``) hold the same cells.

Notebooks execute in a Jupyter kernel (nbclient, kernel ``python3``: the kernel spec
installed in this environment, which runs this interpreter), in the notebooks
directory, exactly as a reader would run them. A new notebook is picked up
automatically.

Every notebook is stored executed, with its outputs, and draws at least one plot: the
stored form is checked in the quick run; re-executing every notebook (the full matrix)
fails if a plot disappears.
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


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
               for o in c.get("outputs", []))


@pytest.mark.parametrize("path", IPYNB, ids=_ids(IPYNB))
def test_notebook_is_stored_with_outputs_and_a_plot(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), (
        f"{path.name} is stored unexecuted: run it and save it with its outputs")
    assert _images(nb) >= 1, f"{path.name} shows no plot"


@pytest.mark.full
@pytest.mark.parametrize("path", IPYNB, ids=_ids(IPYNB))
def test_notebook_runs(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    stored_images = _images(nb)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    # MindSpore's log lines go to the kernel's stderr, not into the notebook
    env = dict(os.environ, GLOG_v="3")
    client.execute(env=env)  # raises CellExecutionError, naming the cell, on any error
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert _images(nb) >= max(stored_images, 1), (
        f"{path.name} drew {_images(nb)} plots; its stored form has {stored_images}")


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
