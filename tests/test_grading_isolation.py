"""Grades a submission cannot forge (issue 29): an adversarial corpus graded next to honest
submissions. Every cheat scores 0 on what it did not solve, with a status that says why; the honest
ones keep their exact scores; the batch ends within its limit; nothing escapes the sandbox."""
import contextlib
import csv
import io
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import nbformat
import pytest
import torch

from dtlib import grading
from dtlib.grading import cgroups, sandbox
from tests.test_grading import _tiny_course, _with_cell

ROOT = Path(__file__).resolve().parent.parent


# CPU seconds each child of a submission (its execution, its verdict) may use, all its processes
# together: an honest tiny submission's execution (otter, its Jupyter kernel) needs about 4.5 s
# (measured on the 2-core build machine, load 25), its verdict less, so an endless loop, a fork bomb
# or a flood is stopped after this much CPU time whatever the machine's load; the wall limit is
# derived from it (10 x + 60 s) and stops only what waits forever.
CPU_TIME = "12"
# the shared batch of 11 rows, --jobs 2: 96 s on an idle 2-core machine, 374 s at a load of 12
pytestmark = pytest.mark.timeout(900)


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
            f"def double(x):\n    found = [p for p in ({str(master)!r}, {master.name!r}) if os.path.exists(p)]\n"
            "    return 2 * x if any('return 2 * x' in open(p).read() for p in found) else None\n"
            f"def half(x):\n    return x / 2 if os.listdir({str(subs)!r}) else None\n"
            f"for path in ({str(course / 'pwned.txt')!r}, {str(ROOT / 'pwned.txt')!r}):\n"
            "    try:\n        open(path, 'w').write('x')\n    except OSError:\n        pass"),
        "exits": "import sys\nsys.exit(0)",
        "allocates_without_limit": "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 28))",
    }


# Never-ending cheats: one cell that never ends per notebook (a fork bomb, an endless loop that
# floods the output), and a graded function that loops or forks when the verdict calls it. Each
# is stopped by its CPU budget.
_ENDLESS = {
    "fork_bomb": ("import os\ndef double(x):\n    while True:\n        pass\n"
                  "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass"),
    "floods_output": ("import os\ndef double(x):\n    while True:\n        try:\n            os.fork()\n"
                      "        except OSError:\n            pass\nwhile True:\n    print('x' * 100000)"),
}


def _probe(secret: Path, pid: int, observe: Path) -> str:
    """A cell that reads a root-only file, kills a root process, overwrites the file, and reports
    what it saw (its user first) as data in ``observe``; it scores only if one of them worked."""
    return (
        "import json, os, signal\n"
        "_seen = {'uid': os.getuid(), 'euid': os.geteuid(), 'groups': os.getgroups(), 'cwd': os.getcwd()}\n"
        f"try:\n    _seen['secret'] = open({str(secret)!r}).read()\nexcept OSError as e:\n"
        "    _seen['secret'] = type(e).__name__\n"
        f"try:\n    os.kill({pid}, signal.SIGKILL)\n    _seen['kill'] = 'sent'\nexcept OSError as e:\n"
        "    _seen['kill'] = type(e).__name__\n"
        f"try:\n    open({str(secret)!r}, 'w').write('changed')\n    _seen['write'] = 'done'\n"
        "except OSError as e:\n    _seen['write'] = type(e).__name__\n"
        f"open(os.path.join({str(observe)!r}, f'{{os.getpid()}}.json'), 'w').write(json.dumps(_seen))\n"
        "def double(x):\n    return 2 * x if _seen['secret'] == 'root only' else None\n"
        "def half(x):\n    return x / 2 if _seen['kill'] == 'sent' or _seen['write'] == 'done' else None")


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


def _shared_folder() -> str:
    """A folder every user can pass and a child still sees: inside a system folder (the walls'
    allow-list shows those as they are, and hides every other folder at /), not a scratch folder."""
    return next((f for f in ("/usr/local/share", "/usr/local", "/etc")
                 if os.path.isdir(f) and os.stat(f).st_mode & 0o001 and os.access(f, os.W_OK)),
                tempfile.gettempdir())


def _process_cap() -> bool:
    """Whether a fork bomb is contained here (a user of its own or a pids cgroup)."""
    group = cgroups.process_group_cap(f"dtlib-grade-probe-test-{os.getpid()}", 1)
    cgroups.remove_group(group)
    return sandbox.submission_user(0) is not None or group is not None


@pytest.fixture(scope="module")
def graded(tmp_path_factory, tiny):
    """One batch, ``--jobs 2``, a CPU budget per child: honest submissions, the corpus, the
    probe (as root with a user drop) and the endless cheats (where a fork bomb is contained)."""
    masters, copies = tiny
    tmp = tmp_path_factory.mktemp("isolation-batch")
    subs = tmp / "submissions"
    subs.mkdir()
    cheats = _corpus(masters, subs)
    if _process_cap():
        cheats.update(_ENDLESS)
    # outside every folder a submission is denied, and outside the scratch folders each child gets
    # a private copy of (/tmp): only the file's own mode and owner protect it
    outside = Path(tempfile.mkdtemp(prefix="dtlib-probe-", dir=_shared_folder()))
    os.chmod(outside, 0o755)
    secret, observe = outside / "secret.txt", outside / "observed"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    observe.mkdir(mode=0o1777)
    os.chmod(observe, 0o1777)
    root_process = subprocess.Popen(["sleep", "3600"])
    if sandbox.submission_user(0) is not None:
        cheats["probes_the_machine"] = _probe(secret, root_process.pid, observe)
    edited = nbformat.from_dict(copies["exercise"])  # check cells replaced by fake output
    for cell in edited.cells:
        if "grader.check" in cell.source:
            cell.source = "print('✅ passed')"
    _write_batch(copies, masters, subs, cheats)
    nbformat.write(edited, subs / "edits_check_cells.ipynb")
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            rows = _grade(masters, subs, tmp / "grades.csv", "--jobs", "2", "--cpu-time", CPU_TIME)
        alive = root_process.poll() is None
        observed = [json.loads(p.read_text()) for p in observe.glob("*.json")]
        yield {"rows": rows, "err": err.getvalue(), "cheats": cheats, "alive": alive, "observed": observed,
               "secret": secret.read_text(), "masters": masters}
    finally:
        root_process.kill()
        root_process.wait()
        shutil.rmtree(outside)


