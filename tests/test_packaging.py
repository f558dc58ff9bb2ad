"""pyproject.toml and environment.yml describe the same environment; CI calls the README's command."""
import contextlib
import re
import sys
import tomllib
from pathlib import Path
from typing import Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent
# conda-forge names that differ from PyPI's
CONDA_TO_PYPI = {"pytorch-cpu": "torch", "pytorch": "torch"}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower()  # ray[train] -> ray


def _requirements() -> tuple[list[str], dict[str, list[str]]]:
    """pyproject's core dependencies and its extras (without an extra's ``dtlib[...]`` references)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {name: [d for d in deps if _name(d) != "dtlib"]
              for name, deps in project["optional-dependencies"].items()}
    return project["dependencies"], extras


def test_environment_yml_matches_pyproject():
    """environment.yml is the whole environment (`make lab`, `make test`): the core and every extra."""
    core, extras = _requirements()
    deps = core + [d for group in extras.values() for d in group]
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
    assert re.search(r"- pip:\s*\n(\s+(- |# ).*\n)*\s+- -e \.", text), "environment.yml must pip-install this package"
    python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert f"- python{python}" in text, f"environment.yml's python should be {python}"
    # and the version floors agree
    for name, spec in pypi.items():
        floor = re.search(r">=([\d.]+)", spec)
        if floor:
            assert re.search(rf"(?i)(- {re.escape(name)}(\[[\w,]+\])?|pytorch-cpu)>={re.escape(floor.group(1))}", text), f"{name} floor differs"


def test_a_numpy_core_and_extras_that_match_dtlib_extras():
    """`pip install dtlib` is numpy only; the extras dtlib.extras names are pyproject's, and
    `all` (what `make lab` and `make test` install) is every extra."""
    from dtlib.extras import EXTRAS

    core, extras = _requirements()
    assert [_name(d) for d in core] == ["numpy"]
    for extra, provided in EXTRAS.items():
        assert sorted(provided.values()) == sorted(re.split(r"[<>=]", d)[0] for d in extras[extra]), extra
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert project["frameworks"][0] == "dtlib[course]"  # lesson 13 runs the frameworks next to dtlib's own
    everything = re.fullmatch(r"dtlib\[([\w,]+)\]", project["all"][0]).group(1).split(",")
    assert project["all"] == project["all"][:1] and sorted(everything) == sorted(set(extras) - {"all"})
    assert {"course", "frameworks", "site", "workshop", "test"} <= set(extras)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r'pip install .*-e "\.\[all\]"', makefile), "make install must install every extra"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make test" in ci and "make test" in readme and "make lab" in readme
    # and installs the browser that tests/test_browser.py requires under CI
    assert re.search(r"apt-get install .*chromium", ci) and ci.index("chromium") < ci.index("make test")


@contextlib.contextmanager
def _lab_on_lesson_0(command: Callable[[str], list[str]], what: str) -> Iterator[str]:
    """Start JupyterLab with ``command(server_args)``; check that it serves the course at its root
    and that the URL it prints (what a headless machine's user opens) lands on lesson 0, not the
    Launcher; yield its base URL (token ``dtlib-test``); stop it and all it started."""
    import os
    import signal
    import socket
    import subprocess
    import tempfile
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = "dtlib-test"
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(command(f"--no-browser --ip=127.0.0.1 --port={port} --IdentityProvider.token={token}"),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, text=True)

    def printed() -> str:
        log.seek(0)
        return log.read()

    url = f"http://127.0.0.1:{port}/api/contents/notebooks/00_collectives.ipynb?token={token}&content=0"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"{what} exited: {printed()[-2000:]}"
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
        assert path == "/lab/tree/notebooks/00_collectives.ipynb", f"{what} prints {path}, not lesson 0"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}?token={token}", timeout=10) as r:
            assert r.status == 200 and "JupyterLab" in r.read().decode()
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited: its failure is the news
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_make_lab_serves_the_first_lesson():
    """The README's other command starts JupyterLab (as root too) on lesson 0, without the news pop-up."""
    import json
    import urllib.request

    venv = ROOT / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve() or not (venv / ".installed").exists():
        pytest.skip("runs under `make test` (the .venv that `make lab` uses)")
    with _lab_on_lesson_0(lambda args: ["make", "-C", str(ROOT), "lab", f"LAB_ARGS={args}"], "`make lab`") as lab:
        # no "get notified about Jupyter news?" pop-up: the served defaults say no (lab/overrides.json)
        notification = f"{lab}/lab/api/settings/@jupyterlab/apputils-extension:notification"
        with urllib.request.urlopen(f"{notification}?token=dtlib-test", timeout=10) as r:
            schema = json.loads(r.read())["schema"]["properties"]
        assert schema["fetchNews"]["default"] == "false" and schema["checkForUpdates"]["default"] is False


def test_dtlib_course_opens_lesson_0(tmp_path, capsys):
    """The command `dtlib course DIR` runs (printed by --no-lab) serves the learner's copy on lesson 0."""
    import shlex

    from dtlib.cli import main

    assert main(["course", str(tmp_path / "course"), "--no-lab"]) == 0
    command = shlex.split(capsys.readouterr().out.splitlines()[-1])
    with _lab_on_lesson_0(lambda args: command + shlex.split(args), "dtlib course"):
        pass


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
    # `dtlib grade` is the grader's command (as `python -m dtlib.grading` is), not library code
    importers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if "grading" not in p.parts and p != root / "cli" / "grade.py"
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


def _without_extras(tmp_path: Path) -> dict[str, str]:
    """An environment in which no extra's import can be found (a sitecustomize sets each to None
    in sys.modules, which makes `import torch` raise ModuleNotFoundError)."""
    import os

    from dtlib.extras import EXTRAS

    blocked = sorted({name.split(".")[0] for provided in EXTRAS.values() for name in provided})
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules.update(dict.fromkeys({blocked!r}))\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}


