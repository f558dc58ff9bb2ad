"""Every notebook (lesson or solved exercise) must run in under a minute on a 2-core machine.

nbval runs a notebook as one test per cell; this adds the cells' times up per notebook (kernel
start included) and fails the run, with a table, when a notebook goes over its budget.
"""
from collections import defaultdict

import pytest

NOTEBOOK_BUDGET_S = 60.0
_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        _seconds[path] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not _seconds:
        return
    over = {p: s for p, s in _seconds.items() if s > NOTEBOOK_BUDGET_S}
    terminalreporter.section("notebook run times")
    for path, s in sorted(_seconds.items()):
        terminalreporter.write_line(f"{s:6.1f} s  {path}" + ("   OVER BUDGET" if path in over else ""))
    if over:
        terminalreporter.write_line(f"notebooks over the {NOTEBOOK_BUDGET_S:.0f} s budget: {sorted(over)}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:  # noqa: ARG001
    if any(s > NOTEBOOK_BUDGET_S for s in _seconds.values()) and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
