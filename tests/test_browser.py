"""The widgets in a real browser: JupyterLab driven by headless Chromium through Playwright.

What it covers (about 2 minutes on 2 busy cores):

- lesson 0 (``notebooks/00_collectives.ipynb``, the page ``make lab`` opens), every cell run with
  *Run All Cells*: no error output, no "Error displaying widget", no JavaScript error in the page;
  its widget renders as controls and redraws when one is moved;
- every other widget the lessons show (``dtlib.widgets.REGISTRY``, which ``tests/test_widgets.py``
  keeps equal to the lessons' widgets), each built by a cell as a lesson builds it, in one
  notebook: each renders as controls, its first control is moved and its picture changes.
  The rest of each lesson runs under nbval (``make test``), so it is not run here twice.

It needs Debian's ``chromium`` and the ``playwright`` package (Playwright's own browser download
is not used). Without them it skips with one line saying how to enable it, except under CI
(``CI=true``), where a missing browser fails: ``.ci/run`` installs it.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest

from _server import serve

ROOT = Path(__file__).resolve().parents[1]
FIRST_LESSON = "00_collectives.ipynb"
CHROMIUM = os.environ.get("DTLIB_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
HOW = "apt-get install chromium && pip install playwright (CI=true makes this a failure)"
# How long one step may take before the test fails (a hang fails fast, not at pytest's limit).
START_S, CELL_S, REDRAW_S = 60, 30, 60
# The outermost box of a widget in an output (an Explorer is a VBox).
WIDGET = ".jp-OutputArea-output > .widget-vbox"
# A rendered control of each kind ipywidgets draws (dropdowns are <select>, sliders noUiSlider).
CONTROL = ".widget-dropdown select, .noUi-handle, .widget-checkbox input"

pytestmark = pytest.mark.timeout(300)


def _missing() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package"
    if not CHROMIUM:
        return "a chromium binary on PATH (or DTLIB_CHROMIUM)"
    return None


_MISSING = _missing()
if _MISSING and os.environ.get("CI") != "true":  # one line for the file; under CI the fixture fails
    pytest.skip(f"browser test needs {_MISSING}: {HOW}", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _widget_notebook() -> dict:
    """One cell per registered widget, built as the lessons build it (import, then call)."""
    import importlib
    import pkgutil

    import nbformat

    import dtlib.widgets
    from dtlib.widgets import REGISTRY

    for mod in pkgutil.iter_modules(dtlib.widgets.__path__):
        importlib.import_module(f"dtlib.widgets.{mod.name}")
    lesson0 = (ROOT / "notebooks" / FIRST_LESSON).read_text()
    cells = [nbformat.v4.new_code_cell(f"from {b.__module__} import {b.__name__}\n{b.__name__}()")
             for b in REGISTRY.values() if f"{b.__name__}()" not in lesson0]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A JupyterLab on a free port (no token, as root too), serving copies of the notebooks from a
    temporary folder, with its own config/runtime/settings folders; stopped with every kernel
    and every rank it started."""
    if _MISSING:
        pytest.fail(f"browser test needs {_MISSING}: {HOW}")
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "course"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / FIRST_LESSON, root / FIRST_LESSON)
    _write(root / "widgets.ipynb", _widget_notebook())
    settings = tmp / "settings"
    # every cell in the DOM (no virtual scrolling), the kernel starts without asking, no autosave,
    # no news pop-up
    _write(settings / "@jupyterlab/notebook-extension/tracker.jupyterlab-settings",
           {"windowingMode": "none", "autoStartDefaultKernel": True})
    _write(settings / "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings", {"autosave": False})
    _write(settings / "@jupyterlab/apputils-extension/notification.jupyterlab-settings",
           {"fetchNews": "false", "checkForUpdates": False})
    port = _free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
           "IPYTHONDIR": str(tmp / "ipython"), "PYTHONPATH": os.pathsep.join(
               [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    args = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={root}",
            f"--LabApp.user_settings_dir={settings}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}"]
    if os.getuid() == 0:
        args.append("--allow-root")
    with serve(args, f"http://127.0.0.1:{port}/api/status", tmp / "lab.log", START_S, 20, env=env):
        yield f"http://127.0.0.1:{port}"


@contextlib.contextmanager
def launched_chromium(timeout_s: float):
    """Debian's Chromium under Playwright, closed on exit. --no-sandbox: Chromium's sandbox needs
    user namespaces, which root in a container lacks; a container's /dev/shm is often too small
    for it, so it uses /tmp instead."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"],
                                     timeout=timeout_s * 1000)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="module")
def browser(lab):
    with launched_chromium(START_S) as chromium:
        yield chromium


class Lab:
    """One notebook open in JupyterLab, and what went wrong in the page while it was."""

    def __init__(self, browser, base: str, name: str, shots: Path):
        self.shots = shots
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.set_default_timeout(CELL_S * 1000)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(f"page error: {exc}"))
        # ?reset: a fresh workspace, so no tab of an earlier test comes back
        self.page.goto(f"{base}/lab/tree/{name}?reset", timeout=START_S * 1000)
        self.panel = self.page.locator(".jp-NotebookPanel:visible")
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=START_S * 1000)
        # the kernel has started and answered (the status bar names it and says Idle)
        self.page.locator(".jp-StatusBar-TextItem", has_text="| Idle").first.wait_for(timeout=START_S * 1000)

    def run_all(self) -> None:
        self.page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        self.page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        code = self.panel.locator(".jp-CodeCell .jp-InputPrompt")
        n = code.count()
        # finished: every code cell has an execution count (not [*] or blank)
        try:
            self.page.wait_for_function(
                """n => {const p = [...document.querySelectorAll(
                             '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputPrompt')];
                         return p.length === n && p.every(e => /\\[\\d+\\]/.test(e.textContent));}""",
                arg=n, timeout=CELL_S * 1000 * n)
        except Exception as exc:
            self.page.screenshot(path=str(self.shots / "run_all.png"), full_page=True)
            prompts = code.evaluate_all("ps => ps.map(p => p.textContent)")
            raise AssertionError(f"cells did not finish: prompts {prompts}; page in {self.shots}") from exc

    def problems(self) -> list[str]:
        """Error outputs (tracebacks), widgets shown as text or failing to render, JS errors."""
        found = list(self.errors)
        for out in self.panel.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']").all():
            text = out.inner_text()
            if "Traceback" in text or "Error" in text:
                found.append(f"error output: {text[-500:]}")
        for text in ("Error displaying widget", "Loading widgets", "VBox(children"):
            if self.panel.get_by_text(text).count():
                found.append(f"the page shows {text!r}")
        return found

    def widgets(self):
        """The outermost widget box of each output."""
        return self.panel.locator(WIDGET)

    def close(self) -> None:
        self.page.close()


def _check_widget(box, label: str) -> None:
    """``box`` renders as controls and a picture; moving its first control redraws the picture."""
    controls = box.locator(CONTROL)
    assert controls.count() >= 1, f"{label}: no control rendered: {box.inner_text()[:300]}"
    cut = box.locator(".widget-label").evaluate_all(
        "ls => ls.filter(l => l.scrollWidth > l.clientWidth + 1).map(l => l.textContent)")
    assert cut == [], f"{label}: descriptions cut short: {cut}"
    img = box.locator(".widget-output img").first
    img.wait_for(state="visible", timeout=REDRAW_S * 1000)
    before = img.get_attribute("src")
    first = controls.first
    if first.evaluate("e => e.tagName") == "SELECT":
        options = first.locator("option").all_inner_texts()
        current = first.evaluate("e => e.value")
        first.select_option(next(o for o in options if o != current))
    else:  # a slider handle: one step right, as a keyboard user would (or left at the end)
        first.focus()
        key = "ArrowLeft" if first.get_attribute("aria-valuenow") == first.get_attribute("aria-valuemax") else "ArrowRight"
        first.press(key)
    try:
        box.page.wait_for_function(
            "([box, before]) => { const i = box.querySelector('.widget-output img');"
            " return i !== null && i.getAttribute('src') !== before; }",
            arg=[box.element_handle(), before], timeout=REDRAW_S * 1000)
    except Exception as exc:
        raise AssertionError(f"{label}: moving its first control did not change the picture within "
                             f"{REDRAW_S} s; the widget shows: {box.inner_text()[:300]}") from exc


def test_first_lesson_runs_in_the_browser(browser, lab, tmp_path):
    """Lesson 0 as a learner meets it: all cells run, nothing errs, the widget is live."""
    nb = Lab(browser, lab, FIRST_LESSON, tmp_path)
    try:
        nb.run_all()
        boxes = nb.widgets()
        assert boxes.count() == 1, f"expected lesson 0's one widget, found {boxes.count()}"
        _check_widget(boxes.first, "collectives_explorer")
        assert nb.problems() == []
    finally:
        nb.close()


def test_every_widget_renders_and_redraws_in_the_browser(browser, lab, tmp_path):
    nb = Lab(browser, lab, "widgets.ipynb", tmp_path)
    try:
        nb.run_all()
        cells = nb.panel.locator(".jp-CodeCell")
        assert cells.count() >= 1
        for i in range(cells.count()):
            cell = cells.nth(i)
            label = cell.locator(".jp-InputArea-editor").inner_text().splitlines()[-1]
            boxes = cell.locator(WIDGET)
            assert boxes.count() == 1, f"{label}: no widget rendered: {cell.locator('.jp-OutputArea').inner_text()[:300]}"
            _check_widget(boxes.first, label)
        assert nb.problems() == []
    finally:
        nb.close()
