"""An execution's body: otter's grader on one notebook, in a process forked from the batch's
pre-imported execution parent (:mod:`dtlib.grading.prefork`) and walled off
(:mod:`dtlib.grading.sandbox`). Apart from :mod:`dtlib.grading.batch`, which starts the parents:
the forked process imports only this."""
from __future__ import annotations

import json
from pathlib import Path

import nbformat

from dtlib.grading.grades_csv import first_line

__all__ = ["grade_in_child"]


def _first_cell_error(nb: nbformat.NotebookNode) -> str:
    """``"the cell starting `...`: Type: message"`` for the first cell whose output is an error."""
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                start = first_line(cell.source, 60)
                return f"the cell starting `{start}` raised {out['ename']}: {first_line(out['evalue'])}"
    return ""


def grade_in_child(autograder_zip: Path, notebook: Path, out_json: Path) -> None:
    """An execution's body (forked by :mod:`dtlib.grading.prefork`, walled off): grade one
    notebook with otter, write its scores and its first cell error as JSON."""
    from otter.api import grade_submission

    results = grade_submission(str(notebook), str(autograder_zip), quiet=True)
    executed = getattr(results, "notebook", None)
    report = {"scores": {q: results.get_score(q) for q in results.test_files},
              "cell_error": _first_cell_error(executed) if executed is not None else ""}
    out_json.write_text(json.dumps(report))
