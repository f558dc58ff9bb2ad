"""The validation table of docs/plan.md, pinned row by row: the planner's error against each
published run, whether dtlib's memory model lets the published layout fit, and where it ranks;
the fit of the two global efficiencies and the leave-one-source-out cross-validation.
A change to the step-time model that moves any row moves this test (and must update the doc:
``python -m dtlib.plan.validation`` prints it)."""
import numpy as np
import pytest

from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY
from dtlib.plan.validation import (PUBLISHED, SOURCES, error_grid, fit, leave_one_source_out,
                                   mean_absolute_error, validation_table)

# name: (signed relative error, fits by dtlib's memory model, rank among same-software layouts).
# Every published layout fits since the memory model counts the stacks' storage (dtlib.plan.stacks:
# fused SwiGLU, FP8 GEMM inputs); the errors did not move.
EXPECTED = {
    "GPT 1.7B (Narayanan T1)": (0.0978, True, 1),
    "GPT 3.6B (Narayanan T1)": (0.0799, True, 4),
    "GPT 7.5B (Narayanan T1)": (0.0418, True, 21),
    "GPT 18.4B (Narayanan T1)": (0.0600, True, 49),
    "GPT 39.1B (Narayanan T1)": (0.0728, True, 37),
    "GPT 76.1B (Narayanan T1)": (0.0434, True, 8),
    "GPT 145.6B (Narayanan T1)": (-0.0098, True, 10),
    "GPT 310.1B (Narayanan T1)": (-0.0047, True, 1),
    "GPT 529.6B (Narayanan T1)": (-0.0236, True, 1),
    "GPT 1008B (Narayanan T1)": (-0.0270, True, 1),
    "GPT 22B, SP + selective (Korthikanti T5)": (-0.0387, True, 1),
    "GPT 175B, SP + selective (Korthikanti T5)": (0.0504, True, 2),
    "GPT 530B, SP + selective (Korthikanti T5)": (0.0866, True, 1),
    "GPT 1T, SP + selective (Korthikanti T5)": (0.0972, True, 1),
    "BLOOM 176B (BigScience)": (0.0030, True, 7),
    "Llama 3.1 8B, FSDP 8, eager (torchtitan T1)": (0.0160, True, 1),
    "Llama 3.1 8B, FSDP 8, compile (torchtitan T1)": (-0.0163, True, 1),
    "Llama 3.1 8B, FSDP 8, compile + Float8 (torchtitan T1)": (-0.0141, True, 1),
    "Llama 3.1 8B, FSDP 128, eager (torchtitan T3)": (0.0488, True, 1),
    "Llama 3.1 8B, FSDP 128, compile (torchtitan T3)": (0.0116, True, 1),
    "Llama 3.1 8B, FSDP 128, compile + Float8 (torchtitan T3)": (0.0099, True, 1),
    "Llama 3.1 70B, FSDP 32 x TP 8, compile + Float8 (torchtitan T4)": (0.0132, True, 109),
    "llama3-8b FP8, 8 x H100 (Megatron-Bridge 25.11)": (-0.0222, True, 1),
    "llama3-70b FP8, 64 x H100 (Megatron-Bridge 25.11)": (0.0920, True, 8),
    "llama3-405b FP8, 1024 x H100 (Megatron-Bridge 25.11)": (0.1009, True, 3),
    "llama3-8b FP8, 8 x B200 (Megatron-Bridge 25.11)": (0.0728, True, 1),
    "llama3-405b FP8, 128 x B200 (Megatron-Bridge 25.11)": (0.0938, True, 6),
}

# held-out source: (GEMM, attention efficiency fitted without it, held-out error, in-sample error)
LOSO = {
    "Narayanan 2021": (0.60, 0.40, 0.0461, 0.0461),
    "Korthikanti 2022": (0.60, 0.40, 0.0682, 0.0682),
    "BLOOM 2022": (0.60, 0.40, 0.0030, 0.0030),
    "torchtitan": (0.60, 0.30, 0.1041, 0.0186),
    "Megatron-Bridge": (0.60, 0.40, 0.0764, 0.0764),
}
# the sub-grid holding every fold's optimum on the full grid (docs/plan.md's run of
# python -m dtlib.plan.validation): an argmin over a subset that contains the argmin is the same
SUB_GEMM, SUB_ATTENTION = (0.55, 0.60), (0.30, 0.40)


@pytest.fixture(scope="module")
def table():
    return {r["name"]: r for r in validation_table()}


@pytest.fixture(scope="module")
def errors():
    return error_grid(SUB_GEMM, SUB_ATTENTION)


def test_every_row_is_pinned(table):
    assert set(table) == set(EXPECTED) == {r.name for r in PUBLISHED}
    for name, (error, fits, rank) in EXPECTED.items():
        row = table[name]
        assert row["error"] == pytest.approx(error, abs=5e-4), name
        assert row["predicted"] == pytest.approx(row["published"] * (1 + row["error"]), rel=1e-12)
        assert row["fits"] is fits, name
        assert row["rank"] == rank, name