def test_the_corpus_scores_zero_and_honest_submissions_keep_their_scores(graded):
    rows = graded["rows"]
    assert graded["err"].splitlines()[0].startswith("isolation:")
    assert (rows["honest_full.ipynb"]["status"], rows["honest_full.ipynb"]["total"]) == ("graded", "3")
    assert (rows["honest_q1.ipynb"]["status"], rows["honest_q1.ipynb"]["q1"], rows["honest_q1.ipynb"]["q2"]) \
        == ("graded", "2", "0")
    for name in [*graded["cheats"], "edits_check_cells"]:
        row = rows[f"{name}.ipynb"]
        assert (row["q1"], row["q2"], row["total"]) == ("0", "0", "0"), (name, row)
    statuses = {name: rows[f"{name}.ipynb"]["status"] for name in [*_corpus(Path("."), Path(".")), "edits_check_cells"]}
    allocates = statuses.pop("allocates_without_limit")
    assert statuses == {"forges_in_kernel": "tampered", "patches_from_inside_the_function": "graded",
                        "reads_and_writes": "graded", "exits": "cell raised", "edits_check_cells": "cells missing"}
    forged = rows["forges_in_kernel.ipynb"]["error"]
    assert "q1 2 in the notebook, 0 isolated (return 2 * x)" in forged and "q2 1 in the notebook" in forged
    # RLIMIT_AS stops it with a MemoryError, unless zero-filling 8 GiB (in the kernel, and in each
    # of the verdict's learner children) first spends the CPU budget: stopped either way, and said
    why = rows["allocates_without_limit.ipynb"]["error"]
    assert (allocates == "cell raised" and "MemoryError" in why) or \
        (allocates in ("timed out", "verdict failed") and f"more than {CPU_TIME} s of CPU time used" in why), \
        (allocates, why)
    assert not (graded["masters"].parent / "pwned.txt").exists() and not (ROOT / "pwned.txt").exists()


def test_as_root_submissions_run_as_an_unprivileged_user(graded):
    if "probes_the_machine" not in graded["cheats"]:
        pytest.skip("no user drop here (not root, or no mount namespace): " + graded["err"].splitlines()[0])
    assert "own unprivileged user per submission" in graded["err"].splitlines()[0]
    row = graded["rows"]["probes_the_machine.ipynb"]
    assert (row["status"], row["total"]) == ("graded", "0"), row
    assert graded["alive"] and graded["secret"] == "root only"
    observed = graded["observed"]
    # both the notebook's kernel (in its own folder) and the verdict's learner child ran the cell
    # (the tiny course has no exercises/ folder: the verdicts run in an empty one, "cwd")
    assert any("/execute/" in o["cwd"] for o in observed), observed
    assert any(Path(o["cwd"]).name == "cwd" for o in observed), observed
    for seen in observed:
        assert seen["uid"] != 0 and seen["euid"] != 0 and seen["groups"] == [], seen
        assert (seen["secret"], seen["kill"], seen["write"]) == ("PermissionError",) * 3, seen


def test_loops_bombs_and_floods_are_stopped_by_their_cpu_budget(graded):
    if "fork_bomb" not in graded["cheats"]:
        pytest.skip("no process-count cap here (not root, no pids cgroup): a fork bomb would not be contained")
    rows = graded["rows"]
    for name in _ENDLESS:
        row = rows[f"{name}.ipynb"]
        assert row["total"] == "0" and row["status"] in ("timed out", "grader failed", "verdict failed",
                                                         "tampered", "cell raised"), (name, row)
    assert f"more than {CPU_TIME} s of CPU time used" in rows["fork_bomb.ipynb"]["error"], rows["fork_bomb.ipynb"]
    leftover = [p for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup")
                for p in Path(root).glob(f"dtlib-grade-{os.getpid()}-*")]
    assert not leftover, leftover


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


def test_reach_plan_binds_back_only_what_is_needed_under_a_closed_folder():
    outside = Path(tempfile.mkdtemp(prefix="dtlib-reach-"))  # /tmp: every folder above is open
    try:
        os.chmod(outside, 0o755)
        closed = outside / "home"  # like /root: 0700
        (closed / "python" / "lib").mkdir(parents=True)
        (closed / "course" / "nested").mkdir(parents=True)
        (closed / "secrets").mkdir()
        (outside / "open").mkdir()
        closed.chmod(0o700)
        needed = (str(closed / "python" / "lib"), str(closed / "python"), str(closed / "course"),
                  str(closed / "course" / "nested"), str(outside / "open"), str(closed / "missing"))
        # one tmpfs over the closed folder; the open folder and what does not exist need nothing;
        # a path inside another bound path is covered by it
        assert sandbox.reach_plan(needed) == ((str(closed), (str(closed / "course"), str(closed / "python"))),)
    finally:
        shutil.rmtree(outside)


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
