"""Grade a folder of submissions into one CSV: every file gets a row, whatever it holds.

Each submission is graded by otter's local grader (``otter.api.grade_submission``) in a child
process of its own, under a wall-clock limit: a notebook that hangs, crashes its kernel or breaks
otter costs only its own row. A row holds ``submission``, ``status``, ``error`` (why, in one
line), one column per question, ``total`` and ``possible``; scores are written with ``:g``.

The points are the isolated verdict's (:mod:`dtlib.grading.verdict`), computed at the same time
in a second child that never runs the submission's top-level code; otter's in-notebook score is
only compared with it. Both children run walled off (:mod:`dtlib.grading.sandbox`): their own
folder, user, network namespace and limits.

Statuses: ``graded`` (every cell ran), ``cell raised`` (graded; ``error`` names the first cell
that raised), ``cells missing`` (graded; the ``grader.check`` cells of some questions were
deleted), ``tampered`` (graded by the isolated verdict; the in-notebook score differed, ``error``
says where), ``not a notebook`` (not JSON, or not nbformat), ``timed out``, ``grader failed``,
``verdict failed`` (the isolated verdict did not finish: 0 points).
"""
from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import shutil
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
from dtlib.grading import sandbox, verdict

__all__ = ["DEFAULT_TIMEOUT", "submission_files", "check_options", "grade", "question_points"]

_MAX_REPORT = 1 << 20  # bytes of a child's JSON report read back
# The checkout this grader runs from: mounted read-only for every child (see sandbox.child_setup).
_CHECKOUT = str(Path(__file__).resolve().parents[2])

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


def _child_env(home: Path) -> dict[str, str]:
    """The environment of a walled-off child: ours, with a home and temp folder of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER_", "IPYTHON"))}
    env.update(HOME=str(home), TMPDIR=str(home), JUPYTER_RUNTIME_DIR=str(home / ".jupyter"),
               MPLCONFIGDIR=str(home / ".mpl"), PYTHONDONTWRITEBYTECODE="1")
    return env


def _start(cmd: list[str], home: Path, log_path: Path, uid: int | None, limits: sandbox.Limits,
           cwd: Path, mounts: sandbox.Mounts, stdin: int | None = None, stdout: int | None = None) -> subprocess.Popen:
    group = sandbox.process_group_cap(f"dtlib-grade-{os.getpid()}-{home.parent.name}-{home.name}", limits.processes)
    with open(log_path, "w") as log:
        child = subprocess.Popen(cmd, stdin=stdin, stdout=stdout if stdout is not None else log, stderr=log,
                                 cwd=cwd, env=_child_env(home),
                                 preexec_fn=lambda: sandbox.child_setup(limits, uid, mounts, group))
    child.cgroup = group
    return child


def _stop(child: subprocess.Popen, uid: int | None) -> None:
    """End the child and everything it started: its session, its cgroup, every process of its user."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    sandbox.kill_user(uid)
    sandbox.kill_group(child.cgroup)
    child.wait()
    for _ in range(300):  # orphans of a fork bomb take a while to be reaped
        sandbox.kill_group(child.cgroup)
        sandbox.remove_group(child.cgroup)
        if not os.path.exists(child.cgroup or ""):
            break
        time.sleep(0.1)


