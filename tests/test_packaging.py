"""pyproject.toml and environment.yml describe the same environment; CI calls the README's command."""
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# conda-forge names that differ from PyPI's
CONDA_TO_PYPI = {"pytorch-cpu": "torch", "pytorch": "torch"}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower()  # ray[train] -> ray


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + [d for extra in project.get("optional-dependencies", {}).values() for d in extra]
    pypi = {_name(d): d for d in deps}
    conda = set()
    text = (ROOT / "environment.yml").read_text()
    for line in text.split("dependencies:", 1)[1].splitlines():
        m = re.match(r"\s+- ([A-Za-z][\w.-]*)([<>=!~][^#\s]*)?", line)
        if m and m.group(1) not in ("python", "pip"):
            conda.add(CONDA_TO_PYPI.get(m.group(1), m.group(1)).lower())
    assert conda == set(pypi), f"only in environment.yml: {conda - set(pypi)}, only in pyproject: {set(pypi) - conda}"
    # conda-forge is the channel, the package itself comes from this checkout, the Pythons agree
    assert re.search(r"channels:\s*\n\s+- conda-forge", text), "environment.yml must use conda-forge"
    assert re.search(r"- pip:\s*\n(\s+- .*\n)*\s+- -e \.", text), "environment.yml must pip-install this package"
    python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f"- python{python}" in text, f"environment.yml's python should be {python}"
    # and the version floors agree
    for name, spec in pypi.items():
        floor = re.search(r">=([\d.]+)", spec)
        if floor:
            assert re.search(rf"(?i)(- {re.escape(name)}(\[[\w,]+\])?|pytorch-cpu)>={re.escape(floor.group(1))}", text), f"{name} floor differs"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme and "make lab" in readme
    # and installs the browser that tests/test_browser.py requires under CI
    assert re.search(r"apt-get install .*chromium", ci) and ci.index("chromium") < ci.index("make test")


def test_make_lab_serves_the_first_lesson():
    """The README's other command starts JupyterLab (as root too) with the course at its root, and
    the URL it prints (what a headless machine's user opens) lands on lesson 0, not the Launcher."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import time
    import urllib.error
    import urllib.request

    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve() or not (venv / ".installed").exists():
        pytest.skip("runs under `make test` (the .venv that `make lab` uses)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "dtlib-test"
    args = f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(["make", "-C", str(ROOT), "lab", f"LAB_ARGS={args}"], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)

    def printed() -> str:
        log.seek(0)
        return log.read()

    url = f"http://127.0.0.1:{port}/api/contents/notebooks/00_collectives.ipynb?token={token}&content=0"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"`make lab` exited: {printed()[-2000:]}"
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    assert r.status == 200
                    break
            except urllib.error.HTTPError:
                raise
            except OSError:  # not listening yet
                assert time.monotonic() < deadline, "JupyterLab did not answer within 60 s"
                time.sleep(0.5)
        # the URL printed for the user (it shows a token given in the config as "...")
        pattern = rf"http://127\.0\.0\.1:{port}(/\S*)\?token="
        while not re.search(pattern, printed()):
            assert time.monotonic() < deadline, f"no URL printed within 60 s: {printed()[-2000:]}"
            time.sleep(0.5)
        path = re.search(pattern, printed()).group(1)
        assert path == "/lab/tree/notebooks/00_collectives.ipynb", f"`make lab` prints {path}, not lesson 0"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?token={token}", timeout=10) as r:
            assert r.status == 200 and "JupyterLab" in r.read().decode()
        # no "get notified about Jupyter news?" pop-up: the served defaults say no (lab/overrides.json)
        notification = f"http://127.0.0.1:{port}/lab/api/settings/@jupyterlab/apputils-extension:notification"
        with urllib.request.urlopen(f"{notification}?token={token}", timeout=10) as r:
            schema = json.loads(r.read())["schema"]["properties"]
        assert schema["fetchNews"]["default"] == "false" and schema["checkForUpdates"]["default"] is False
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_make_lab_installs_the_course_s_jupyterlab_defaults(tmp_path):
    """`make lab` puts lab/overrides.json where JupyterLab reads packages' default overrides, and
    JupyterLab reads it: the news pop-up is off (issue 28: it covered the plots)."""
    import subprocess

    from jupyterlab_server.settings_utils import _get_overrides

    venv = tmp_path / "venv"
    target = venv / "share/jupyter/lab/settings/overrides.d/dtlib.json"
    subprocess.run(["make", "-C", str(ROOT), f"VENV={venv}", str(target)], check=True, capture_output=True,
                   timeout=60)
    overrides, error = _get_overrides(str(venv / "share/jupyter/lab/settings"))
    assert not error
    assert overrides["@jupyterlab/apputils-extension:notification"] == {"fetchNews": "false", "checkForUpdates": False}
    # and `make lab` depends on it
    dry = subprocess.run(["make", "-C", str(ROOT), "-n", f"VENV={venv}", "lab"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "jupyter lab" in dry and not re.search(r"^cp .*overrides", dry, re.M)  # already there: not copied again


def test_layout_by_concept_and_a_pure_analytic_core():
    """No module is named by lesson number, library code never imports a grader, and the analytic
    core loads without torch (numbers in, numbers out)."""
    import pathlib
    import re
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1] / "dtlib"
    numbered = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if re.search(r"lesson\d", p.name))
    assert not numbered, f"modules named by lesson number: {numbered}"
    importers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if "grading" not in p.parts
                       and re.search(r"^\s*(from|import) dtlib\.grading", p.read_text(), re.M))
    assert not importers, f"library modules that import a grader: {importers}"
    # importing runs only module-level imports: a torch import inside a function would pass the
    # import check below, so the source is read too
    lazy = sorted(str(p.relative_to(root)) for p in (root / "analytic").rglob("*.py")
                  if re.search(r"^\s*(from|import) torch\b", p.read_text(), re.M))
    assert not lazy, f"analytic modules that import torch (runtime code belongs outside dtlib.analytic): {lazy}"
    code = ("import sys, pkgutil, importlib, dtlib.analytic as a\n"
            "[importlib.import_module(m.name) for m in pkgutil.iter_modules(a.__path__, 'dtlib.analytic.')]\n"
            "import dtlib.cli\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('dtlib.parallel')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_license_is_an_spdx_expression():
    """A ``license = {text = ...}`` table makes setuptools print a deprecation warning at every
    install (PEP 639); an SPDX string needs setuptools >= 77 to build."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"
    assert "setuptools>=77" in project["build-system"]["requires"]


def _import_graph() -> dict[str, set[str]]:
    """dtlib's modules and the dtlib modules each imports, at module level or inside a function
    (a lazy import hides a circle from Python, not from a reader)."""
    import ast

    root = ROOT / "dtlib"
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base]).strip(".")
                for alias in node.names:  # from pkg import module: the module, not pkg/__init__
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_circle():
    """No dtlib module imports itself through others (Tarjan's strongly connected components).
    A package importing its own submodules (``dtlib.cli`` -> ``dtlib.cli.train``) is fine; a
    submodule importing back its package's ``__init__`` that imports it is a circle."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other in a circle: {circles}"


def test_import_graph_sees_a_circle():
    """The graph the circle test reads: the package imports its commands, and the trainer is not
    imported by the command line at module level (it needs torch)."""
    graph = _import_graph()
    assert "dtlib.cli.train" in graph["dtlib.cli"]
    assert "dtlib.trainer" in graph["dtlib.cli.train"]  # lazily, inside run_train
    assert "dtlib.cli" not in graph["dtlib.trainer"]
