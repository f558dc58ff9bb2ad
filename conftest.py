"""Every notebook (lesson or solved exercise) has a budget of what it costs, not of how long it waits.

nbval runs a notebook as one test per cell in one kernel. After each cell this reads the CPU
seconds the kernel and every process it started (the ranks a lesson launches, exited ones
included) have spent (:func:`dtlib.cpu_time.tree_cpu_seconds`); the notebook's cost is the last
reading. The run fails, with a table, when a notebook's CPU seconds go over the budget. Wall time
(the cells' durations, kernel start included) is printed beside it but never fails the run: on a
busy machine it grows with the other processes' load, CPU time does not (tests/test_cpu_time.py
runs a notebook beside a CPU hog). Measurements behind the budget: docs/site.md.

A cell that shows noise fails (issue 38: a learner reads every line): anything on stderr (Jupyter's
red box) or a warning on stdout (a ``[WARNING]`` log line, a Python ``...Warning:``), unless
:data:`ALLOWED_NOISE` lists it. Framework notices are silenced at their source or folded
(``dtlib.experiments.framework_notices``), so nothing is listed today.

Each notebook's kernel gets a temporary directory of its own (``TMPDIR``); after its last cell the
kernel is shut down as JupyterLab shuts one down (a shutdown request, so ``atexit`` and
``TemporaryDirectory`` clean up), and the notebook fails when anything is left in that directory:
a lesson leaves nothing in the system temp directory. The directory is then removed. PyTorch's
compiler cache, which would go there, goes to ``~/.cache/dtlib/torchinductor``.

With ``--executed-dir=DIR`` each notebook is also written to DIR (same relative path) with the
outputs nbval received, as soon as its last cell has run, so the website (``book/build.py``)
publishes the run of ``make test`` without executing every lesson a second time.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

# "Under a minute on a 2-core machine" with both cores busy: 60 s x 2 cores.
NOTEBOOK_CPU_BUDGET_S = 120.0
_wall: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = {}
_CPU_PROPERTY = "notebook_cpu_s"
# a warning printed to stdout: a logger's "[WARNING]" line, Python's "...Warning: message" line
_STDOUT_WARNING = re.compile(r"\[WARNING\]|^\s*(?:\S+:\d+: )?\w*Warning: |warnings\.warn\(")
# regular expressions of the noise lines a notebook may show (each with the reason it is allowed)
ALLOWED_NOISE: tuple[re.Pattern, ...] = ()


def noise(outputs: list) -> list[str]:
    """The lines of a cell's ``outputs`` (nbformat output dicts) a learner should not see: every
    non-empty stderr line and every stdout warning line that :data:`ALLOWED_NOISE` does not list."""
    lines = []
    for out in outputs:
        if out.get("output_type") != "stream":
            continue
        text = out["text"] if isinstance(out["text"], str) else "".join(out["text"])
        for line in text.splitlines():
            if line.strip() and (out["name"] == "stderr" or _STDOUT_WARNING.search(line)):
                lines.append(line)
    return [line for line in lines if not any(allowed.search(line) for allowed in ALLOWED_NOISE)]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("notebook budget")
    group.addoption("--notebook-cpu-budget", type=float, default=NOTEBOOK_CPU_BUDGET_S,
                    help="CPU seconds a notebook (its kernel and its ranks) may spend "
                         f"(default {NOTEBOOK_CPU_BUDGET_S:.0f})")
    group.addoption("--executed-dir", default=None,
                    help="write each executed notebook, with its outputs, into this folder")


def pytest_configure(config: pytest.Config) -> None:
    budget = config.getoption("--notebook-cpu-budget")
    if not budget > 0:
        raise pytest.UsageError(f"--notebook-cpu-budget must be a positive number of seconds, got {budget}")


def _notebook(item: pytest.Item) -> str | None:
    """The notebook's path (relative to the rootdir) when the item is one of its cells."""
    path = item.nodeid.split("::", 1)[0]
    return path if path.endswith(".ipynb") else None


