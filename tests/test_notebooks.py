"""Every notebook in notebooks/ runs from top to bottom."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_shows_its_figures_inline_and_leaves_the_tree_clean(path: Path):
    before = sorted(path.parent.iterdir())
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    # Figures appear in the notebook (an interactive backend), not as files written next to it.
    assert any("image/png" in o.get("data", {}) for o in outputs)
    assert sorted(path.parent.iterdir()) == before
    # Nothing on stderr: no warning (warnings module or logging, as torch's Dynamo logs) reaches the reader.
    stderr = [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    assert not stderr, stderr


def test_a_notebook_warning_would_be_caught():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import warnings; warnings.warn('seen')")])
    NotebookClient(notebook, timeout=60, kernel_name="python3").execute()
    assert any(o.get("name") == "stderr" and "seen" in o.text for o in notebook.cells[0].outputs)
