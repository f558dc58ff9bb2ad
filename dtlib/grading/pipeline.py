"""The graded-notebook pipeline, on top of otter-grader.

One source of truth per graded lesson: an otter-assign master in ``masters/NN_name.ipynb``.

* ``python -m dtlib.grading assign``  regenerate ``exercises/`` (learner copies) and
  ``solutions/`` (solved copies) from every master;
* ``python -m dtlib.grading check``   fail if a committed copy differs from what its master
  generates (CI runs this through ``tests/test_grading.py``);
* ``python -m dtlib.grading grade SUBMISSIONS --lesson 01 --out grades.csv``  grade a folder
  of submitted notebooks into one CSV (one row per file, one column per question; see
  :mod:`dtlib.grading.batch`).

The masters are found in ``--masters DIR``, else ``$DTLIB_MASTERS``, else the ``masters/`` that
:func:`dtlib.course.course_root` finds: the wheel's copy, or the source checkout's. ``exercises/``
and ``solutions/`` are the masters folder's siblings.

Grading runs otter's non-containerised grader (``otter.api.grade_submission``) in the current
environment, so an instructor needs no Docker; the autograder zip is built from the master on the
fly, so it can never be stale.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import io
import os
import shutil
import sys
import tempfile
from pathlib import Path

import nbformat

from dtlib.course import course_root
from dtlib.grading import batch, grades_csv

MASTERS_ENV = "DTLIB_MASTERS"

__all__ = ["MASTERS_ENV", "masters_dir", "masters", "assign", "generate", "check", "grade", "normalise"]


def masters_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The folder of masters: ``explicit``, else ``$DTLIB_MASTERS``, else the install's or checkout's."""
    if explicit is not None:
        where, how = Path(explicit), "--masters"
    elif os.environ.get(MASTERS_ENV):
        where, how = Path(os.environ[MASTERS_ENV]), f"${MASTERS_ENV}"
    else:  # the install's (dtlib/course_files/) or the checkout's: dtlib.course finds them
        try:
            where, how = course_root() / "masters", None
        except ValueError as exc:
            raise ValueError(f"no masters/ folder found: {exc}. Pass --masters PATH or set {MASTERS_ENV}=PATH "
                             "to the course's masters/ folder") from None
    if not where.is_dir():
        raise ValueError(f"{how} points at {str(where)!r}, which is not a folder")
    return where


def masters(folder: str | os.PathLike | None = None) -> list[Path]:
    """All master notebooks (in :func:`masters_dir`), sorted by lesson number."""
    return sorted(masters_dir(folder).glob("[0-9][0-9]_*.ipynb"))


def _master_for(lesson: str, folder: str | os.PathLike | None = None) -> Path:
    found = [m for m in masters(folder) if m.name.startswith(f"{lesson}_") or m.stem == lesson]
    if len(found) != 1:
        valid = ", ".join(m.name[:2] for m in masters(folder))
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
    """``otter assign --no-run-tests --no-pdfs master out``, in this process: otter's import
    costs seconds and its work a tenth of one, so thirteen masters in thirteen interpreters
    spent two minutes importing."""
    from otter.assign import main as otter_assign  # the course extra's; imported when grading

    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            otter_assign(str(master.resolve()), str(out.resolve()), no_pdfs=True, no_run_tests=True)
    except Exception as exc:
        raise RuntimeError(f"otter assign failed for {master.name}: {exc}\n{said.getvalue()}") from exc


_ASSIGNED: dict[tuple[str, str], Path] = {}


def _assigned(master: Path) -> Path:
    """The folder otter assign wrote for ``master``, run once per master content in a process:
    checking the copies and grading a folder need the same output, and each run costs seconds."""
    key = (str(master.resolve()), hashlib.sha256(master.read_bytes()).hexdigest())
    if key not in _ASSIGNED:
        out = Path(tempfile.mkdtemp(prefix=f"dtlib-assign-{master.stem}-"))
        atexit.register(shutil.rmtree, out, ignore_errors=True)
        _otter_assign(master, out)
        _ASSIGNED[key] = out
    return _ASSIGNED[key]


def generate(master: Path) -> dict[str, nbformat.NotebookNode]:
    """Run otter assign on ``master``; return the normalised learner and solved notebooks."""
    workdir = _assigned(master)
    read = lambda p: normalise(nbformat.read(p, as_version=4))  # noqa: E731
    return {"exercise": read(workdir / "student" / master.name),
            "solution": read(workdir / "autograder" / master.name)}


def _copies(master: Path) -> tuple[tuple[str, Path], ...]:
    """Where the generated copies of ``master`` live: its folder's siblings."""
    course = master.parent.parent
    return (("exercise", course / "exercises" / master.name),
            ("solution", course / "solutions" / master.name))


