"""Claims: a lesson's quantitative sentences checked against the numbers its run just printed.

A lesson says "the bubble shrinks with more micro-batches" or "MFU stays under 1%" next to
numbers computed on the learner's machine. :func:`claim` states such a sentence with the condition
that makes it true of those numbers, right after the cell that computes them::

    claim(hfu >= mfu, "HFU counts every FLOP the hardware ran, so HFU >= MFU",
          mfu=f"{mfu:.1%}", hfu=f"{hfu:.1%}")

True, it prints one line (``✓ HFU counts ... (mfu 34.0%, hfu 36.1%)``) so the learner sees the
sentence confirmed on their own run; false, it raises :class:`ClaimError` quoting the sentence and
the values, so nbval (``make test``) fails the build instead of the lesson misleading a learner.
``tests/test_notebooks.py`` checks that every lesson makes at least one claim.
"""
from __future__ import annotations

from typing import Any

__all__ = ["ClaimError", "claim"]


class ClaimError(AssertionError):
    """A lesson's sentence is false of the numbers this run computed."""


def claim(condition: Any, sentence: str, **values: Any) -> None:
    """Check that ``sentence`` (the lesson's prose) holds: ``condition`` is its truth on this run's
    numbers, ``values`` the numbers it rests on (shown either way, formatted as given).

    Prints ``✓ sentence (values)`` when true; raises :class:`ClaimError` naming the sentence and
    the values when false."""
    if not isinstance(sentence, str) or not sentence.strip():
        raise ValueError(f"sentence must be the lesson's claim as a non-empty string, got {sentence!r}")
    shown = ", ".join(f"{name} {value}" for name, value in values.items())
    suffix = f" ({shown})" if shown else ""
    if not bool(condition):
        raise ClaimError(f"the lesson says: {sentence!r}, but this run disagrees{suffix}")
    print(f"✓ {sentence}{suffix}")