def _kernel_pid(item: pytest.Item) -> int | None:
    kernel = getattr(item.parent, "kernel", None)
    km = getattr(kernel, "km", None)  # nbval deletes it when the kernel is stopped
    return getattr(getattr(km, "provisioner", None), "pid", None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    """Before a notebook's kernel starts (its first cell's setup): a fresh TMPDIR for that kernel."""
    first = _notebook(item) is not None and getattr(item.parent, "kernel", None) is None
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR")}
    if first:
        item.parent.dtlib_tmpdir = tempfile.mkdtemp(prefix="dtlib-notebook-tmp-")
        os.environ["TMPDIR"] = item.parent.dtlib_tmpdir  # read by the kernel, and by what it starts
        # PyTorch's compiler cache (inductor: DeepSpeed and DCP import it) defaults to
        # $TMPDIR/torchinductor_<user> (torch/_inductor/runtime/cache_dir_utils.py): a cache, kept
        # between runs, in the user's cache directory rather than in the temp directory
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path.home() / ".cache" / "dtlib" / "torchinductor"))
    yield
    if first:  # this process keeps its own
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _last_cell(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    return _notebook(item) is not None and getattr(nextitem, "parent", None) is not item.parent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a notebook's last cell: save it with its outputs (``--executed-dir``: a later test may
    read it); shut its kernel down cleanly (nbval would kill it, and a killed kernel cleans nothing
    up), then fail if the kernel's TMPDIR is not empty."""
    last = _last_cell(item, nextitem)
    executed = item.config.getoption("--executed-dir")
    if last and executed:
        import nbformat

        target = Path(executed) / _notebook(item)
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(item.parent.nb, str(target))
    folder = getattr(item.parent, "dtlib_tmpdir", None) if last else None
    kernel = getattr(item.parent, "kernel", None)
    if folder and kernel is not None and kernel.is_alive():
        kernel.kc.stop_channels()
        kernel.km.shutdown_kernel(now=False)  # a shutdown request; killed only if it does not exit
    outcome = yield
    if folder:
        left = sorted(os.listdir(folder))
        shutil.rmtree(folder, ignore_errors=True)
        if left and outcome.exception is None:
            outcome.force_exception(AssertionError(
                f"{_notebook(item)} left {len(left)} entr{'y' if len(left) == 1 else 'ies'} in its temporary "
                f"directory (use tempfile.TemporaryDirectory, or remove what you make): {left[:10]}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    outcome = yield
    path = _notebook(item)
    if path is None:
        return
    shown = noise(getattr(item, "test_outputs", None) or [])
    if shown and outcome.exception is None:
        outcome.force_exception(AssertionError(
            f"the cell shows {len(shown)} line(s) of noise (stderr or a warning; conftest.ALLOWED_NOISE lists "
            "what is allowed):\n" + "\n".join(shown[:10])))
    from dtlib.cpu_time import tree_cpu_seconds  # psutil: only where notebooks are run

    pid = _kernel_pid(item)
    if pid is not None:
        try:
            # carried by the cell's report, so that under pytest-xdist the controller sees it too
            item.user_properties.append((_CPU_PROPERTY, tree_cpu_seconds(pid)))
        except ValueError:  # the kernel died in this cell; nbval reports that failure
            pass
    outputs = getattr(item, "test_outputs", None)
    if item.config.getoption("--executed-dir") and outputs is not None:
        item.cell.outputs = list(outputs)  # nbval's cell is the one in item.parent.nb


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        _wall[path] += report.duration
        for name, value in report.user_properties:
            if name == _CPU_PROPERTY:
                _cpu[path] = max(_cpu.get(path, 0.0), value)


def _over(config: pytest.Config) -> list[str]:
    budget = config.getoption("--notebook-cpu-budget")
    return sorted(p for p, s in _cpu.items() if s > budget)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _wall:
        return
    over = _over(config)
    terminalreporter.section("notebook costs (the budget is on CPU seconds of the kernel and its ranks)")
    terminalreporter.write_line("   CPU s   wall s  notebook")
    for path in sorted(_wall):
        cpu = f"{_cpu[path]:8.1f}" if path in _cpu else "       -"
        terminalreporter.write_line(f"{cpu} {_wall[path]:8.1f}  {path}" + ("   OVER BUDGET" if path in over else ""))
    if over:
        budget = config.getoption("--notebook-cpu-budget")
        terminalreporter.write_line(f"notebooks over the {budget:.0f} CPU-second budget: {over}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    # (a pytest-xdist worker's reports reach the controller, whose session decides the status)
    if _over(session.config) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
