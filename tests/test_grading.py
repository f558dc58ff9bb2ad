"""The otter pipeline: generated copies are fresh, exercises never crash, grading is fair."""
import csv
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from dtlib import grading

ROOT = Path(__file__).resolve().parent.parent


def test_every_master_has_fresh_generated_copies():
    assert grading.masters(), "no masters found"
    assert grading.check() == [], "run `make exercises` and commit the result"


@pytest.mark.parametrize("path", sorted((ROOT / "exercises").glob("*.ipynb")), ids=lambda p: p.name)
def test_unsolved_exercise_runs_and_reports_failures(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    checks = [c for c in nb.cells if c.cell_type == "code" and "grader.check(" in c.source]
    assert checks
    for cell in checks:  # each check shows a result, and for a stub it is a failure
        shown = str(cell.outputs)
        assert "failed" in shown.lower() or "❌" in shown, shown[:500]


@pytest.mark.parametrize("master", grading.masters(), ids=lambda p: p.stem)
def test_batch_grading_solved_full_unsolved_zero(tmp_path, master):
    subs = tmp_path / "submissions"
    subs.mkdir()
    (subs / "solved.ipynb").write_text((ROOT / "solutions" / master.name).read_text())
    (subs / "stub.ipynb").write_text((ROOT / "exercises" / master.name).read_text())
    out = tmp_path / "grades.csv"
    assert grading.main(["grade", str(subs), "--lesson", master.name[:2], "--out", str(out)]) == 0
    rows = {r["submission"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"solved.ipynb", "stub.ipynb"}
    assert float(rows["solved.ipynb"]["total"]) == float(rows["solved.ipynb"]["possible"]) > 0
    assert float(rows["stub.ipynb"]["total"]) == 0
    assert "q1" in rows["solved.ipynb"]


def test_grading_bad_input(tmp_path, capsys):
    assert grading.main(["grade", str(tmp_path), "--lesson", "01"]) == 2
    assert "no .ipynb files" in capsys.readouterr().err
    with pytest.raises(ValueError, match="valid lessons"):
        grading.pipeline._master_for("99")
