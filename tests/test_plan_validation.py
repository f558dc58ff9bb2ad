"""The validation table of docs/plan.md, pinned row by row: the planner's error against each
published run, whether dtlib's memory model lets the published layout fit, and where it ranks.
A change to the step-time model that moves any row moves this test (and must update the doc)."""
import pytest

from dtlib.plan.calibration import A100_FRACTION, H100_FRACTION
from dtlib.plan.validation import PUBLISHED, calibrate, mean_absolute_error, validation_table

# name: (signed relative error, fits by dtlib's memory model, rank among same-software layouts)
EXPECTED = {
    "GPT 1.7B (Narayanan T1)": (0.0721, True, 1),
    "GPT 3.6B (Narayanan T1)": (0.0516, True, 7),
    "GPT 7.5B (Narayanan T1)": (0.0067, True, 26),
    "GPT 18.4B (Narayanan T1)": (0.0221, True, 67),
    "GPT 39.1B (Narayanan T1)": (0.0256, True, 41),
    "GPT 76.1B (Narayanan T1)": (0.0001, True, 7),
    "GPT 145.6B (Narayanan T1)": (-0.0326, True, 9),
    "GPT 310.1B (Narayanan T1)": (-0.0312, True, 1),
    "GPT 529.6B (Narayanan T1)": (-0.0681, True, 1),
    "GPT 1008B (Narayanan T1)": (-0.0658, True, 1),
    "GPT 22B, SP + selective (Korthikanti T5)": (-0.0243, True, 5),
    "Llama 3.1 8B, FSDP 8 (torchtitan T1)": (0.0036, False, 1),
    "Llama 3.1 8B, FSDP 128 (torchtitan T3)": (0.0360, True, 1),
    "Llama 3.1 70B, FSDP 32 x TP 8 (torchtitan)": (-0.1592, True, 67),
}


@pytest.fixture(scope="module")
def table():
    return {r["name"]: r for r in validation_table()}


def test_every_row_is_pinned(table):
    assert set(table) == set(EXPECTED) == {r.name for r in PUBLISHED}
    for name, (error, fits, rank) in EXPECTED.items():
        row = table[name]
        assert row["error"] == pytest.approx(error, abs=5e-4), name
        assert row["predicted"] == pytest.approx(row["published"] * (1 + row["error"]), rel=1e-12)
        assert row["fits"] is fits, name
        assert row["rank"] == rank, name


def test_mean_absolute_error_is_reported_and_under_ten_percent(table):
    mae = mean_absolute_error(list(table.values()))
    assert mae == pytest.approx(sum(abs(e) for e, _, _ in EXPECTED.values()) / len(EXPECTED), abs=1e-4)
    assert mae < 0.10


def test_published_numbers_are_the_papers():
    by_name = {r.name: r for r in PUBLISHED}
    tflops = [by_name[n].published for n in EXPECTED if "Narayanan" in n]
    assert tflops == [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]
    assert by_name["GPT 22B, SP + selective (Korthikanti T5)"].published == 1.10
    assert [by_name[n].published for n in EXPECTED if "torchtitan" in n] == [5762, 5605, 597]
    # its model sizes follow from the shapes (the paper rounds: 1.65B is printed as 1.7)
    t1 = [by_name[n] for n in EXPECTED if "Narayanan" in n]
    for run, billions in zip(t1, (1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0)):
        assert run.model.num_parameters() / 1e9 == pytest.approx(billions, rel=0.03), run.name


@pytest.mark.parametrize("family,fraction", [("a100", A100_FRACTION), ("h100", H100_FRACTION)])
def test_the_default_fraction_is_the_fitted_minimum(family, fraction):
    grid = [fraction - 0.01, fraction, fraction + 0.01]
    assert calibrate(family, grid)[0] == pytest.approx(fraction)


def test_calibration_needs_a_known_family():
    with pytest.raises(ValueError, match="no published runs for family 'tpu'"):
        calibrate("tpu")
