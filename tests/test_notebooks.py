"""Committed notebooks: no outputs, no widget state, the plain python3 kernel; lessons teach."""
import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ALL = sorted(p for d in ("notebooks", "exercises", "solutions", "masters") for p in (ROOT / d).glob("*.ipynb"))
LESSONS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_readme_lesson_map_lists_exactly_the_lessons():
    readme = (ROOT / "README.md").read_text()
    listed = re.findall(r"^\| `(\d\d_\w+)` \|", readme, re.M)
    assert listed == [p.stem for p in LESSONS], "README's lesson map and notebooks/ disagree"


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_clean(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    assert "widgets" not in nb["metadata"], "widget state committed"
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, "outputs committed"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_structure(path):
    text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
    for section in ("Learning goals", "What the real frameworks do", "Exercise"):
        assert section in text, f"{path.name} lacks a '{section}' section"
    assert _seeds_quietly(path), f"{path.name} should seed its randomness with `_ = torch.manual_seed(0)`"


def _seeds_quietly(path: Path) -> bool:
    """A code cell calls torch.manual_seed, and no cell ends with a bare manual_seed(...) call, whose
    value Jupyter would print as ``<torch._C.Generator at 0x...>``."""
    seeded = False
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        tree = ast.parse("".join(cell["source"]))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and getattr(n.func, "attr", getattr(n.func, "id", "")) == "manual_seed"]
        seeded |= bool(calls)
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and last.value in calls:
            return False
    return seeded


def test_dtlib_figures_render_as_pictures_in_a_kernel():
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from dtlib.viz.training import plot_losses\nplot_losses({'run': [3.0, 2.0, 1.0]})")])
    NotebookClient(nb, timeout=60, kernel_name="python3").execute()
    outputs = nb.cells[0].outputs
    assert len(outputs) == 1 and "image/png" in outputs[0]["data"]


def test_lesson0_prediction_ships_unanswered_and_is_checked(capsys):
    import torch

    from dtlib.primitives import run_collective

    cells = json.loads((ROOT / "notebooks" / "00_collectives.ipynb").read_text())["cells"]
    source = next("".join(c["source"]) for c in cells if "my_prediction =" in "".join(c["source"]))
    first, rest = source.split("\n", 1)
    assert ast.parse(first).body[0].value.value is Ellipsis, "the learner, not the notebook, predicts"
    said = {}
    for answer in ("...", "[2, 12, 22]", "[20, 21, 22]"):
        exec(f"my_prediction = {answer}\n{rest}", {"torch": torch, "run_collective": run_collective})
        said[answer] = capsys.readouterr().out
    assert said["..."].startswith("replace ... with your prediction")
    assert said["[2, 12, 22]"] == "correct!\n"
    assert said["[20, 21, 22]"].startswith("not quite") and "[2, 12, 22]" in said["[20, 21, 22]"]


# Sentences that compare numbers the lesson prints ("X beats Y", "under 20%", "the same bubble"):
# each section that says one must check it with dtlib.claims.claim in one of its code cells.
_COMPARISON = re.compile(
    r"\b(beats?|faster than|slower than|fewer than|(?<!no )more than|several times|x fewer|x faster|"
    r"(?:under|below|above|at most|within) \d+(?:\.\d+)?%|the same bubble|same numbers|bit for bit|identical)\b", re.I)
_UNCHECKED_SECTIONS = ("Learning goals", "Explore", "Exercise", "What the real frameworks do",
                       "What this lesson established")  # a summary of what the sections above checked


