"""The graded-notebook pipeline, on top of otter-grader.

One source of truth per graded lesson: an otter-assign master in ``masters/NN_name.ipynb``.

* ``python -m dtlib.grading assign``  regenerate ``exercises/`` (learner copies) and
  ``solutions/`` (solved copies) from every master;
* ``python -m dtlib.grading check``   fail if a committed copy differs from what its master
  generates (CI runs this through ``tests/test_grading.py``);
* ``python -m dtlib.grading grade SUBMISSIONS --lesson 01 --out grades.csv``  grade a folder
  of submitted notebooks into one CSV (one row per notebook, one column per question).

Grading runs otter's non-containerised grader (``otter.api.grade_submission``) in the current
environment, so an instructor needs no Docker; the autograder zip is built from the master on the
fly, so it can never be stale.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[2]
MASTERS, EXERCISES, SOLUTIONS = ROOT / "masters", ROOT / "exercises", ROOT / "solutions"

__all__ = ["masters", "assign", "generate", "check", "grade", "normalise"]


def masters() -> list[Path]:
    """All master notebooks, sorted by lesson number."""
    return sorted(MASTERS.glob("[0-9][0-9]_*.ipynb"))


def _master_for(lesson: str) -> Path:
    found = [m for m in masters() if m.name.startswith(f"{lesson}_") or m.stem == lesson]
    if len(found) != 1:
        valid = ", ".join(m.name[:2] for m in masters())
        raise ValueError(f"no single master for lesson {lesson!r}; valid lessons: {valid}")
    return found[0]


def normalise(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Committed form: no outputs, no widget state, plain python3 kernel, stable cell ids."""
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:03d}"
        if cell.cell_type == "code":
            cell["outputs"], cell["execution_count"] = [], None
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.nbformat, nb.nbformat_minor = 4, 5
    return nb


def _otter_assign(master: Path, out: Path) -> None:
    cmd = [sys.executable, "-m", "otter", "assign", "--no-run-tests", "--no-pdfs", str(master), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=master.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"otter assign failed for {master.name}:\n{proc.stdout}\n{proc.stderr}")


def generate(master: Path, workdir: Path) -> dict[str, nbformat.NotebookNode]:
    """Run otter assign on ``master``; return the normalised learner and solved notebooks."""
    _otter_assign(master, workdir)
    read = lambda p: normalise(nbformat.read(p, as_version=4))  # noqa: E731
    return {"exercise": read(workdir / "student" / master.name),
            "solution": read(workdir / "autograder" / master.name)}


def assign(selected: list[Path] | None = None) -> list[Path]:
    """Regenerate exercises/ and solutions/ from the masters; returns the files written."""
    written = []
    for master in selected or masters():
        with tempfile.TemporaryDirectory() as tmp:
            copies = generate(master, Path(tmp))
        for kind, folder in (("exercise", EXERCISES), ("solution", SOLUTIONS)):
            folder.mkdir(exist_ok=True)
            nbformat.write(copies[kind], folder / master.name)
            written.append(folder / master.name)
    return written


def check() -> list[str]:
    """Names of generated copies that are missing or differ from what their master generates."""
    stale = []
    for master in masters():
        with tempfile.TemporaryDirectory() as tmp:
            copies = generate(master, Path(tmp))
        for kind, folder in (("exercise", EXERCISES), ("solution", SOLUTIONS)):
            path = folder / master.name
            if not path.exists() or nbformat.read(path, as_version=4) != copies[kind]:
                stale.append(str(path.relative_to(ROOT)))
    return stale


def grade(submissions: str | os.PathLike, lesson: str, out_csv: str | os.PathLike,
          quiet: bool = True) -> list[dict]:
    """Grade every ``*.ipynb`` in ``submissions`` for ``lesson``; write and return the rows."""
    from otter.api import grade_submission

    files = sorted(glob.glob(os.path.join(submissions, "*.ipynb")))
    if not files:
        raise ValueError(f"no .ipynb files in {submissions!r}: point at a folder of submitted notebooks")
    master = _master_for(lesson)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _otter_assign(master, Path(tmp))
        zips = list((Path(tmp) / "autograder").glob("*.zip"))
        if len(zips) != 1:
            raise RuntimeError(f"otter assign produced {len(zips)} autograder zips for {master.name}")
        for path in files:
            # otter grades a notebook named like the master; submissions may be named by student.
            with tempfile.TemporaryDirectory() as sub:
                target = Path(sub) / master.name
                shutil.copy(path, target)
                results = grade_submission(str(target), str(zips[0]), quiet=quiet)
            row = {"submission": os.path.basename(path)}
            row.update({q: results.get_score(q) for q in sorted(results.test_files)})
            row.update(total=results.total, possible=results.possible)
            rows.append(row)
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlib.grading", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_assign = sub.add_parser("assign", help="regenerate exercises/ and solutions/ from masters/")
    p_assign.add_argument("lessons", nargs="*", help="lesson numbers (default: all)")
    sub.add_parser("check", help="exit 1 if a generated copy is stale")
    p_grade = sub.add_parser("grade", help="grade a folder of submitted notebooks into a CSV")
    p_grade.add_argument("submissions", help="folder holding the submitted .ipynb files")
    p_grade.add_argument("--lesson", required=True, help="lesson number, e.g. 01")
    p_grade.add_argument("--out", default="grades.csv", help="CSV to write (default grades.csv)")
    args = parser.parse_args(argv)
    try:
        if args.command == "assign":
            for path in assign([_master_for(l) for l in args.lessons] or None):
                print(f"wrote {path.relative_to(ROOT)}")
        elif args.command == "check":
            stale = check()
            for name in stale:
                print(f"stale: {name} (run `python -m dtlib.grading assign`)")
            return 1 if stale else 0
        else:
            rows = grade(args.submissions, args.lesson, args.out)
            for row in rows:
                print(f"{row['submission']}: {row['total']:g}/{row['possible']:g}")
            print(f"wrote {args.out}")
    except (ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