def test_the_core_commands_run_without_any_extra(tmp_path):
    """plan, memory, flops, comm and profile's trace reading import numpy only; what needs an
    extra says which, in one line on stderr, with status 2 (no traceback)."""
    import subprocess
    import sys

    env = _without_extras(tmp_path)

    def dtlib(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dtlib.cli", *argv], capture_output=True, text=True,
                              env=env, timeout=120)

    assert "torch" in subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True,
                                     text=True).stderr
    for argv in (["plan", "--model", "llama3-8b", "--gpus", "64", "--global-batch", "512", "--top", "1"],
                 ["memory", "--model", "llama3-8b", "--tp", "8", "--gpus", "64"],
                 ["flops", "--model", "llama3-8b", "--gpus", "8", "--batch", "8"],
                 ["comm", "--collective", "all_reduce", "--bytes", "1GB", "--ranks", "8"]):
        done = dtlib(*argv)
        assert done.returncode == 0 and done.stdout and not done.stderr, (argv, done.stderr)
    done = dtlib("profile", str(tmp_path))  # reading traces loads no profiler: the folder is empty
    assert done.returncode == 2 and done.stderr.startswith("dtlib: error: no rank*.json trace"), done.stderr
    for argv, line in ((["train", "--steps", "1"], "dtlib train needs torch: pip install 'dtlib[course]'"),
                       (["shards", str(tmp_path / "s")], "dtlib shards needs torch: pip install 'dtlib[course]'")):
        done = dtlib(*argv)
        assert (done.returncode, done.stderr) == (2, f"dtlib: error: {line}\n"), done.stderr


def test_the_python_api_says_which_extra(tmp_path):
    """Importing a runtime module, or reaching dtlib.launch, without its extra raises MissingExtra
    (an ImportError) whose message is the one line; Jupyter shows only that line."""
    import subprocess
    import sys

    code = ("import dtlib\n"
            "from dtlib.extras import MissingExtra, require\n"
            "for attempt in ('import dtlib.parallel', 'dtlib.launch', 'import dtlib.viz',\n"
            "                'import dtlib.frameworks.megatron_core', 'require(\"frameworks\", feature=\"lesson 13\")'):\n"
            "    try:\n"
            "        exec(attempt)\n"
            "    except ImportError as exc:\n"
            "        assert isinstance(exc, MissingExtra)\n"
            "        print(exc._render_traceback_()[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=_without_extras(tmp_path), timeout=60).stdout
    assert out.splitlines() == [
        "MissingExtra: dtlib.parallel needs torch: pip install 'dtlib[course]'",
        "MissingExtra: dtlib.launch needs torch: pip install 'dtlib[course]'",
        "MissingExtra: dtlib.viz needs matplotlib: pip install 'dtlib[course]'",
        "MissingExtra: dtlib.frameworks.megatron_core needs megatron.core: pip install 'dtlib[frameworks]'",
        "MissingExtra: lesson 13 needs deepspeed: pip install 'dtlib[frameworks]'"]


def test_require_and_extra_of(monkeypatch):
    from dtlib.extras import MissingExtra, extra_of, missing, require

    require("course", "torch")  # installed here: nothing raised
    monkeypatch.setitem(sys.modules, "megatron", None)
    with pytest.raises(MissingExtra, match=r"^dtlib\.frameworks needs megatron\.core: pip install 'dtlib\[frameworks\]'$"):
        require("frameworks", "megatron.core", feature="dtlib.frameworks")
    with pytest.raises(ValueError, match=r"extra must be one of course, frameworks, got 'gpu'"):
        require("gpu")
    with pytest.raises(ValueError, match=r"imports must be among dtlib\[course\]'s"):
        require("course", "jax")
    assert [extra_of(m) for m in ("torch.distributed", "megatron", "jax.numpy", "numpy", "torchvision")] == [
        "course", "frameworks", "frameworks", None, None]
    monkeypatch.setitem(sys.modules, "ray", None)
    said = missing(ModuleNotFoundError("No module named 'ray.train'", name="ray.train"), "dtlib plan")
    assert str(said) == "dtlib plan needs ray: pip install 'dtlib[frameworks]'"
    assert missing(ModuleNotFoundError("No module named 'yaml'", name="yaml"), "dtlib plan") is None
    # torch is installed: a module missing from it is a version mismatch, not a missing extra
    assert missing(ModuleNotFoundError("No module named 'torch.nope'", name="torch.nope"), "dtlib train") is None
