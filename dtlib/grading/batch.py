"""Grade a folder of submissions into one CSV: every file gets a row, whatever it holds.

Each submission is graded by otter's local grader (``otter.api.grade_submission``) in a child
process of its own, under a wall-clock limit: a notebook that hangs, crashes its kernel or breaks
otter costs only its own row. A row holds ``submission``, ``status``, ``error`` (why, in one
line), one column per question, ``total`` and ``possible``; scores are written with ``:g``.

Statuses: ``graded`` (every cell ran), ``cell raised`` (graded; ``error`` names the first cell
that raised), ``cells missing`` (graded; the ``grader.check`` cells of some questions were
deleted), ``not a notebook`` (not JSON, or not nbformat), ``timed out``, ``grader failed``.
"""
from __future__ import annotations

import csv
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import nbformat

from dtlib.analytic import validate

__all__ = ["DEFAULT_TIMEOUT", "submission_files", "check_options", "grade", "question_points"]

DEFAULT_TIMEOUT = 600.0  # seconds per submission: the slowest solution takes about 60 s
_CHECK_CALL = re.compile(r"""grader\.check\(\s*["'](\w+)["']\s*\)""")


def question_points(autograder_zip: Path) -> dict[str, float]:
    """``{question: points possible}`` from the test files inside otter's autograder zip."""
    from otter.test_files import ExceptionTestFile

    points = {}
    with zipfile.ZipFile(autograder_zip) as zf:
        for name in sorted(zf.namelist()):
            if name.startswith("tests/") and name.endswith(".py"):
                test = ExceptionTestFile.from_string(zf.read(name).decode(), path=name)
                points[test.name] = test.possible
    return points


def _first_line(text: str, limit: int = 200) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _read_notebook(path: Path) -> tuple[nbformat.NotebookNode | None, str]:
    """The notebook, or ``None`` and why it is not one."""
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except UnicodeDecodeError:
        return None, "not a text file"
    except Exception as exc:  # nbformat raises JSON, validation and version errors
        return None, _first_line(f"{type(exc).__name__}: {exc}")
    return nb, ""


def _missing_checks(nb: nbformat.NotebookNode, questions: list[str]) -> list[str]:
    present = {q for cell in nb.cells if cell.cell_type == "code" for q in _CHECK_CALL.findall(cell.source)}
    return [q for q in questions if q not in present]


def _first_cell_error(nb: nbformat.NotebookNode) -> str:
    """``"the cell starting `...`: Type: message"`` for the first cell whose output is an error."""
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "error":
                start = _first_line(cell.source, 60)
                return f"the cell starting `{start}` raised {out['ename']}: {_first_line(out['evalue'])}"
    return ""


def _grade_in_child(autograder_zip: Path, notebook: Path, out_json: Path) -> None:
    """Child process body: grade one notebook, write scores and its first cell error as JSON."""
    from otter.api import grade_submission

    results = grade_submission(str(notebook), str(autograder_zip), quiet=True)
    executed = getattr(results, "notebook", None)
    report = {"scores": {q: results.get_score(q) for q in results.test_files},
              "cell_error": _first_cell_error(executed) if executed is not None else ""}
    out_json.write_text(json.dumps(report))


def _run_child(autograder_zip: Path, notebook: Path, timeout: float,
               workdir: Path) -> tuple[dict | None, str, str]:
    """Grade ``notebook`` in a child process: its report, or ``None``, a status and why.

    The child runs in a session of its own, so a timeout kills it and everything it started
    (the kernel exits when its parent does; ranks die with the kernel). Its output, otter's and
    the kernel's warnings included, goes to a log that only a failure quotes.
    """
    out_json, log_path = workdir / "report.json", workdir / "grader.log"
    cmd = [sys.executable, "-m", "dtlib.grading.batch", str(autograder_zip), str(notebook), str(out_json)]
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                 start_new_session=True)
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return None, "timed out", (f"no result within {timeout:g} s (a cell that never ends?); "
                                       "raise --timeout if it is just slow")
    if code == 0 and out_json.exists():
        return json.loads(out_json.read_text()), "graded", ""
    lines = [s for s in log_path.read_text(errors="replace").splitlines() if s.strip()]
    return None, "grader failed", _first_line(lines[-1] if lines else f"the grader exited with code {code}")


def _grade_one(path: Path, autograder_zip: Path, master_name: str, points: dict[str, float],
               timeout: float) -> dict:
    row: dict = {"submission": path.name, "status": "graded", "error": ""}
    scores = dict.fromkeys(points, 0.0)
    nb, why = _read_notebook(path)
    if nb is None:
        row.update(status="not a notebook", error=why)
    elif not any(cell.cell_type == "code" for cell in nb.cells):
        row.update(status="cells missing", error="no code cells: every cell was deleted")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            # otter grades a notebook named like the master; submissions may be named by student.
            target = Path(tmp) / master_name
            nbformat.write(nb, target)
            report, status, why = _run_child(autograder_zip, target, timeout, Path(tmp))
        if report is None:
            row.update(status=status, error=why)
        else:
            scores.update({q: float(s) for q, s in report["scores"].items() if q in scores})
            missing = _missing_checks(nb, list(points))
            if missing:
                row.update(status="cells missing", error=f"no grader.check cell for {', '.join(missing)}")
            elif report["cell_error"]:
                row.update(status="cell raised", error=report["cell_error"])
    row.update({q: f"{s:g}" for q, s in scores.items()})
    row.update(total=f"{sum(scores.values()):g}", possible=f"{sum(points.values()):g}")
    return row


def submission_files(submissions: str | os.PathLike) -> list[Path]:
    """Every file in the folder, hidden ones (``.DS_Store``, ``.ipynb_checkpoints``) aside."""
    folder = Path(submissions)
    if not folder.is_dir():
        raise ValueError(f"SUBMISSIONS {str(folder)!r} is not a folder: point at a folder of submitted notebooks")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ValueError(f"no files in {str(folder)!r}: point at a folder of submitted notebooks")
    return files


def check_options(timeout: float, jobs: int) -> None:
    """Clear errors, naming the flag, for a time limit or a number of parallel gradings that cannot work."""
    try:
        validate.number("timeout", timeout)
        validate.integer("jobs", jobs, minimum=1)
    except validate.InvalidArgument as exc:
        raise exc.renamed(f"--{exc.name}") from None


def grade(files: list[Path], autograder_zip: Path, master_name: str, out_csv: str | os.PathLike,
          timeout: float = DEFAULT_TIMEOUT, jobs: int = 1,
          progress: Callable[[str], None] | None = None) -> list[dict]:
    """Grade each of ``files``, ``jobs`` at a time; write and return one row each, in file order.

    Progress goes to stderr by default: a line when a file starts (how many are left after it)
    and one with its score and status when it is done.
    """
    check_options(timeout, jobs)
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    points = question_points(autograder_zip)
    order = itertools.count(1)

    def grade_next(path: Path) -> dict:
        i = next(order)
        where = f"[{i}/{len(files)}] {path.name}"
        progress(f"{where}: grading ({len(files) - i} left after it)")
        start = time.monotonic()
        row = _grade_one(path, autograder_zip, master_name, points, timeout)
        why = f" - {row['error']}" if row["error"] else ""
        progress(f"{where}: {row['total']}/{row['possible']}, {row['status']}{why} "
                 f"({time.monotonic() - start:.0f} s)")
        return row

    # Threads only wait: each grading runs in a child process of its own.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(grade_next, files))
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


if __name__ == "__main__":
    _grade_in_child(*map(Path, sys.argv[1:4]))