def assign(selected: list[Path] | None = None, folder: str | os.PathLike | None = None) -> list[Path]:
    """Regenerate exercises/ and solutions/ from the masters; returns the files written."""
    written = []
    for master in selected or masters(folder):
        copies = generate(master)
        for kind, path in _copies(master):
            path.parent.mkdir(exist_ok=True)
            nbformat.write(copies[kind], path)
            written.append(path)
    return written


def check(folder: str | os.PathLike | None = None) -> list[str]:
    """Generated copies that are missing or differ from what their master generates."""
    stale = []
    for master in masters(folder):
        copies = generate(master)
        for kind, path in _copies(master):
            if not path.exists() or nbformat.read(path, as_version=4) != copies[kind]:
                stale.append(str(path.relative_to(master.parent.parent)))
    return stale


def grade(submissions: str | os.PathLike, lesson: str, out_csv: str | os.PathLike,
          timeout: float | None = None, jobs: int = 1,
          folder: str | os.PathLike | None = None, cpu_time: float = batch.DEFAULT_CPU_TIME) -> list[dict]:
    """Grade every file in ``submissions`` for ``lesson`` (see :func:`dtlib.grading.batch.grade`):
    ``cpu_time`` CPU seconds per child of a submission (:data:`dtlib.grading.batch.DEFAULT_CPU_TIME`),
    ``timeout`` ``None``: :func:`dtlib.grading.batch.wall_limit` of ``cpu_time``."""
    files = batch.submission_files(submissions)  # bad arguments fail before otter assign runs
    batch.check_options(timeout, jobs, cpu_time)
    grades_csv.check_out_path(out_csv)
    master = _master_for(lesson, folder)
    zips = list((_assigned(master) / "autograder").glob("*.zip"))
    if len(zips) != 1:
        raise RuntimeError(f"otter assign produced {len(zips)} autograder zips for {master.name}")
    return batch.grade(files, zips[0], master.name, out_csv, timeout, jobs, master=master, cpu_time=cpu_time)


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line, like every other error of this command."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (see '{self.prog} --help')")


def main(argv: list[str] | None = None, prog: str = "python -m dtlib.grading") -> int:
    """The command line; ``prog`` names it in help and errors (``dtlib`` for ``dtlib grade``)."""
    # --masters is accepted before or after the command (SUPPRESS: an absent one sets nothing).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--masters", metavar="DIR", default=argparse.SUPPRESS,
                        help=f"folder of master notebooks (default: ${MASTERS_ENV}, else the installed "
                             "course's, or the source checkout's masters/)")
    parser = _Parser(prog=prog, description=__doc__.split("\n\n")[0], parents=[common])
    sub = parser.add_subparsers(dest="command", required=True)
    p_assign = sub.add_parser("assign", parents=[common], help="regenerate exercises/ and solutions/ from masters/")
    p_assign.add_argument("lessons", nargs="*", help="lesson numbers (default: all)")
    sub.add_parser("check", parents=[common], help="exit 1 if a generated copy is stale")
    p_grade = sub.add_parser("grade", parents=[common], help="grade a folder of submitted notebooks into a CSV")
    p_grade.add_argument("submissions", help="folder holding the submitted notebooks (every file gets a row)")
    p_grade.add_argument("--lesson", required=True, help="lesson number, e.g. 01")
    p_grade.add_argument("--out", default="grades.csv", help="CSV to write (default grades.csv)")
    p_grade.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                         help="wall-clock limit per submission; it stops only what waits forever "
                              "(default 10 x --cpu-time + 60)")
    p_grade.add_argument("--cpu-time", type=float, default=batch.DEFAULT_CPU_TIME, metavar="SECONDS",
                         help="CPU seconds a submission's execution, and its verdict, may each use (all "
                              "their processes together as root, else per process); machine load does "
                              f"not change it (default {batch.DEFAULT_CPU_TIME:g}: 2.5 x the 120 CPU-s a "
                              f"whole lesson notebook gets in the test suite; 1 to {batch.MAX_CPU_TIME:g}; "
                              "no way to turn it off: raise it for a slow lesson)")
    p_grade.add_argument("--jobs", type=int, default=1, metavar="N",
                         help="submissions graded at once (default 1; each runs its own kernel and "
                              "ranks, so keep N below the number of cores)")
    try:
        args = parser.parse_args(argv)
        folder = getattr(args, "masters", None)
        if args.command == "assign":
            selected = [_master_for(lesson, folder) for lesson in args.lessons]
            for path in assign(selected or None, folder):
                print(f"wrote {path}")
        elif args.command == "check":
            stale = check(folder)
            for name in stale:
                print(f"stale: {name} (run `python -m dtlib.grading assign`)")
            return 1 if stale else 0
        else:
            rows = grade(args.submissions, args.lesson, args.out, args.timeout, args.jobs, folder, args.cpu_time)
            statuses = [row["status"] for row in rows]
            counts = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
            print(f"wrote {args.out}: {len(rows)} submissions ({counts})")
    except (ValueError, RuntimeError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
