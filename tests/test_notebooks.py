"""Committed notebooks: no outputs, no widget state, the plain python3 kernel; lessons teach."""
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALL = sorted(p for d in ("notebooks", "exercises", "solutions", "masters") for p in (ROOT / d).glob("*.ipynb"))
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_there_are_lessons():
    assert len(LESSONS) >= 2


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_clean(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "widgets" not in nb["metadata"], "widget state committed"
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, "outputs committed"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_structure(path):
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    for section in ("Learning goals", "What the real frameworks do", "Exercise"):
        assert section in text, f"{path.name} lacks a '{section}' section"
    assert "seed" in text, f"{path.name} should seed its randomness"


def test_dtlib_figures_render_as_pictures_in_a_kernel():
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from dtlib.viz.training import plot_losses\nplot_losses({'run': [3.0, 2.0, 1.0]})")])
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert len(outputs) == 1 and "image/png" in outputs[0]["data"]
