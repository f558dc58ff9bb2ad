"""Wall time of batch grading with the isolated verdict against otter's score alone (issue 29).

    PYTHONPATH=$PWD python benchmarks/bench_grading.py [--lesson 01] [--honest 12] [--jobs 1] [--rounds 2]

Grades one folder ``2 x rounds`` times: ``honest`` copies of the lesson's solution plus an
adversarial corpus (the one-cell forgery, a patch from inside the graded function, a fork bomb, an
output flood and an endless loop), alternately with otter's in-notebook score only (``batch.grade``
without a master: the grader before issue 29, inside the same walls) and with the isolated
verdict, so that a change of the machine's load hits both alike. Prints each wall time, each
round's ratio, and the median ratio with its spread; the issue asks for at most 1.25. Loop, bomb
and flood cost ``--timeout`` in both.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import nbformat

from dtlib.grading import batch, pipeline

ROOT = Path(__file__).resolve().parent.parent
CHEATS = {
    "forgery": "class _Pass:\n    def __getattr__(self, name):\n        return lambda *a, **k: None\nchecks = _Pass()",
    "patches_inside": ("def scaling_efficiency(throughput):\n    import dtlib.grading.verdict as v\n"
                       "    v.decode = lambda blob: {'ok': True, 'value': {}}\n    return None"),
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "flood": "while True:\n    print('x' * 100000)",
    "loop": "while True:\n    pass",
}


def _folder(lesson_file: str, honest: int, where: Path) -> Path:
    subs = where / "submissions"
    subs.mkdir()
    solved = nbformat.read(ROOT / "solutions" / lesson_file, as_version=4)
    for i in range(honest):
        nbformat.write(solved, subs / f"honest_{i:02d}.ipynb")
    stub = nbformat.read(ROOT / "exercises" / lesson_file, as_version=4)
    at = next(i for i, c in enumerate(stub.cells) if c.cell_type == "code" and "import" in c.source
              and "otter" not in c.source) + 1
    for name, source in CHEATS.items():
        cheat = nbformat.from_dict(stub)
        cheat.cells.insert(at, nbformat.v4.new_code_cell(source))
        nbformat.write(cheat, subs / f"cheat_{name}.ipynb")
    return subs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lesson", default="01")
    parser.add_argument("--honest", type=int, default=12)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=90.0, help="per submission (loop, bomb, flood pay it)")
    parser.add_argument("--rounds", type=int, default=2, help="otter-only and isolated runs, interleaved")
    args = parser.parse_args()
    master = pipeline._master_for(args.lesson)
    zips = list((pipeline._assigned(master) / "autograder").glob("*.zip"))
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        subs = _folder(master.name, args.honest, Path(tmp))
        files = batch.submission_files(subs)
        for round_ in range(args.rounds):
            times = {}
            for label, with_master in (("otter only", None), ("isolated verdict", master))[::1 - 2 * (round_ % 2)]:
                start = time.monotonic()
                rows = batch.grade(files, zips[0], master.name, Path(tmp) / "grades.csv", args.timeout, args.jobs,
                                   progress=lambda line: None, master=with_master)
                times[label] = time.monotonic() - start
                print(f"round {round_ + 1} {label:17s} {times[label]:7.1f} s  "
                      + ", ".join(f"{r['submission'].removesuffix('.ipynb')}={r['total']} {r['status']}" for r in rows
                                  if not r["submission"].startswith("honest_") or r["submission"] == "honest_00.ipynb"),
                      flush=True)
            ratios.append(times["isolated verdict"] / times["otter only"])
            print(f"round {round_ + 1} ratio {ratios[-1]:.2f}", flush=True)
    print(f"ratio {statistics.median(ratios):.2f} (median of {len(ratios)}; "
          f"min {min(ratios):.2f}, max {max(ratios):.2f}; {args.honest} honest + {len(CHEATS)} cheats, lesson {args.lesson}, jobs {args.jobs}, "
          f"timeout {args.timeout:g} s)")


if __name__ == "__main__":
    main()
