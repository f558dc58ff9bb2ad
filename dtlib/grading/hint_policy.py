"""The rules every check's message (the learner's hint) follows, as code the tests run.

A failing check shows the first line of what it raised (:func:`dtlib.grading.feedback.hint`). That
line must name the mistake and where to look, never hand over the answer:

1. the first line is one short sentence: non-empty, at most :data:`MAX_FIRST_LINE` characters
   (details may follow on later lines, folded away);
2. the check's own text (its first paragraph: a rank's traceback may follow a blank line) contains
   no expression of the solution: no line of the master's solution code (each statement, and the
   right-hand side of an assignment or ``return``, whitespace ignored) that the learner was not
   already given in the exercise's text (the question states ``rank = tp_rank + tp * ...``: naming
   it is not giving it away);
3. nor any pattern the checks module lists in ``HINT_FORBIDDEN`` (regular expressions): the
   solution written differently from the master's source (``max(n * t(bucket) - backward, ...)``)
   or its values (the best layout of a design question).

The expected *output of a learner's function* on a test input ("returned 3, expected 4") is not the
answer and may be shown; the expected *value* of a value question (a layout, a report's number) is
the answer and goes in ``HINT_FORBIDDEN``. Later checks of a question never blame a part an earlier
check already found wrong: they say "fix ... first".
"""
from __future__ import annotations

import importlib
import io
import re
import tokenize
from functools import lru_cache
from pathlib import Path

import nbformat

__all__ = ["MAX_FIRST_LINE", "solution_fragments", "forbidden_patterns", "violations", "master_of"]

MAX_FIRST_LINE = 300
_MIN_FRAGMENT = 8  # shorter pieces ("g - p", "n * t") occur in any sentence about the question
_ASSIGN = re.compile(r"^[\w.\[\]\"', ]+?\s*(?:[-+*/%]|//)?=\s*(?!=)(.+)$")
_RETURN = re.compile(r"^(?:return|yield)\s+(.+)$")


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _code_only(line: str) -> str:
    """``line`` without its comment (``# SOLUTION`` markers included)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.strip() + "\n").readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line.split("#", 1)[0].strip()
    comment = next((t for t in tokens if t.type == tokenize.COMMENT), None)
    return line.strip()[:comment.start[1]].strip() if comment else line.strip()


def _solution_lines(source: str) -> tuple[list[str], list[str]]:
    """(solution lines, other lines) of a master's code cell: lines between ``# BEGIN SOLUTION``
    and ``# END SOLUTION`` comments, and lines marked ``# SOLUTION``."""
    solution, other, inside = [], [], False
    for line in source.splitlines():
        marker = line.strip()
        if marker == "# BEGIN SOLUTION":
            inside = True
        elif marker == "# END SOLUTION":
            inside = False
        elif inside or marker.endswith("# SOLUTION"):
            solution.append(line)
        else:
            other.append(line)
    return solution, other


@lru_cache(maxsize=None)
def solution_fragments(master: Path) -> tuple[str, ...]:
    """The solution's expressions (whitespace removed) a hint must not contain (rule 2)."""
    nb = nbformat.read(str(master), as_version=4)
    given, candidates = [], []
    for cell in nb.cells:
        if cell.cell_type != "code":
            given.append(cell.source)
            continue
        solution, other = _solution_lines(cell.source)
        given += other
        for line in solution:
            code = _code_only(line)
            candidates.append(code)
            for pattern in (_ASSIGN, _RETURN):
                found = pattern.match(code)
                if found:
                    candidates.append(found.group(1))
    known = _squash("\n".join(given))
    fragments = {_squash(c) for c in candidates}
    return tuple(sorted(f for f in fragments
                        if len(f) >= _MIN_FRAGMENT and re.search(r"[-+*/%(\[]", f)
                        and not f.endswith(":") and f not in known))  # a `for`/`if` line is no formula


def forbidden_patterns(checks_module: str) -> tuple[str, ...]:
    """``HINT_FORBIDDEN`` of ``dtlib.grading.checks.<checks_module>`` (rule 3), empty if none."""
    module = importlib.import_module(f"dtlib.grading.checks.{checks_module}")
    return tuple(getattr(module, "HINT_FORBIDDEN", ()))


def master_of(checks_module: str, masters: list[Path]) -> Path | None:
    """The master whose setup imports ``dtlib.grading.checks.<checks_module> as checks``."""
    needle = f"from dtlib.grading.checks import {checks_module} as checks"
    return next((m for m in masters if needle in m.read_text()), None)


def violations(message: str, checks_module: str, master: Path | None) -> list[str]:
    """What breaks rules 1-3 in ``message`` (a check's ``AssertionError`` text); empty if none."""
    first = message.strip().split("\n", 1)[0]
    own = message.strip().split("\n\n", 1)[0]
    found = []
    if not first:
        found.append("the first line is empty")
    if len(first) > MAX_FIRST_LINE:
        found.append(f"the first line has {len(first)} characters (at most {MAX_FIRST_LINE})")
    squashed = _squash(own)
    for fragment in solution_fragments(master) if master else ():
        if fragment in squashed:
            found.append(f"it contains the solution's {fragment!r}")
    for pattern in forbidden_patterns(checks_module):
        if re.search(pattern, own):
            found.append(f"it matches HINT_FORBIDDEN {pattern!r}")
    return found
