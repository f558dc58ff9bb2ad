"""Predict, then measure: the learner commits to a number before the cell that computes it.

The references learners use most (the JAX scaling book's worked problems, the MLSys book's
prediction locks, CS336's back-of-envelope problems) ask for the number first. A lesson does the
same in two cells::

    predict("ring-bytes", 1.5, unit="MiB")      # the learner's guess (the lesson ships an example)
    ...                                         # the cells that measure or compute it
    reveal("ring-bytes", measured_mib, unit="MiB", explain="each rank sends 2(N-1)/N of the buffer")

:func:`reveal` refuses, with one line, when no prediction was made in this kernel, so the
measurement cannot be read before the guess; then it prints the guess beside the measurement and
the gap. Predictions live in this kernel's memory only: nothing is written to disk and the grader
(``dtlib.grading``) never imports this module, so a prediction never changes a grade
(``tests/test_predictions.py``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from numbers import Real
from typing import Union

__all__ = ["Gap", "PredictionMissing", "forget", "gap", "predict", "prediction", "reveal"]

Value = Union[float, str]
_SLUG = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_PREDICTIONS: dict[str, Value] = {}


class PredictionMissing(RuntimeError):
    """:func:`reveal` ran before the :func:`predict` cell above it."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of a traceback: the learner reads one sentence.
        return [f"{type(self).__name__}: {self}"]


@dataclass(frozen=True)
class Gap:
    """A prediction beside its measurement. For numbers, ``difference`` is measured - predicted and
    ``ratio`` measured / predicted (None when the prediction is 0); for a choice, ``matched``."""

    predicted: Value
    measured: Value
    difference: float | None
    ratio: float | None
    matched: bool


def _check_slug(slug: str) -> str:
    if not isinstance(slug, str) or not _SLUG.match(slug):
        raise ValueError(f"slug must be a lower-case name with dashes such as 'ring-bytes', got {slug!r}")
    return slug


def _check_value(name: str, value: object) -> Value:
    if value is Ellipsis:
        raise ValueError(f"{name}: replace ... with your number (or choice), then run the cell")
    if isinstance(value, bool) or not isinstance(value, (Real, str)):
        raise ValueError(f"{name} must be a number or a choice (a string), got {type(value).__name__}")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{name} must be a non-empty choice, got {value!r}")
        return value.strip()
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def gap(predicted: Value, measured: Value) -> Gap:
    """Compare a prediction with a measurement: both numbers, or both choices (strings, compared
    without regard to case)."""
    predicted, measured = _check_value("predicted", predicted), _check_value("measured", measured)
    if isinstance(predicted, str) != isinstance(measured, str):
        raise ValueError(f"predicted ({predicted!r}) and measured ({measured!r}) must both be numbers "
                         "or both be choices")
    if isinstance(predicted, str):
        return Gap(predicted, measured, None, None, predicted.lower() == str(measured).lower())
    ratio = measured / predicted if predicted != 0 else None
    return Gap(predicted, measured, measured - predicted, ratio, measured == predicted)


def predict(slug: str, value: Value, *, unit: str = "") -> None:
    """Record the learner's prediction for ``slug`` in this kernel (a new one replaces the old)."""
    _PREDICTIONS[_check_slug(slug)] = _check_value("your prediction", value)
    print(f"recorded your prediction for {slug!r}: {_show(_PREDICTIONS[slug], unit)}; "
          "the cells below compute or measure it")


def prediction(slug: str) -> Value:
    """The prediction recorded for ``slug``; :class:`PredictionMissing` when there is none."""
    if _check_slug(slug) not in _PREDICTIONS:
        raise PredictionMissing(f"make your prediction in the cell above first: predict({slug!r}, your number)")
    return _PREDICTIONS[slug]


def forget(slug: str) -> None:
    """Drop the prediction for ``slug`` (so the next :func:`reveal` asks for a new one)."""
    _PREDICTIONS.pop(_check_slug(slug), None)


def reveal(slug: str, measured: Value, *, explain: str, unit: str = "") -> None:
    """Print the prediction for ``slug`` beside ``measured`` and the gap, then ``explain`` (why the
    number is what it is). Refuses with :class:`PredictionMissing` before :func:`predict`."""
    if not isinstance(explain, str) or not explain.strip():
        raise ValueError("explain must say in a sentence why the measured value is what it is")
    result = gap(prediction(slug), measured)
    if isinstance(result.predicted, str):
        verdict = "✓ as you predicted" if result.matched else "✗ not what you predicted"
    elif result.ratio is None:
        verdict = f"off by {_show(result.difference, unit, sign=True)}"
    else:
        verdict = f"off by {_show(result.difference, unit, sign=True)} ({result.ratio:.3g}x your prediction)"
    print(f"you predicted {_show(result.predicted, unit)}; this run: {_show(result.measured, unit)}, {verdict}")
    print(f"why: {explain.strip()}")


def _show(value: Value, unit: str, sign: bool = False) -> str:
    text = value if isinstance(value, str) else format(value, "+.4g" if sign else ".4g")
    return f"{text}%" if unit == "%" else f"{text} {unit}".rstrip()
