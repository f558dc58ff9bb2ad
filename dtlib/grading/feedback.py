"""What a learner reads after ``grader.check("q1")``: one line per check, the hint first.

Otter's own report of a failing check is its whole transcript, with the sentence that helps last.
:func:`install` (called by every exercise's setup cell) makes IPython show instead, per check,
its name (the test function's docstring) and, for a failure, the first line of what it raised;
otter's full report follows, folded away in a ``<details>`` element in Jupyter. The tests are in
otter's exception-based format (``ok_format: false``), so what a check raised is a plain
``Type: message`` line, not a doctest transcript.
"""
from __future__ import annotations

import html
import sys
from typing import Any, Callable

__all__ = ["first_line", "hint", "summary_lines", "to_text", "to_html", "install"]


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` of what a rank raised (the launcher's error
    carries the rank's own exception as ``__cause__``); for a rank that only lost a peer (no
    cause), the launcher's own account of it ("it waited in a collective that ranks [1] never
    called ...")."""
    launcher = sys.modules.get("dtlib.launcher")  # not loaded: nothing raised is the launcher's
    if launcher and isinstance(exc, launcher.RankFailedError) and exc.__cause__ is None:
        return str(exc).split("\n", 1)[0].split(" failed: ", 1)[-1]
    cause = exc.__cause__ or exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"


def launch_checked(worker: Callable, world_size: int, args: tuple, timeout: float) -> list:
    """``dtlib.launch`` for a check: a rank that raises or a hang becomes an ``AssertionError``
    whose first line is the verdict (the rank's traceback follows it)."""
    from dtlib.launcher import LaunchTimeoutError, RankFailedError, launch  # torch: only for checks that launch

    try:
        return launch(worker, world_size, args=args, timeout=timeout, output="none")
    except LaunchTimeoutError:
        raise AssertionError(
            f"your function hung on {world_size} ranks (no result in {timeout:g} s): every rank "
            "must call the same collectives, in the same order") from None
    except RankFailedError as e:
        raise AssertionError(f"your function raised on rank {e.rank} of {world_size}: "
                             f"{first_line(e)}\n\n{e}") from None


def hint(message: str | None) -> str:
    """The first line of what a failed check raised, from otter's message for the test case.

    Otter writes ``❌ Test case failed``, ``Error at line N in test q1:``, the test's source line,
    then ``Type: message``; an ``AssertionError`` is a check's own verdict, so its type is dropped.
    """
    lines = (message or "").strip().splitlines()
    start = next((i + 2 for i, line in enumerate(lines) if line.startswith("Error at line")),
                 len(lines) - 1)
    raised = "\n".join(lines[start:]).strip().removeprefix("AssertionError: ")
    return raised.splitlines()[0] if raised else "failed"


def _check_name(case: Any) -> str:
    # The test function's docstring says what it checks; results unpickled by otter's grader
    # have lost the function, and fall back to otter's own name ("q1 - 1").
    doc = (getattr(getattr(case.body, "test_func", None), "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else case.name


def _score(result: Any) -> str:
    unit = "point" if result.possible == 1 else "points"
    return f"{result.score:g} of {result.possible:g} {unit}"


def summary_lines(result: Any) -> list[str]:
    """A check's result as short lines: one when every case passed; otherwise the score, then per
    case ``✅ name`` or ``❌ name`` followed by ``   → hint``."""
    score = _score(result)
    if result.passed_all:
        return [f"✅ {result.name} passed: {score}"]
    lines = [f"{result.name}: {score}"]
    for case_result in result.test_case_results:
        name = _check_name(case_result.test_case)
        if case_result.passed:
            lines.append(f"✅ {name}")
        else:
            lines += [f"❌ {name}", f"   → {hint(case_result.message)}"]
    return lines


def to_text(result: Any) -> str:
    """Plain text: the short lines, then otter's full report when something failed."""
    lines = summary_lines(result)
    if not result.passed_all:
        lines += ["", "details:", result.summary()]
    return "\n".join(lines)


def to_html(result: Any) -> str:
    """HTML: the short lines, otter's full report folded in a ``<details>`` element."""
    body = "<br>".join(html.escape(line).replace("   →", "&emsp;→") for line in summary_lines(result))
    if result.passed_all:
        return f"<p>{body}</p>"
    return (f"<p>{body}</p><details><summary>details</summary>"
            f"<pre>{html.escape(result.summary())}</pre></details>")


def install() -> None:
    """Show otter's check results with :func:`to_html`/:func:`to_text` in the running IPython
    (a no-op outside IPython, e.g. when a script imports the exercise)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    from otter.test_files.abstract_test import TestFile

    formatters = shell.display_formatter.formatters
    formatters["text/html"].for_type(TestFile, to_html)
    formatters["text/plain"].for_type(TestFile, lambda result, printer, cycle: printer.text(to_text(result)))
