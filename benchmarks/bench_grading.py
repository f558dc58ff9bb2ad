"""Wall time of batch grading with dtlib.grading against otter alone (issues 29 and 39).

    PYTHONPATH=$PWD python benchmarks/bench_grading.py [--lesson 03] [--honest 2] [--jobs 1] [--rounds 2]
    PYTHONPATH=$PWD python benchmarks/bench_grading.py --baseline walls --lesson 01 --honest 12 --jobs 2
    PYTHONPATH=$PWD python benchmarks/bench_grading.py --quick     # the tiny test course (make benchmarks)

Grades one folder ``2 x rounds`` times, alternately with the baseline and with ``dtlib.grading``
(``batch.grade`` with the master: the walls, the isolated verdict, the default CPU budget), so
that a change of the machine's load hits both alike. Prints each wall time, each round's ratio,
and the median ratio with its spread; issue 39 asks for at most 1.25.

``--baseline bare`` (default): ``otter.api.grade_submission`` alone, in ``--jobs`` worker processes,
no sandbox, no verdict, on ``honest`` copies of the lesson's solution and its unsolved exercise
(nothing else: outside the walls an endless loop or a fork bomb would run on the machine). The
workers start as ``--worker-start`` says: ``spawn`` (default), a fresh interpreter that imports
otter, as ``otter grade`` and dtlib's executions' parent do once per batch; ``fork``, a copy of
this process, which has imported otter already (to assign the master), so the baseline skips
that start (about 1 to 1.5 s; the comparison recorded before 29 Nov 2026).
``--baseline walls``: otter's in-notebook score inside the same walls (``batch.grade`` without a
master: the grader before issue 29), on the honest copies plus an adversarial corpus (the
one-cell forgery, a patch from inside the graded function, a fork bomb, an output flood and an
endless loop), which costs ``--timeout`` in both.
"""
from __future__ import annotations

import argparse
import multiprocessing
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import nbformat

from dtlib.grading import batch, pipeline

CHEATS = {
    "forgery": "class _Pass:\n    def __getattr__(self, name):\n        return lambda *a, **k: None\nchecks = _Pass()",
    "patches_inside": ("def scaling_efficiency(throughput):\n    import dtlib.grading.verdict as v\n"
                       "    v.decode = lambda blob: {'ok': True, 'value': {}}\n    return None"),
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "flood": "while True:\n    print('x' * 100000)",
    "loop": "while True:\n    pass",
}


def _folder(master: Path, honest: int, cheats: bool, where: Path) -> Path:
    subs = where / "submissions"
    subs.mkdir()
    copies = pipeline.generate(master)
    for i in range(honest):
        nbformat.write(copies["solution"], subs / f"honest_{i:02d}.ipynb")
    nbformat.write(copies["exercise"], subs / "unsolved.ipynb")
    stub = copies["exercise"]
    at = next(i for i, c in enumerate(stub.cells) if c.cell_type == "code" and "import" in c.source
              and "otter" not in c.source) + 1
    for name, source in CHEATS.items() if cheats else ():
        cheat = nbformat.from_dict(stub)
        cheat.cells.insert(at, nbformat.v4.new_code_cell(source))
        nbformat.write(cheat, subs / f"cheat_{name}.ipynb")
    return subs


def _otter_alone(notebook: Path, autograder_zip: Path, master_name: str) -> dict:
    """One row graded by ``otter.api.grade_submission`` in this worker, nothing around it."""
    from otter.api import grade_submission

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / master_name  # otter grades a notebook named like the master
        shutil.copy(notebook, target)
        results = grade_submission(str(target), str(autograder_zip), quiet=True)
        total = sum(results.get_score(q) for q in results.test_files)
    return {"submission": notebook.name, "total": f"{total:g}", "status": "otter alone"}


def _grade_bare(files: list[Path], autograder_zip: Path, master_name: str, jobs: int, start: str) -> list[dict]:
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context(start)) as pool:
        return list(pool.map(_otter_alone, files, [autograder_zip] * len(files), [master_name] * len(files)))


def _master(lesson: str, where: Path) -> Path:
    if lesson == "tiny":  # the test suite's two-question course: no torch, no ranks
        from tests.test_grading import _tiny_course

        return _tiny_course(where / "course") / "99_tiny.ipynb"
    return pipeline._master_for(lesson)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lesson", default="03", help="a lesson number, or tiny (the test suite's course)")
    parser.add_argument("--honest", type=int, default=2, help="copies of the solution (and one unsolved exercise)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--baseline", choices=("bare", "walls"), default="bare")
    parser.add_argument("--worker-start", choices=("spawn", "fork"), default="spawn",
                        help="how otter alone's workers start: a fresh interpreter, or a copy of this one")
    parser.add_argument("--timeout", type=float, default=None,
                        help="wall limit per submission (default: dtlib's, from the default --cpu-time)")
    parser.add_argument("--rounds", type=int, default=2, help="baseline and dtlib.grading runs, interleaved")
    parser.add_argument("--quick", action="store_true", help="--lesson tiny --rounds 1 (make benchmarks)")
    args = parser.parse_args()
    if args.quick:
        args.lesson, args.rounds = "tiny", 1
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        master = _master(args.lesson, Path(tmp))
        zips = list((pipeline._assigned(master) / "autograder").glob("*.zip"))
        subs = _folder(master, args.honest, args.baseline == "walls", Path(tmp))
        files = batch.submission_files(subs)
        runs = {"baseline": lambda: (_grade_bare(files, zips[0], master.name, args.jobs, args.worker_start)
                                     if args.baseline == "bare"
                                     else batch.grade(files, zips[0], master.name, Path(tmp) / "grades.csv",
                                                      args.timeout, args.jobs, progress=lambda line: None)),
                "dtlib.grading": lambda: batch.grade(files, zips[0], master.name, Path(tmp) / "grades.csv",
                                                     args.timeout, args.jobs, progress=lambda line: None,
                                                     master=master)}
        for round_ in range(args.rounds):
            times = {}
            for label in ("baseline", "dtlib.grading")[::1 - 2 * (round_ % 2)]:
                start = time.monotonic()
                rows = runs[label]()
                times[label] = time.monotonic() - start
                name = {"baseline": f"otter {'alone' if args.baseline == 'bare' else 'in walls'}"}.get(label, label)
                print(f"round {round_ + 1} {name:15s} {times[label]:7.1f} s  "
                      + ", ".join(f"{r['submission'].removesuffix('.ipynb')}={r['total']} {r['status']}" for r in rows
                                  if not r["submission"].startswith("honest_") or r["submission"] == "honest_00.ipynb"),
                      flush=True)
            ratios.append(times["dtlib.grading"] / times["baseline"])
            print(f"round {round_ + 1} ratio {ratios[-1]:.2f}", flush=True)
    cheats = f" + {len(CHEATS)} cheats" if args.baseline == "walls" else ""
    print(f"ratio {statistics.median(ratios):.2f} (median of {len(ratios)}; min {min(ratios):.2f}, "
          f"max {max(ratios):.2f}; {args.honest} honest + 1 unsolved{cheats}, lesson {args.lesson}, "
          f"jobs {args.jobs}, baseline {args.baseline}"
          + (f", workers by {args.worker_start})" if args.baseline == "bare" else ")"))


if __name__ == "__main__":
    main()
