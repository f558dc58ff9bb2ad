"""Scaling efficiency measured on real ranks, with the slowest rank's step split so a lesson can
say why efficiency dropped (lesson 07 printed 27% at 2 ranks without a reason)."""
import pytest

from dtlib.data import load_mnist
from dtlib.experiments.scaling_efficiency import measure_scaling, scaling_efficiency


@pytest.fixture(scope="module")
def scaling():
    digits = load_mnist("train", verbose=False).subset(512)
    return measure_scaling([1, 2], digits, per_rank_batch=32, steps=3, progress=False)


def test_the_step_splits_into_compute_and_all_reduce(scaling):
    for n, s in scaling.items():
        assert s["compute"] + s["all_reduce"] == pytest.approx(s["step"], rel=1e-12), n
        assert s["compute"] > 0 and s["all_reduce"] > 0, n  # even 1 rank calls all_reduce (a 1-rank group)
        assert 0 < s["cpu_share"], n
        assert s["throughput"] == pytest.approx(32 * n / s["step"]), n
    assert set(scaling_efficiency({n: s["throughput"] for n, s in scaling.items()})) == {1, 2}
