"""dtlib.resilience.interval: the Monte-Carlo run with random failures agrees with Young/Daly."""
import numpy as np
import pytest

from dtlib.analytic.reliability import LLAMA3_GPU_MTBF_HOURS, daly_interval, goodput, young_interval
from dtlib.resilience.interval import checkpoint_cost, expected_goodput, interval_study, simulate_goodput

M = 3 * 3600.0  # a job MTBF of 3 hours (Llama 3 405B's run, Dubey et al. 2024, Table 5)


@pytest.mark.parametrize("tau, c, r", [(600.0, 30.0, 0.0), (1800.0, 60.0, 300.0), (7200.0, 600.0, 900.0)])
def test_simulation_agrees_with_dalys_expectation(tau, c, r):
    runs = simulate_goodput(tau, c, M, r, segments=20_000, runs=10, seed=1)
    stderr = runs.std(ddof=1) / np.sqrt(len(runs))
    expected = expected_goodput(tau, c, M, r)
    assert abs(runs.mean() - expected) < 4 * stderr + 1e-4, (runs.mean(), expected, stderr)


def test_first_order_formula_is_close_when_failures_are_rare():
    # tau + C << M: Young's 1 - C/tau - (tau/2 + R)/M within 0.3 points of the exact expectation
    tau, c, r = young_interval(30.0, M), 30.0, 60.0
    assert abs(goodput(tau, c, M, r) - expected_goodput(tau, c, M, r)) < 3e-3
    # and far off when the interval is as long as the MTBF (the expansion no longer holds)
    assert abs(goodput(M, c, M, r) - expected_goodput(M, c, M, r)) > 0.05


def test_simulated_optimum_is_near_young_and_daly():
    study = interval_study(16384, LLAMA3_GPU_MTBF_HOURS, checkpoint_seconds=60.0, restart_seconds=300.0,
                           points=41, segments=4000, runs=8)
    assert study["mtbf_seconds"] == pytest.approx(LLAMA3_GPU_MTBF_HOURS * 3600 / 16384)
    best, daly = study["simulated_best"], study["daly"]
    assert 0.8 < best / daly < 1.25, (best, daly, study["young"])
    # the curve is flat at the top: the simulated best is within 0.3 points of Daly's goodput
    assert study["simulated"].max() - study["goodput_at_daly"] < 3e-3
    # too often or too rarely costs goodput, in the simulation as in the formula
    assert study["simulated"][0] < study["simulated"].max() - 0.02
    assert study["simulated"][-1] < study["simulated"].max() - 0.02


def test_checkpoint_cost_and_bad_input():
    assert checkpoint_cost(80e9, 2e9) == 40.0
    assert checkpoint_cost(80e9, 2e9, blocking_seconds=0.5) == 0.5  # async: what it blocks
    with pytest.raises(ValueError, match="bandwidth must be a finite number > 0"):
        checkpoint_cost(1e9, 0)
    with pytest.raises(ValueError, match="mtbf must be a finite number > 0"):
        simulate_goodput(600.0, 30.0, float("nan"))
    assert daly_interval(30.0, M) > young_interval(30.0, M) - 30.0
