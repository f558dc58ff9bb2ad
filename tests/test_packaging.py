"""pyproject.toml and environment.yml describe the same environment; CI calls the README's command."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# conda-forge names that differ from PyPI's
CONDA_TO_PYPI = {"pytorch-cpu": "torch", "pytorch": "torch"}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ ]", spec.strip(), maxsplit=1)[0].lower()


def test_environment_yml_matches_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pypi = {_name(d): d for d in deps}
    conda = set()
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        m = re.match(r"\s+- ([A-Za-z][\w.-]*)([<>=!~][^#\s]*)?", line)
        if m and m.group(1) not in ("python", "pip"):
            conda.add(CONDA_TO_PYPI.get(m.group(1), m.group(1)).lower())
    assert conda == set(pypi), f"only in environment.yml: {conda - set(pypi)}, only in pyproject: {set(pypi) - conda}"
    # and the version floors agree
    for name, spec in pypi.items():
        floor = re.search(r">=([\d.]+)", spec)
        if floor:
            assert re.search(rf"(?i)(- {name}|pytorch-cpu)>={re.escape(floor.group(1))}", text), f"{name} floor differs"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme and "make lab" in readme
