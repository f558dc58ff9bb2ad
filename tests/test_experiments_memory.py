"""dtlib.experiments.memory.recompute_tradeoff (lesson 3): gradient checkpointing measured on a
tiny TinyGPT keeps matching dtlib.analytic.memory's prediction, and saves memory. Timings are not asserted."""
import pytest
import torch

from dtlib.experiments.memory import RECOMPUTE_RUNS, recompute_tradeoff
from dtlib.models import tiny_gpt_config

CFG = tiny_gpt_config(layers=2)  # hidden 64, seq 32: a fraction of a second per run


@pytest.fixture(scope="module")
def runs():
    return recompute_tradeoff(CFG, batch=2, min_run_time=0.01)


def test_structure(runs):
    assert list(runs) == list(RECOMPUTE_RUNS) == ["store everything", "checkpoint each block"]
    for row in runs.values():
        assert set(row) == {"saved_bytes", "predicted_bytes", "step_seconds"}
        assert all(isinstance(v, (int, float)) and v > 0 for v in row.values())


@pytest.mark.parametrize("name", list(RECOMPUTE_RUNS))
def test_prediction_within_10_percent_of_saved(runs, name):
    assert runs[name]["predicted_bytes"] == pytest.approx(runs[name]["saved_bytes"], rel=0.10)


def test_checkpointing_saves_fewer_bytes(runs):
    kept, stored = runs["checkpoint each block"], runs["store everything"]
    assert kept["saved_bytes"] < stored["saved_bytes"] / 3
    assert kept["predicted_bytes"] < stored["predicted_bytes"] / 3


def test_bytes_are_deterministic_and_global_rng_untouched(runs):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    again = recompute_tradeoff(CFG, batch=2, min_run_time=0.01, seed=5)
    assert torch.equal(torch.rand(3), before)  # the function forks the global RNG
    for name in RECOMPUTE_RUNS:
        assert again[name]["saved_bytes"] == runs[name]["saved_bytes"]
        assert again[name]["predicted_bytes"] == runs[name]["predicted_bytes"]


def test_bytes_grow_with_the_batch(runs):
    double = recompute_tradeoff(CFG, batch=4, min_run_time=0.01)
    for name in RECOMPUTE_RUNS:
        assert double[name]["predicted_bytes"] > runs[name]["predicted_bytes"]
        assert double[name]["predicted_bytes"] == pytest.approx(double[name]["saved_bytes"], rel=0.10)


@pytest.mark.parametrize("kwargs, match", [
    ({"batch": 0}, "batch must be an integer >= 1, got 0"),
    ({"batch": 2.5}, "batch must be an integer >= 1, got 2.5"),
    ({"batch": True}, "batch must be an integer >= 1, got True"),
    ({"min_run_time": 0}, "min_run_time must be a finite number > 0, got 0"),
    ({"min_run_time": -1.0}, "min_run_time must be a finite number > 0, got -1.0"),
    ({"min_run_time": float("inf")}, "min_run_time must be a finite number > 0, got inf"),
])
def test_bad_input_raises_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recompute_tradeoff(CFG, **kwargs)


def test_cfg_must_be_a_model_shape():
    with pytest.raises(ValueError, match="cfg must be a TransformerConfig"):
        recompute_tradeoff("llama3-8b")
