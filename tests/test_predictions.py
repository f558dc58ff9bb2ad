"""Predict, then reveal: the reveal refuses before a prediction, shows the gap after, and the grader
never sees a prediction."""
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import dtlib.grading
from dtlib.predictions import PredictionMissing, forget, gap, predict, prediction, reveal

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh():
    forget("ring-bytes")
    yield
    forget("ring-bytes")


def test_reveal_refuses_without_a_prediction_in_one_line():
    with pytest.raises(PredictionMissing, match=r"^make your prediction in the cell above first") as info:
        reveal("ring-bytes", 1.5, explain="2(N-1)/N of the buffer")
    assert info.value._render_traceback_() == [f"PredictionMissing: {info.value}"]  # what Jupyter shows
    assert "\n" not in str(info.value)


def test_reveal_shows_the_prediction_beside_the_measurement_and_the_gap(capsys):
    predict("ring-bytes", 2, unit="MiB")
    assert capsys.readouterr().out.startswith("recorded your prediction for 'ring-bytes': 2 MiB;")
    reveal("ring-bytes", 1.5, unit="MiB", explain="each rank sends 2(N-1)/N of the buffer")
    first, why = capsys.readouterr().out.splitlines()
    assert first == "you predicted 2 MiB; this run: 1.5 MiB, off by -0.5 MiB (0.75x your prediction)"
    assert why == "why: each rank sends 2(N-1)/N of the buffer"
    predict("ring-bytes", 1.5, unit="MiB")  # a second guess replaces the first
    assert prediction("ring-bytes") == 1.5
    capsys.readouterr()
    predict("ring-bytes", 0, unit="%")
    reveal("ring-bytes", 18.8, unit="%", explain="x")
    assert capsys.readouterr().out.splitlines()[1] == "you predicted 0%; this run: 18.8%, off by +18.8%"


def test_gap_of_numbers_and_of_choices():
    assert gap(4, 3) == gap(4.0, 3.0)
    g = gap(4, 3)
    assert (g.difference, g.ratio, g.matched) == (-1.0, 0.75, False)
    assert gap(0, 2).ratio is None and gap(0, 2).difference == 2.0
    assert gap("ZeRO-2", "zero-2").matched and not gap("ZeRO-2", "ZeRO-3").matched


@pytest.mark.parametrize("value, message", [
    (..., "replace ... with your number"), (float("nan"), "finite"), (float("inf"), "finite"),
    (True, "a number or a choice"), ([1], "a number or a choice"), ("  ", "non-empty")])
def test_bad_predictions_are_refused_in_one_line(value, message):
    with pytest.raises(ValueError, match=message):
        predict("ring-bytes", value)
    with pytest.raises(PredictionMissing):  # nothing was recorded
        prediction("ring-bytes")


def test_bad_slug_number_vs_choice_and_empty_explanation_are_refused():
    with pytest.raises(ValueError, match="slug must be"):
        predict("Ring Bytes", 1)
    predict("ring-bytes", 1)
    with pytest.raises(ValueError, match="both be numbers or both be choices"):
        reveal("ring-bytes", "ZeRO-1", explain="x")
    with pytest.raises(ValueError, match="explain must say"):
        reveal("ring-bytes", 1, explain=" ")


def test_the_grader_never_imports_predictions():
    """A prediction lives in the lesson's kernel; no grading module (nor what it imports) and no
    master reads it, so it cannot change a grade."""
    modules = [f"dtlib.grading.{m.name}" for m in pkgutil.walk_packages(dtlib.grading.__path__)
               if m.name not in ("checks", "__main__")]
    modules += [f"dtlib.grading.checks.{m.name}" for m in pkgutil.iter_modules(
        [str(Path(dtlib.grading.__path__[0]) / "checks")])]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print('dtlib.predictions' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
    for master in (ROOT / "masters").glob("*.ipynb"):
        sources = "".join("".join(c["source"]) for c in json.loads(master.read_text())["cells"])
        assert "dtlib.predictions" not in sources, f"{master.name} reads predictions"