def test_in_sample_error_is_reported_and_under_ten_percent(table):
    mae = mean_absolute_error(list(table.values()))
    assert mae == pytest.approx(sum(abs(e) for e, _, _ in EXPECTED.values()) / len(EXPECTED), abs=1e-4)
    assert mae == pytest.approx(0.0462, abs=5e-4)


def test_at_least_five_sources_and_two_gpu_generations():
    assert len(SOURCES) >= 5 and {r.family for r in PUBLISHED} == {"a100", "h100", "b200"}
    for run in PUBLISHED:
        assert "http" in run.reference, run.name  # every run links its source


def test_leave_one_source_out_is_pinned_and_under_ten_percent_on_average(errors):
    loso = leave_one_source_out(errors, gemm_grid=SUB_GEMM, attention_grid=SUB_ATTENTION)
    assert list(loso) == list(SOURCES) == list(LOSO)
    for source, (gemm, attention, held_out, in_sample) in LOSO.items():
        d = loso[source]
        assert (d["gemm"], d["attention"]) == (gemm, attention), source
        assert d["loso_error"] == pytest.approx(held_out, abs=5e-4), source
        assert d["in_sample_error"] == pytest.approx(in_sample, abs=5e-4), source
        assert d["loso_error"] >= d["in_sample_error"] - 1e-12  # a held-out source never does better
    assert np.mean([d["loso_error"] for d in loso.values()]) == pytest.approx(0.0595, abs=5e-4)
    assert np.mean([d["loso_error"] for d in loso.values()]) <= 0.10


def test_the_defaults_are_the_fitted_minimum(errors):
    assert fit(errors, gemm_grid=SUB_GEMM, attention_grid=SUB_ATTENTION) == (GEMM_EFFICIENCY, ATTENTION_EFFICIENCY)
    # the optimum is interior in both directions: one grid step either side is worse
    neighbours = error_grid((GEMM_EFFICIENCY - 0.05, GEMM_EFFICIENCY, GEMM_EFFICIENCY + 0.05),
                            (ATTENTION_EFFICIENCY - 0.05, ATTENTION_EFFICIENCY, ATTENTION_EFFICIENCY + 0.05))
    g, a = fit(neighbours, gemm_grid=(GEMM_EFFICIENCY - 0.05, GEMM_EFFICIENCY, GEMM_EFFICIENCY + 0.05),
               attention_grid=(ATTENTION_EFFICIENCY - 0.05, ATTENTION_EFFICIENCY, ATTENTION_EFFICIENCY + 0.05))
    assert (g, a) == pytest.approx((GEMM_EFFICIENCY, ATTENTION_EFFICIENCY))


def test_published_numbers_are_the_sources():
    by_name = {r.name: r for r in PUBLISHED}
    tflops = [by_name[n].published for n in EXPECTED if "Narayanan" in n]
    assert tflops == [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]
    assert [by_name[n].published for n in EXPECTED if "Korthikanti" in n] == [1.10, 13.75, 37.83, 71.49]
    assert by_name["BLOOM 176B (BigScience)"].published == 156
    assert [by_name[n].published for n in EXPECTED if "torchtitan" in n] == [5762, 6667, 8532, 5605, 6514, 8380, 829]
    assert [by_name[n].published for n in EXPECTED if "Megatron-Bridge" in n] == [14451, 1602, 292, 30624, 661]
    # Table 1's model sizes follow from the shapes (the paper rounds: 1.65B is printed as 1.7)
    t1 = [by_name[n] for n in EXPECTED if "Narayanan" in n]
    for run, billions in zip(t1, (1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0)):
        assert run.model.num_parameters() / 1e9 == pytest.approx(billions, rel=0.03), run.name
    # Korthikanti's Table 5 MFU follows from the step time: 1T at 71.49 s is 56.3%
    from dtlib.analytic.flops import megatron_flops_per_step
    one_t = by_name["GPT 1T, SP + selective (Korthikanti T5)"]
    mfu = megatron_flops_per_step(512, 2048, 128, 25600, 51200, recompute=False) / (71.49 * 512 * 312e12)
    assert one_t.global_batch == 512 and mfu == pytest.approx(0.563, abs=5e-4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(leave_out="nobody"), "leave_out must be one of"),
])
def test_fit_rejects_unknown_sources(errors, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fit(errors, gemm_grid=SUB_GEMM, attention_grid=SUB_ATTENTION, **kwargs)


def test_error_grid_rejects_bad_grids():
    with pytest.raises(ValueError, match="gemm_grid must be a non-empty list of fractions"):
        error_grid((0.0, 0.5), (0.3,))
    with pytest.raises(ValueError, match="attention_grid must be a non-empty list"):
        error_grid((0.8,), ())


def test_every_row_carries_its_unit(table):
    """Lesson 10 printed 27 rows mixing TFLOP/s, seconds and tokens/s with no unit."""
    from dtlib.plan.validation import METRIC_UNITS

    assert {r["unit"] for r in table.values()} == set(METRIC_UNITS.values())
    for r in table.values():
        assert r["unit"] == METRIC_UNITS[r["metric"]], r["name"]