def _sections(path: Path) -> list[dict]:
    """The lesson's ``## `` sections: title, comparison sentences of their prose, and whether a
    code cell of theirs calls ``claim(``."""
    sections: list[dict] = []
    for cell in json.loads(path.read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            if sections and "claim(" in source:
                sections[-1]["claimed"] = True
            continue
        for block in re.split(r"^(?=## )", source, flags=re.M):
            if block.startswith("## "):
                title, _, block = block.partition("\n")
                sections.append({"title": title[3:], "sentences": [], "claimed": False})
            if not sections or sections[-1]["title"].startswith(_UNCHECKED_SECTIONS):
                continue
            sentences = re.split(r"(?<=[.:])\s+", re.sub(r"\s+", " ", block))
            sections[-1]["sentences"] += [s for s in sentences if _COMPARISON.search(s)]
    return sections


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_claims_are_checked_on_its_numbers(path):
    """Every lesson checks its quantitative sentences on the numbers its run computes
    (dtlib.claims.claim, executed by nbval under `make test`), so a change that makes a number
    contradict the prose fails the build."""
    text = path.read_text()
    assert "from dtlib.claims import claim" in text, f"{path.name} makes no claim (dtlib.claims.claim)"
    unchecked = [(s["title"], s["sentences"][0][:100]) for s in _sections(path) if s["sentences"] and not s["claimed"]]
    assert unchecked == [], f"{path.name}: sections whose comparisons no claim(...) checks: {unchecked}"


def test_the_claims_check_finds_an_unchecked_comparison(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["## 1. Speed\n", "Ours beats theirs by 2x."]},
                    {"cell_type": "code", "source": ["print(2.0)"]}]}
    (tmp_path / "x.ipynb").write_text(json.dumps(nb))
    assert _sections(tmp_path / "x.ipynb") == [{"title": "1. Speed", "sentences": ["Ours beats theirs by 2x."],
                                                "claimed": False}]


def _root_conftest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_noise_is_stderr_and_stdout_warnings_outside_the_allow_list():
    noise = _root_conftest().noise
    stream = lambda name, text: {"output_type": "stream", "name": name, "text": text}  # noqa: E731
    assert noise([stream("stdout", "✓ a claim (rank_0 +0.9%)\nloss 3.1\n"),
                  {"output_type": "display_data", "data": {"text/html": "<details>3 notices</details>"}}]) == []
    assert noise([stream("stderr", "/usr/bin/ld: cannot find -laio\n\n"),
                  stream("stdout", ["ok\n", "[2026-11-29 09:21:50,513] [WARNING] [engine.py:2304] untested\n"]),
                  stream("stdout", "x.py:3: UserWarning: something\n")]) == [
        "/usr/bin/ld: cannot find -laio", "[2026-11-29 09:21:50,513] [WARNING] [engine.py:2304] untested",
        "x.py:3: UserWarning: something"]


def test_nbval_fails_a_cell_that_shows_noise_and_a_notebook_that_leaves_temp_files(tmp_path):
    """The root conftest's checks, run as nbval runs the lessons: a clean cell passes, a cell that
    writes to stderr fails naming the line; a notebook whose kernel leaves a folder in its temp
    directory fails, one that uses TemporaryDirectory (removed when the kernel shuts down) does not."""
    import os
    import subprocess
    import sys

    import nbformat

    cells = {"noisy": ["print('loss 3.1')", "import sys\nprint('collect2: error', file=sys.stderr)"],
             "leaky": ["import tempfile\nkept = tempfile.mkdtemp(prefix='lesson-')"],
             "tidy": ["import tempfile\nscratch = tempfile.TemporaryDirectory(prefix='lesson-')"]}
    for name, sources in cells.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in sources])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, tmp_path / f"{name}.ipynb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "--nbval-lax", *(f"{n}.ipynb" for n in cells),
                          "-p", "no:cacheprovider", "-p", "no:xdist", "-rA", "--rootdir", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    summary = run.stdout[run.stdout.rindex("short test summary"):]
    assert "FAILED noisy.ipynb::Cell 1" in summary and "line(s) of noise" in run.stdout and "collect2: error" in run.stdout
    assert "ERROR leaky.ipynb::Cell 0" in summary and "left 1 entry in its temporary directory" in run.stdout
    assert "PASSED tidy.ipynb::Cell 0" in summary and "ERROR tidy" not in summary, run.stdout[-3000:]


@pytest.mark.parametrize("path", ALL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_labels_counting_ranks_agree_in_number(path):
    """Issue 38: lesson 01's legend read "1 ranks" (the label was f"{n} ranks" for n in (1, 2, 4));
    a label that counts ranks with a variable must choose rank or ranks by the count."""
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            counts_from_one = re.search(r"[\[(]1, \d", source)  # e.g. for n in (1, 2, 4)
            assert not (counts_from_one and re.search(r"\{\w+\} ranks\b", source)), \
                f"{path.name}: '{{n}} ranks' reads '1 ranks' for n = 1"
