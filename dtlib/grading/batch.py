"""Grade a folder of submissions into one CSV: every file gets a row, whatever it holds.

Each submission is graded by otter's local grader (``otter.api.grade_submission``) in a child
process of its own (:mod:`dtlib.grading.children`), under a budget of CPU seconds (by default
:data:`DEFAULT_CPU_TIME`) and a wall-clock limit derived from it: a notebook that hangs, spins,
crashes its kernel or breaks otter costs only its own row. A row holds ``submission``,
``status``, ``error`` (why, in one line), one column per question, ``total`` and ``possible``;
scores are written with ``:g``.

The points are the isolated verdict's (:mod:`dtlib.grading.verdict`), computed at the same time
in a second child that never runs the submission's top-level code, forked from one pre-imported
parent per batch (:mod:`dtlib.grading.prefork`); otter's in-notebook score is
only compared with it. Both children run walled off (:mod:`dtlib.grading.sandbox`): their own
folder, user, network namespace and limits.

Statuses: ``graded`` (every cell ran), ``cell raised`` (graded; ``error`` names the first cell
that raised), ``cells missing`` (graded; the ``grader.check`` cells of some questions were
deleted), ``tampered`` (graded by the isolated verdict; the in-notebook score differed, ``error``
says where), ``not a notebook`` (not JSON, or not nbformat), ``timed out``, ``grader failed``,
``verdict failed`` (the isolated verdict did not finish: 0 points).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import nbformat

from dtlib.analytic import validate
from dtlib.grading import cgroups, checkouts, children, grades_csv, prefork, rowfiles, sandbox, verdict
from dtlib.grading.grades_csv import first_line

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_CPU_TIME", "MAX_CPU_TIME", "submission_files", "check_options", "wall_limit",
           "grade", "question_points"]

# The checkout this grader runs from: mounted read-only for every child (see sandbox.child_setup).
_CHECKOUT = str(Path(__file__).resolve().parents[2])

DEFAULT_TIMEOUT = 600.0  # seconds for a batch's one-off setup (the master's setup cells, imports)
# CPU seconds each of a submission's two children (execution, verdict) may use, all their processes
# together: 2.5 x the budget a whole lesson notebook gets in the test suite (conftest.py's
# NOTEBOOK_CPU_BUDGET_S, 120 CPU-s: "under a minute on 2 cores"), and the slowest solution's
# execution uses well under that, so an honest notebook never meets it and a busy one costs at most
# this much of the machine, whatever its load. The wall limit derives from it (:func:`wall_limit`).
DEFAULT_CPU_TIME = 300.0
MAX_CPU_TIME = 86400.0  # a day: beyond it no lesson is meant to run (and RLIMIT_CPU stays in range)
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


def _read_notebook(path: Path) -> tuple[nbformat.NotebookNode | None, str]:
    """The notebook, or ``None`` and why it is not one."""
    try:
        # utf-8-sig: a byte-order mark (some editors write one) is not part of the JSON
        nb = nbformat.reads(path.read_bytes().decode("utf-8-sig"), as_version=4)
        nbformat.validate(nb)
    except UnicodeDecodeError:
        return None, "not a text file"
    except Exception as exc:  # nbformat raises JSON, validation and version errors
        return None, first_line(f"{type(exc).__name__}: {exc}")
    return nb, ""


def _missing_checks(nb: nbformat.NotebookNode, questions: list[str]) -> list[str]:
    present = {q for cell in nb.cells if cell.cell_type == "code" for q in _CHECK_CALL.findall(cell.source)}
    return [q for q in questions if q not in present]


def _scores(report: object, questions: dict) -> dict[str, float]:
    """``{question: score}`` from a child's report, keeping finite numbers for known questions only
    (otter's report is written where the submission's own code could overwrite it)."""
    found = report.get("scores") if isinstance(report, dict) else None
    if not isinstance(found, dict):
        return {}
    return {q: float(s) for q, s in found.items()
            if q in questions and isinstance(s, (int, float)) and math.isfinite(s)}


def _disagreement(in_notebook: dict[str, float], isolated: dict[str, float], failures: dict[str, str]) -> str:
    """``"q1 4 in the notebook, 0 isolated (why)"`` for each question whose scores differ."""
    parts = []
    for q, score in isolated.items():
        mine = in_notebook.get(q, 0.0)
        if abs(mine - score) > 1e-9:
            why = failures.get(q)
            parts.append(f"{q} {mine:g} in the notebook, {score:g} isolated" + (f" ({why})" if why else ""))
    return "; ".join(parts)


def _grade_one(path: Path, autograder_zip: Path, master_name: str, points: dict[str, float],
               timeout: float, cpu_time: float, runner: prefork.Forker, forker: prefork.Starting | None,
               setup: list[str],
               index: int = 0, mounts: sandbox.Mounts = sandbox.Mounts()) -> dict:
    row: dict = {"submission": path.name, "status": "graded", "error": ""}
    scores = dict.fromkeys(points, 0.0)
    nb, why = _read_notebook(path)
    if nb is None:
        row.update(status="not a notebook", error=why)
    elif not any(cell.cell_type == "code" for cell in nb.cells):
        row.update(status="cells missing", error="no code cells: every cell was deleted")
    else:
        cells = verdict.question_cells(nb, list(points), setup)
        uids = sandbox.submission_user(2 * index), sandbox.submission_user(2 * index + 1)
        tmp = tempfile.mkdtemp(prefix="dtlib-row-")  # 0700, made with O_EXCL
        try:
            os.chmod(tmp, 0o711)  # the children may reach their own folders inside, not list it
            # otter grades a notebook named like the master; submissions may be named by student.
            target = Path(tmp) / master_name
            rowfiles.create_private(target, nbformat.writes(nb).encode())
            own = dataclasses.replace(mounts, reach=(*mounts.reach, tmp))  # of /tmp, only its own folder
            report, status, why, isolated, why_verdict = children.run_children(
                autograder_zip, target, runner, forker, cells, timeout, cpu_time, Path(tmp), uids, own)
        finally:
            rowfiles.remove_tree(tmp)  # whatever the row left there (1,500 nested folders included)
        if report is None:
            row.update(status=status, error=why)
        elif forker is not None and isolated is None:
            row.update(status="verdict failed", error=why_verdict)
        else:
            in_notebook = _scores(report, scores)
            scores.update(in_notebook if forker is None else _scores(isolated, scores))
            differ = _disagreement(in_notebook, _scores(isolated, scores), isolated.get("failures", {})) \
                if forker is not None else ""
            missing = _missing_checks(nb, list(points))
            if differ:
                row.update(status="tampered", error=f"in-notebook and isolated scores differ: {differ}")
            elif missing:
                row.update(status="cells missing", error=f"no grader.check cell for {', '.join(missing)}")
            elif isinstance(report, dict) and report.get("cell_error"):
                row.update(status="cell raised", error=first_line(str(report["cell_error"]), 300))
    row.update({q: f"{s:g}" for q, s in scores.items()})
    row.update(total=f"{sum(scores.values()):g}", possible=f"{sum(points.values()):g}")
    return row


def _failed_row(name: str, points: dict[str, float], why: str) -> dict:
    """The row of a submission whose grading itself raised: 0 points, ``grader failed``."""
    return {"submission": name, "status": "grader failed", "error": why, **{q: "0" for q in points},
            "total": "0", "possible": f"{sum(points.values()):g}"}


def submission_files(submissions: str | os.PathLike) -> list[Path]:
    """Every file in the folder, hidden ones (``.DS_Store``, ``.ipynb_checkpoints``) aside."""
    folder = Path(submissions)
    if not folder.is_dir():
        raise ValueError(f"SUBMISSIONS {str(folder)!r} is not a folder: point at a folder of submitted notebooks")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ValueError(f"no files in {str(folder)!r}: point at a folder of submitted notebooks")
    return files


def wall_limit(timeout: float | None, cpu_time: float) -> float:
    """``timeout`` if given; else ten times the CPU budget plus a minute (a submission that gets a
    tenth of a core on a loaded machine still finishes: the CPU budget, not the clock, is what
    stops a busy one; the wall limit stops only what waits forever)."""
    return timeout if timeout is not None else 10 * cpu_time + 60


def check_options(timeout: float | None, jobs: int, cpu_time: float = DEFAULT_CPU_TIME) -> None:
    """Clear errors, naming the flag, for a time limit or a number of parallel gradings that cannot work."""
    try:
        if timeout is not None:
            validate.number("timeout", timeout)
        validate.integer("jobs", jobs, minimum=1)
        validate.number("cpu-time", cpu_time, minimum=1, exclusive=False, maximum=MAX_CPU_TIME)
    except validate.InvalidArgument as exc:
        raise exc.renamed(f"--{exc.name}") from None


def grade(files: list[Path], autograder_zip: Path, master_name: str, out_csv: str | os.PathLike,
          timeout: float | None = None, jobs: int = 1,
          progress: Callable[[str], None] | None = None, master: Path | None = None,
          cpu_time: float = DEFAULT_CPU_TIME) -> list[dict]:
    """Grade each of ``files``, ``jobs`` at a time; write and return one row each, in file order.

    With ``master`` (the master notebook), the points are the isolated verdict's; without it,
    otter's in-notebook score (forgeable: only for a quick look). ``cpu_time`` is the CPU seconds
    each of a submission's two children may use, all their processes together where a
    CPU-accounting cgroup can be made (root), else per process: unlike the wall clock, the
    machine's load does not change it. ``timeout`` is each submission's wall-clock limit (``None``:
    :func:`wall_limit` of ``cpu_time``).
    Progress goes to stderr by default: the isolation used, a line when a file starts (how many
    are left after it) and one with its score and status when it is done.
    """
    check_options(timeout, jobs, cpu_time)
    grades_csv.check_out_path(out_csv)
    timeout = wall_limit(timeout, cpu_time)
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    # What no submission may read (the other submissions, the masters and solutions) or change.
    course = master.parent.parent.resolve() if master else None
    hidden = {files[0].parent.resolve(), *([master.parent.resolve(), course / "solutions"] if master else [])}
    trees = [_CHECKOUT, *([str(course)] if course else [])]
    logs = tempfile.mkdtemp(prefix="dtlib-batch-")
    mounts = sandbox.Mounts(hidden=tuple(dict.fromkeys([*(str(p) for p in hidden if p.is_dir()),
                                                        *checkouts.secrets(*trees)])),
                            read_only=tuple(dict.fromkeys(trees)),
                            reach=(logs,))  # each row adds its own folder
    progress(sandbox.isolation(mounts, cpu_time))
    if master is None:
        progress("warning: no master given: scores are otter's in-notebook ones, which a submission can forge")
    points = question_points(autograder_zip)
    setup = verdict.setup_sources(nbformat.read(master, as_version=4)) if master else []
    try:
        # The verdicts run where a learner's notebook runs, the course's exercises/ (else an empty
        # folder: never the hidden masters/, which a verdict would keep reaching as its cwd). The
        # setup's own time limit is not a submission's: it imports the checks (and torch), once.
        cwd = master.parent.parent / "exercises" if master else None
        if cwd is None or not cwd.is_dir():
            os.chmod(logs, 0o711)
            cwd = Path(logs) / "cwd"
            cwd.mkdir(mode=0o755)
        # The executions' parent imports otter's grader; the verdicts' parent is forked from it and
        # imports the checks (and torch). The rows start when the executions' parent is ready; each
        # row's verdict waits for its own parent (the checks, the master's setup) while its execution runs.
        pool = ThreadPoolExecutor(max_workers=2)
        runner_starting = pool.submit(prefork.Forker, cwd, Path(logs) / "runner.log", DEFAULT_TIMEOUT)
        starting = (runner_starting,  # the verdicts' parent is forked from it, once it is ready
                    pool.submit(lambda: prefork.Forker(cwd, Path(logs) / "setup.log", DEFAULT_TIMEOUT, setup,
                                                       runner_starting.result())) if master else None)
        pool.shutdown(wait=False)
        try:
            runner = starting[0].result()  # raises why it could not start
            forker = prefork.Starting(starting[1]) if master else None
            rows = _grade_all(files, autograder_zip, master_name, points, timeout, cpu_time, runner, forker, setup,
                              jobs, mounts, progress)
            if master:
                starting[1].result()  # a master whose setup fails is the batch's error, not its rows'
        finally:
            for future in starting:
                if future and not future.exception():
                    future.result().close()
    finally:
        rowfiles.remove_tree(logs)
    cgroups.sweep_groups(f"dtlib-grade-{os.getpid()}-")
    grades_csv.write(rows, out_csv)
    return rows


def _grade_all(files: list[Path], autograder_zip: Path, master_name: str, points: dict[str, float], timeout: float,
               cpu_time: float, runner: prefork.Forker, forker: prefork.Starting | None, setup: list[str],
               jobs: int, mounts: sandbox.Mounts, progress: Callable[[str], None]) -> list[dict]:
    order = itertools.count(1)

    def grade_next(path: Path) -> dict:
        i = next(order)
        where = f"[{i}/{len(files)}] {path.name}"
        progress(f"{where}: grading ({len(files) - i} left after it)")
        start = time.monotonic()
        try:
            row = _grade_one(path, autograder_zip, master_name, points, timeout, cpu_time, runner, forker, setup, i,
                             mounts)
        except Exception as exc:  # noqa: BLE001 - whatever a row did, it costs only that row
            row = _failed_row(path.name, points, first_line(f"{type(exc).__name__}: {exc}"))
        why = f" - {row['error']}" if row["error"] else ""
        progress(f"{where}: {row['total']}/{row['possible']}, {row['status']}{why} "
                 f"({time.monotonic() - start:.0f} s)")
        return row

    # Threads only wait: each grading runs in a child process of its own.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(grade_next, files))

