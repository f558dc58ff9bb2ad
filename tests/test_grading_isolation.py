"""Grades a submission cannot forge (issue 29): an adversarial corpus graded next to honest
submissions. Every cheat scores 0 on what it did not solve, with a status that says why; the honest
ones keep their exact scores; the batch ends within its limit; nothing escapes the sandbox."""
import csv
import os
from pathlib import Path

import nbformat
import pytest
import torch

from dtlib import grading
from dtlib.grading import sandbox
from tests.test_grading import _tiny_course, _with_cell

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-isolation")
    masters = _tiny_course(root / "course")
    return masters, grading.generate(masters / "99_tiny.ipynb")


def _grade(masters: Path, subs: Path, out: Path, *options: str) -> dict[str, dict]:
    argv = ["--masters", str(masters), "grade", str(subs), "--lesson", "99", "--out", str(out), *options]
    assert grading.main(argv) == 0
    return {r["submission"]: r for r in csv.DictReader(out.open())}


def _corpus(masters: Path, subs: Path) -> dict[str, str]:
    """Cheats on the unsolved copy: name -> the cell inserted after otter's init cell."""
    master = masters / "99_tiny.ipynb"
    course = masters.parent
    return {
        # everything that decides otter's in-kernel verdict, patched at top level
        "forges_in_kernel": (
            "import otter\n"
            "from otter.test_files import exception_test\n"
            "from otter.test_files.abstract_test import TestCaseResult\n"
            "def run(self, env):\n"
            "    self.test_case_results = [TestCaseResult(test_case=t, message='ok', passed=True)\n"
            "                              for t in self.test_cases]\n"
            "exception_test.ExceptionTestFile.run = run\n"
            "otter.Notebook.check = lambda self, *a, **k: print('✅ passed')\n"
            "class _Pass:\n    def __getattr__(self, name):\n        return lambda *a, **k: None\n"
            "grader = _Pass()\n"
            "print('✅ q1 passed: 2 of 2 points')"),
        # the graded function patches the grader when it is called
        "patches_from_inside_the_function": (
            "def double(x):\n    import otter.test_files.abstract_test as a, dtlib.grading.verdict as v\n"
            "    a.TestFile.score = property(lambda self: self.possible)\n"
            "    v.decode = lambda blob: {'ok': True, 'value': 6}\n    return None\n"
            "def half(x):\n    return double(x)"),
        # points only if it could read the master or another submission; writes into the course
        "reads_and_writes": (
            "import os\n"
            f"def double(x):\n    return 2 * x if 'return 2 * x' in open({str(master)!r}).read() else None\n"
            f"def half(x):\n    return x / 2 if os.listdir({str(subs)!r}) else None\n"
            f"for path in ({str(course / 'pwned.txt')!r}, {str(ROOT / 'pwned.txt')!r}):\n"
            "    try:\n        open(path, 'w').write('x')\n    except OSError:\n        pass"),
        "exits": "import sys\nsys.exit(0)",
        "allocates_without_limit": "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 28))",
    }


def _write_batch(copies, masters: Path, subs: Path, cheats: dict[str, str]) -> None:
    nbformat.write(copies["solution"], subs / "honest_full.ipynb")
    half = nbformat.from_dict(copies["solution"])  # q1 solved, q2 left as in the exercise
    stub_q2 = next(c.source for c in copies["exercise"].cells if "def half" in c.source)
    for cell in half.cells:
        if "def half" in cell.source:
            cell.source = stub_q2
    nbformat.write(half, subs / "honest_q1.ipynb")
    for name, source in cheats.items():
        nbformat.write(_with_cell(copies["exercise"], 1, source), subs / f"{name}.ipynb")


def test_the_corpus_scores_zero_and_honest_submissions_keep_their_scores(tmp_path, tiny, capsys):
    masters, copies = tiny
    subs = tmp_path / "submissions"
    subs.mkdir()
    cheats = _corpus(masters, subs)
    edited = nbformat.from_dict(copies["exercise"])  # check cells replaced by fake output
    for cell in edited.cells:
        if "grader.check" in cell.source:
            cell.source = "print('✅ passed')"
    _write_batch(copies, masters, subs, cheats)
    nbformat.write(edited, subs / "edits_check_cells.ipynb")

    rows = _grade(masters, subs, tmp_path / "grades.csv", "--jobs", "2")
    assert "isolation:" in capsys.readouterr().err.splitlines()[0]
    assert (rows["honest_full.ipynb"]["status"], rows["honest_full.ipynb"]["total"]) == ("graded", "3")
    assert (rows["honest_q1.ipynb"]["status"], rows["honest_q1.ipynb"]["q1"], rows["honest_q1.ipynb"]["q2"]) \
        == ("graded", "2", "0")
    for name in [*cheats, "edits_check_cells"]:
        row = rows[f"{name}.ipynb"]
        assert (row["q1"], row["q2"], row["total"]) == ("0", "0", "0"), (name, row)
    statuses = {name: rows[f"{name}.ipynb"]["status"] for name in [*cheats, "edits_check_cells"]}
    assert statuses == {"forges_in_kernel": "tampered", "patches_from_inside_the_function": "graded",
                        "reads_and_writes": "graded", "exits": "cell raised",
                        "allocates_without_limit": "cell raised", "edits_check_cells": "cells missing"}
    forged = rows["forges_in_kernel.ipynb"]["error"]
    assert "q1 2 in the notebook, 0 isolated (return 2 * x)" in forged and "q2 1 in the notebook" in forged
    assert "MemoryError" in rows["allocates_without_limit.ipynb"]["error"]
    assert not (masters.parent / "pwned.txt").exists() and not (ROOT / "pwned.txt").exists()


