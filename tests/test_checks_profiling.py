"""The profiling exercise's checks accept the right diagnosis and a hand-written MFU, and reject the
classic mistakes with a message naming the cause."""
import pytest

from dtlib.grading.checks import profiling as checks

RIGHT = {"A": {"bottleneck": "straggler", "fix": "d"}, "B": {"bottleneck": "input", "fix": "f"},
         "C": {"bottleneck": "bubble", "fix": "b"}}


def mfu(step_time, batch, seq, params, layers, hidden, gpus, peak, forward=3, attention=True,
        per_token=True, all_gpus=True):
    """Hand-written PaLM App. B: (6N + 12 L h s) per token; the flags plant the classic mistakes."""
    flops_per_token = forward * 2 * params + attention * forward * 4 * layers * hidden * seq
    tokens = batch * seq if per_token else batch
    return flops_per_token * tokens / (step_time * (gpus if all_gpus else 1) * peak)


def test_right_diagnosis_passes():
    checks.check_diagnosis(RIGHT)


def test_menu_letters_are_the_fixes_of_the_answers():
    assert checks.FIX_MENU["d"].startswith("find out why that rank")
    assert "num_workers" in checks.FIX_MENU["f"] and "micro-batches" in checks.FIX_MENU["b"]


@pytest.mark.parametrize("change, message", [
    ({"A": {"bottleneck": "communication", "fix": "e"}}, "even the rank that waits least"),
    ({"B": {"bottleneck": "launch", "fix": "a"}}, "'data' column"),
    ({"C": {"bottleneck": "bubble", "fix": "f"}}, "does not address a bubble"),
    ({"C": {"bottleneck": "pipeline", "fix": "b"}}, "is not one of"),
    ({"B": {"bottleneck": "input", "fix": "z"}}, "one letter of FIX_MENU"),
])
def test_wrong_diagnosis_is_named(change, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_diagnosis({**RIGHT, **change})


def test_stub_answers_fail():
    with pytest.raises(AssertionError, match="keys"):
        checks.check_diagnosis(...)


def test_mfu_reference_passes():
    checks.check_mfu(mfu)


def test_mfu_value_matches_a_hand_computed_case():
    # GPT-2 small shape on one H100: (6 x 85e6 + 12 x 12 x 768 x 1024) x 16 x 1024 / (0.35 x 989.5e12)
    per_token = 6 * 85e6 + 12 * 12 * 768 * 1024
    expected = per_token * 16 * 1024 / (0.35 * 989.5e12)
    assert mfu(0.35, 16, 1024, 85e6, 12, 768, 1, 989.5e12) == pytest.approx(expected)


@pytest.mark.parametrize("kwargs, message", [
    ({"forward": 1}, "forward pass only"),
    ({"attention": False}, "attention term is missing"),
    ({"all_gpus": False}, "all the GPUs"),
    ({"per_token": False}, "per token"),
])
def test_mfu_mistakes_are_named(kwargs, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_mfu(lambda *a: mfu(*a, **kwargs))


def test_mfu_percentage_and_stub():
    with pytest.raises(AssertionError, match="fraction"):
        checks.check_mfu(lambda *a: 100 * mfu(*a))
    with pytest.raises(AssertionError, match="returned None"):
        checks.check_mfu(lambda *a: None)


def test_each_profile_is_judged_on_its_own():
    """Issue 28, item 9: two right diagnoses of three scored 0 of 3 (Q1 was one all-or-nothing check)."""
    one_wrong = {**RIGHT, "B": {"bottleneck": "communication", "fix": "e"}}
    checks.check_diagnosis(one_wrong, "A")
    checks.check_diagnosis(one_wrong, "C")
    with pytest.raises(AssertionError, match="profile B: not 'communication'"):
        checks.check_diagnosis(one_wrong, "B")
    with pytest.raises(AssertionError, match="keys"):  # an unfilled answer fails every part
        checks.check_diagnosis(..., "A")


def test_the_exercise_gives_one_point_per_profile():
    import json
    from pathlib import Path
    master = json.loads((Path(__file__).parent.parent / "masters" / "07_profiling.ipynb").read_text())
    tests = ["".join(c["source"]) for c in master["cells"] if "checks.check_diagnosis(" in "".join(c["source"])
             and "def test_" in "".join(c["source"])]
    assert sorted(t.split("check_diagnosis(diagnosis(), ")[1][:3] for t in tests) == ['"A"', '"B"', '"C"']
    assert all("points: 1" in t for t in tests)
