"""Behavioural checks behind the graded exercises (called from the otter tests).

Each ``check_*`` takes the learner's function, exercises it (on real ranks where it matters) and
raises ``AssertionError`` with a message that says what is wrong and how to fix it. The same
checks are run by pytest against correct and deliberately wrong implementations.
"""

from __future__ import annotations

import math
from typing import Any, Sequence


def max_diff(a: Sequence[Any], b: Sequence[Any]) -> float:
    """The largest absolute difference between paired tensors: nan where either side holds a NaN
    (Python's ``max`` would drop it, and ``nan <= tol`` is False, so a NaN never passes a check)."""
    diffs = [(x - y).abs().max().item() for x, y in zip(a, b)]
    if any(math.isnan(d) for d in diffs):
        return math.nan
    return max(diffs)