def test_the_one_cell_forgery_of_issue_29_scores_zero(tmp_path):
    nb = nbformat.read(ROOT / "exercises" / "01_data_parallel.ipynb", as_version=4)
    at = next(i for i, c in enumerate(nb.cells) if "import torch" in c.source) + 1
    cheat = _with_cell(nb, at, "class _Pass:\n    def __getattr__(self, name):\n"
                               "        return lambda *a, **k: None\nchecks = _Pass()")
    subs = tmp_path / "submissions"
    subs.mkdir()
    nbformat.write(cheat, subs / "cheater.ipynb")
    out = tmp_path / "grades.csv"
    assert grading.main(["grade", str(subs), "--lesson", "01", "--out", str(out)]) == 0
    row = next(csv.DictReader(out.open()))
    assert (row["status"], row["q1"], row["q2"], row["q3"], row["total"]) == ("tampered", "0", "0", "0", "0")
    assert "q1 4 in the notebook, 0 isolated" in row["error"] and "q3 1 in the notebook, 0 isolated" in row["error"]


def test_loops_bombs_and_floods_cost_only_their_row(tmp_path, tiny):
    # One limit for the batch: 90 s, well above an honest tiny submission (10-40 s on a loaded
    # 2-core machine), which every never-ending cheat pays.
    masters, copies = tiny
    if not (sandbox.submission_user(0) is not None or sandbox.process_group_cap("dtlib-grade-probe-test", 1)):
        pytest.skip("no process-count cap here (not root, no pids cgroup): a fork bomb would not be contained")
    sandbox.remove_group(sandbox.process_group_cap("dtlib-grade-probe-test", 1))
    subs = tmp_path / "submissions"
    subs.mkdir()
    cheats = {  # one cell that never ends per notebook; the function loops in the verdict
        "fork_bomb": ("import os\ndef double(x):\n    while True:\n        pass\n"
                      "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
        "floods_output": ("import os\ndef double(x):\n    while True:\n        try:\n            os.fork()\n"
                          "        except OSError:\n            pass\nwhile True:\n    print('x' * 100000)"),
    }
    _write_batch(copies, masters, subs, cheats)
    rows = _grade(masters, subs, tmp_path / "grades.csv", "--timeout", "90", "--jobs", "2")
    assert (rows["honest_full.ipynb"]["status"], rows["honest_full.ipynb"]["total"]) == ("graded", "3")
    assert rows["honest_q1.ipynb"]["total"] == "2"
    for name in cheats:
        row = rows[f"{name}.ipynb"]
        assert row["total"] == "0" and row["status"] in ("timed out", "grader failed", "verdict failed",
                                                         "tampered", "cell raised"), (name, row)
    leftover = [p for p in Path("/sys/fs/cgroup/pids").glob(f"dtlib-grade-{os.getpid()}-*")]
    assert not leftover, leftover


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dtlib-decode-ran",))


def test_decode_reads_data_and_refuses_code():
    from dtlib.analytic.layout import Parallelism
    from dtlib.grading.transfer import decode, encode

    value = {"layout": Parallelism(dp=4, tp=2), "t": torch.arange(3), "x": [1.5, "a", None]}
    got = decode(encode(value))
    assert got["layout"] == value["layout"] and torch.equal(got["t"], value["t"]) and got["x"] == value["x"]
    for hostile in (_RunsCode(), {"k": _RunsCode()}):
        with pytest.raises(ValueError, match="refusing to load"):
            decode(encode(hostile))
    assert not Path("/tmp/dtlib-decode-ran").exists()


def _raises(rank, world_size):
    if rank == 1:
        raise KeyError("no such bucket")
    return {"rank": torch.tensor([rank])}


def _returns_code(rank, world_size):
    return _RunsCode()


def _returns_numpy(rank, world_size):
    import numpy as np

    # what dtlib.frameworks' runners return: float32 arrays from .numpy() (exercise 13's Megatron
    # check came back 'tampered' when a reply of such arrays needed a numpy dtype not allowed)
    return {"params": {"w": torch.full((3,), float(rank)).numpy()}, "loss": np.float32(rank)}


def test_launcher_result_codec_sends_data_and_errors_as_text():
    from dtlib.grading.transfer import decode, encode
    from dtlib.launcher import RankFailedError, launch, set_result_codec

    set_result_codec(encode, decode)
    try:
        with pytest.raises(RankFailedError) as failed:
            launch(_raises, 2, timeout=30, output="none")
        assert failed.value.rank == 1 and type(failed.value.__cause__).__name__ == "KeyError"
        assert "no such bucket" in str(failed.value.__cause__)
        with pytest.raises(ValueError, match="refusing to load"):
            launch(_returns_code, 2, timeout=30, output="none")
        arrays = launch(_returns_numpy, 2, timeout=30, output="none")
        assert arrays[1]["params"]["w"].tolist() == [1.0, 1.0, 1.0] and arrays[1]["loss"] == 1.0
    finally:
        set_result_codec(None)
    assert not Path("/tmp/dtlib-decode-ran").exists()
    with pytest.raises(ValueError, match="both encode and decode"):
        set_result_codec(encode)
