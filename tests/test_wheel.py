"""The package as a learner or an instructor installs it: the wheel built from this tree, installed
into a fresh venv. The core alone (numpy) runs the planner with torch not importable and gives the
same numbers as this install; what needs an extra says which in one line; ``dtlib course`` writes
the course from the wheel's package data; and, with the course's dependencies visible, ``dtlib
grade`` grades a solved exercise against the masters the wheel carries."""
import csv
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# what a built wheel never takes from the tree: outputs, caches, environments
_NOT_SOURCES = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "_site", "_build",
                                      ".pytest_cache", ".ipynb_checkpoints", "node_modules", "*.whl")
PLAN = ["plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch", "512", "--top", "3", "--json"]
MEMORY = ["memory", "--model", "llama3-8b", "--tp", "8", "--gpus", "64", "--json"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of this tree (an in-tree build would leave build/ behind, whose stale
    files a later build would ship), built by this environment's setuptools, offline."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    tmp = tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, tmp / "src", ignore=_NOT_SOURCES)
    # this environment's setuptools if it is the one pyproject.toml asks for (offline, seconds),
    # else pip's isolated build (which fetches it)
    (wanted,) = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    own_setuptools = Requirement(wanted).specifier.contains(version("setuptools"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(tmp / "dist"),
                    *(["--no-build-isolation"] if own_setuptools else []), str(tmp / "src")], check=True, timeout=300,
                   capture_output=True)
    (built,) = (tmp / "dist").glob("dtlib-*.whl")
    return built


def _venv(where: Path, wheel: Path, *requirements: str) -> Path:
    """A fresh venv holding ``wheel`` (no dependencies) and ``requirements``; its python."""
    venv.create(where, with_pip=False)
    python = where / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--disable-pip-version-check", str(wheel), *requirements], check=True, timeout=300,
                   capture_output=True)
    return python


def _env() -> dict[str, str]:
    # the venv's own packages only: not this checkout (PYTHONPATH) nor the test run's settings
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DTLIB_MASTERS", "PYTHONSTARTUP")}


def _run(python: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), *argv], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)


def _dtlib(python: Path, *argv: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    # the console script the wheel installed, as a learner types it
    return subprocess.run([str(python.parent / "dtlib"), *argv], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)


def test_the_core_wheel_plans_without_torch_and_writes_the_course(wheel, tmp_path):
    import numpy

    # the same numpy as here, so that the numbers can be compared exactly
    python = _venv(tmp_path / "venv", wheel, f"numpy=={numpy.__version__}")
    where = _run(python, "-c", "import dtlib; print(dtlib.__file__)", cwd=tmp_path).stdout
    assert where.startswith(str(tmp_path / "venv")), where  # the installed package, not this checkout
    assert "No module named 'torch'" in _run(python, "-c", "import torch", cwd=tmp_path).stderr
    for argv in (PLAN, MEMORY):
        installed = _dtlib(python, *argv, cwd=tmp_path)
        assert installed.returncode == 0 and not installed.stderr, installed.stderr
        here = subprocess.run([sys.executable, "-m", "dtlib.cli", *argv], capture_output=True, text=True,
                              check=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        numbers, expected = json.loads(installed.stdout), json.loads(here.stdout)
        for result in (numbers, expected):
            result.pop("search_seconds", None)  # plan's time of its own search: a clock
        assert numbers == expected, argv[0]

    # what needs an extra says which, in one line
    done = _dtlib(python, "train", "--steps", "1", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (
        2, "", "dtlib: error: dtlib train needs torch: pip install 'dtlib[course]'\n")
    done = _run(python, "-c", "import dtlib; dtlib.launch", cwd=tmp_path)
    assert done.stderr.splitlines()[-1] == (
        "dtlib.extras.MissingExtra: dtlib.launch needs torch: pip install 'dtlib[course]'")
    done = _dtlib(python, "course", str(tmp_path / "lab"), cwd=tmp_path)  # JupyterLab is the course extra's
    assert (done.returncode, done.stderr) == (
        2, "dtlib: error: dtlib course needs jupyterlab: pip install 'dtlib[course]'\n")
    assert not (tmp_path / "lab").exists()  # refused before writing anything

    # the course from the wheel's package data: the lessons and exercises, not the masters
    course = tmp_path / "my course"
    done = _dtlib(python, "course", str(course), "--no-lab", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "-m jupyterlab" in done.stdout and "/lab/tree/notebooks/00_collectives.ipynb" in done.stdout
    lessons = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").rglob("*") if p.is_file())
    exercises = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "exercises").glob("*.ipynb"))
    written = sorted(p.relative_to(course).as_posix() for p in course.rglob("*") if p.is_file())
    assert written == sorted([".dtlib-course.json", *lessons, *exercises])
    assert all((course / name).read_bytes() == (ROOT / name).read_bytes() for name in lessons + exercises)
    answer = course / exercises[0]
    answer.write_text(answer.read_text() + " ")
    done = _dtlib(python, "course", str(course), "--no-lab", cwd=tmp_path)
    assert (done.returncode, done.stderr.count("\n")) == (2, 1) and f"{answer} holds your changes" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)  # under a minute of CPU (otter assign, a kernel, the verdict); the wall time is the load's
def test_the_installed_wheel_grades_with_its_own_masters(wheel, tmp_path):
    """An instructor's install: the wheel (no checkout anywhere on the path) with the course's
    dependencies, here this environment's packages seen through a .pth file."""
    python = _venv(tmp_path / "venv", wheel)
    (site,) = (tmp_path / "venv" / "lib").glob("python3*/site-packages")
    # resolved: the grader's walls hide the shared /tmp, where a symlinked venv may point
    (site / "course-dependencies.pth").write_text(str(Path(sysconfig.get_paths()["purelib"]).resolve()) + "\n")
    found = _run(python, "-c", "import dtlib.grading as g; print(g.masters_dir())", cwd=tmp_path)
    assert found.stdout.strip() == str(site / "dtlib" / "course_files" / "masters"), found.stderr
    lesson = "03_memory.ipynb"  # arithmetic only: no ranks to start
    subs = tmp_path / "submissions"
    subs.mkdir()
    shutil.copy(ROOT / "solutions" / lesson, subs / "solved.ipynb")
    done = _dtlib(python, "grade", str(subs), "--lesson", lesson[:2], "--out", str(tmp_path / "grades.csv"),
                  cwd=tmp_path, timeout=840)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = csv.DictReader((tmp_path / "grades.csv").open())
    assert row["status"] == "graded" and float(row["total"]) == float(row["possible"]) > 0, row