def _run_children(autograder_zip: Path, notebook: Path, master: Path | None, cells: dict,
                  timeout: float, workdir: Path, uids: tuple[int | None, int | None],
                  mounts: sandbox.Mounts = sandbox.Mounts()) -> tuple[dict | None, str, str, dict | None, str]:
    """Execute ``notebook`` with otter and, at the same time, compute its isolated verdict.

    Returns otter's report (or ``None``), a status and why, then the verdict (or ``None``) and
    why it failed. Each child has its own user (``uids``) and folder, a session of its own (a
    timeout kills it and all it started) and the limits of :class:`sandbox.Limits`.
    """
    limits = sandbox.Limits(cpu_seconds=max(1, int(timeout) + 5))
    homes = workdir / "execute", workdir / "verdict"
    for home, uid in zip(homes, uids):
        home.mkdir(mode=0o700)
        sandbox.chown_tree(str(home), uid)
    target = homes[0] / notebook.name
    shutil.copy(notebook, target)
    zips = [shutil.copy(autograder_zip, home / autograder_zip.name) for home in homes]
    for home, uid in zip(homes, uids):
        sandbox.chown_tree(str(home), uid)
    out_json, log_path = homes[0] / "report.json", workdir / "grader.log"
    executor = _start([sys.executable, "-m", "dtlib.grading.batch", str(zips[0]), str(target), str(out_json)],
                      homes[0], log_path, uids[0], limits, cwd=homes[0], mounts=mounts)
    judge = None
    if master is not None:
        setup = verdict.setup_sources(nbformat.read(master, as_version=4))
        job = json.dumps({"autograder_zip": str(zips[1]), "setup": setup, "cells": cells})
        judge_cwd = master.parent.parent / "exercises"
        judge = _start([sys.executable, "-P", "-m", "dtlib.grading.verdict"], homes[1],
                       workdir / "verdict.log", uids[1], limits, mounts=mounts,
                       cwd=judge_cwd if judge_cwd.is_dir() else master.parent,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    found, why_verdict = None, ""
    if judge is not None:
        try:
            out, _ = judge.communicate(job.encode(), timeout=timeout)
            if judge.returncode == 0:
                found = json.loads(out[:_MAX_REPORT])
            else:
                why_verdict = f"the verdict process exited with code {judge.returncode}"
        except subprocess.TimeoutExpired:
            why_verdict = f"no verdict within {timeout:g} s"
        except ValueError:
            why_verdict = "the verdict's report was not JSON"
        finally:
            _stop(judge, uids[1])
    try:
        code = executor.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _stop(executor, uids[0])
        return None, "timed out", (f"no result within {timeout:g} s (a cell that never ends?); "
                                   "raise --timeout if it is just slow"), found, why_verdict
    _stop(executor, uids[0])
    if code == 0 and out_json.is_file():
        try:
            with open(out_json, "rb") as f:
                return json.loads(f.read(_MAX_REPORT)), "graded", "", found, why_verdict
        except ValueError:
            pass
    lines = [s for s in log_path.read_text(errors="replace")[-20000:].splitlines() if s.strip()]
    why = _first_line(lines[-1] if lines else f"the grader exited with code {code}")
    return None, "grader failed", why, found, why_verdict


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
               timeout: float, master: Path | None = None, index: int = 0,
               mounts: sandbox.Mounts = sandbox.Mounts()) -> dict:
    row: dict = {"submission": path.name, "status": "graded", "error": ""}
    scores = dict.fromkeys(points, 0.0)
    nb, why = _read_notebook(path)
    if nb is None:
        row.update(status="not a notebook", error=why)
    elif not any(cell.cell_type == "code" for cell in nb.cells):
        row.update(status="cells missing", error="no code cells: every cell was deleted")
    else:
        setup = verdict.setup_sources(nbformat.read(master, as_version=4)) if master else []
        cells = verdict.question_cells(nb, list(points), setup)
        uids = sandbox.submission_user(2 * index), sandbox.submission_user(2 * index + 1)
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o711)  # the children may reach their own folders inside, not list it
            # otter grades a notebook named like the master; submissions may be named by student.
            target = Path(tmp) / master_name
            nbformat.write(nb, target)
            os.chmod(target, 0o600)
            report, status, why, isolated, why_verdict = _run_children(
                autograder_zip, target, master, cells, timeout, Path(tmp), uids, mounts)
        if report is None:
            row.update(status=status, error=why)
        elif master is not None and isolated is None:
            row.update(status="verdict failed", error=why_verdict)
        else:
            in_notebook = _scores(report, scores)
            scores.update(in_notebook if master is None else _scores(isolated, scores))
            differ = _disagreement(in_notebook, _scores(isolated, scores), isolated.get("failures", {})) \
                if master is not None else ""
            missing = _missing_checks(nb, list(points))
            if differ:
                row.update(status="tampered", error=f"in-notebook and isolated scores differ: {differ}")
            elif missing:
                row.update(status="cells missing", error=f"no grader.check cell for {', '.join(missing)}")
            elif isinstance(report, dict) and report.get("cell_error"):
                row.update(status="cell raised", error=_first_line(str(report["cell_error"]), 300))
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
          progress: Callable[[str], None] | None = None, master: Path | None = None) -> list[dict]:
    """Grade each of ``files``, ``jobs`` at a time; write and return one row each, in file order.

    With ``master`` (the master notebook), the points are the isolated verdict's; without it,
    otter's in-notebook score (forgeable: only for a quick look). Progress goes to stderr by
    default: the isolation used, a line when a file starts (how many are left after it) and one
    with its score and status when it is done.
    """
    check_options(timeout, jobs)
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    progress(sandbox.isolation())
    if master is None:
        progress("warning: no master given: scores are otter's in-notebook ones, which a submission can forge")
    points = question_points(autograder_zip)
    order = itertools.count(1)
    # What no submission may read (the other submissions, the masters and solutions) or change.
    course = master.parent.parent.resolve() if master else None
    hidden = {files[0].parent.resolve(), *([master.parent.resolve(), course / "solutions"] if master else [])}
    mounts = sandbox.Mounts(hidden=tuple(str(p) for p in hidden if p.is_dir()),
                            read_only=tuple(dict.fromkeys([_CHECKOUT, *([str(course)] if course else [])])))

    def grade_next(path: Path) -> dict:
        i = next(order)
        where = f"[{i}/{len(files)}] {path.name}"
        progress(f"{where}: grading ({len(files) - i} left after it)")
        start = time.monotonic()
        row = _grade_one(path, autograder_zip, master_name, points, timeout, master, i, mounts)
        why = f" - {row['error']}" if row["error"] else ""
        progress(f"{where}: {row['total']}/{row['possible']}, {row['status']}{why} "
                 f"({time.monotonic() - start:.0f} s)")
        return row

    # Threads only wait: each grading runs in a child process of its own.
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(grade_next, files))
    sandbox.sweep_groups(f"dtlib-grade-{os.getpid()}-")
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return rows


if __name__ == "__main__":
    _grade_in_child(*map(Path, sys.argv[1:4]))
