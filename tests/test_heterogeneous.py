"""Heterogeneous ranks: throughput-proportional batches, sample-weighted gradients, time-balanced stages."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtlib.launcher import launch
from dtlib.parallel.heterogeneous import (SlowClock, proportional_batch_sizes, slowed,
                                          time_balanced_counts, weighted_average_gradients)

TIMEOUT = 60


def test_proportional_batch_sizes():
    assert proportional_batch_sizes([1.0, 1.0, 1.0, 1.0], 32) == [8, 8, 8, 8]
    assert proportional_batch_sizes([3.0, 1.0], 32) == [24, 8]
    sizes = proportional_batch_sizes([10.0, 7.0, 3.3], 29)
    assert sum(sizes) == 29 and sizes[0] > sizes[1] > sizes[2]
    assert proportional_batch_sizes([1000.0, 1.0], 4) == [3, 1]  # nobody is left without data
    with pytest.raises(ValueError, match="global_batch"):
        proportional_batch_sizes([1.0, 1.0, 1.0], 2)
    with pytest.raises(ValueError, match=r"throughputs\[1\]"):
        proportional_batch_sizes([1.0, 0.0], 8)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _global_batches(steps, total):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(total, 5, generator=g), torch.randn(total, 3, generator=g)) for _ in range(steps)]


def _uneven(rank, world_size, sizes, weighted):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    begin = sum(sizes[:rank])
    for x, y in _global_batches(3, sum(sizes)):
        xs, ys = x[begin:begin + sizes[rank]], y[begin:begin + sizes[rank]]
        opt.zero_grad()
        F.mse_loss(model(xs), ys).backward()  # mean over this rank's samples
        if weighted:
            weighted_average_gradients(model, sizes[rank])
        else:  # the plain mean of lesson 01: right only for equal shares
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= world_size
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_sample_weighted_average_equals_one_process_on_the_global_batch():
    sizes = [2, 7, 3]
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.3, momentum=0.9)
    for x, y in _global_batches(3, sum(sizes)):
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    weighted = launch(_uneven, 3, args=(sizes, True), timeout=TIMEOUT, output="none")
    plain = launch(_uneven, 3, args=(sizes, False), timeout=TIMEOUT, output="none")
    for rank_params in weighted:
        for a, b in zip(rank_params, ref.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    assert any((a - b.detach()).abs().max() > 1e-4 for a, b in zip(plain[0], ref.parameters()))


def test_time_balanced_partition_gives_a_slow_stage_fewer_layers():
    assert time_balanced_counts([1.0] * 8, [1.0, 1.0]) == [4, 4]
    assert time_balanced_counts([1.0] * 8, [1.0, 3.0]) == [6, 2]
    assert time_balanced_counts([1.0] * 8, [3.0, 1.0]) == [2, 6]
    counts = time_balanced_counts([1.0] * 12, [1.0, 2.0, 1.0, 1.0])
    assert sum(counts) == 12 and counts[1] == min(counts)
    # measured layers of unequal cost: the slowest stage time is minimised
    costs, slow = [3.0, 1.0, 1.0, 1.0, 2.0, 1.0], [1.0, 2.0]
    counts = time_balanced_counts(costs, slow)
    pace = max(slow[0] * sum(costs[:counts[0]]), slow[1] * sum(costs[counts[0]:]))
    assert pace == min(max(sum(costs[:c]), 2 * sum(costs[c:])) for c in range(1, 6))
    with pytest.raises(ValueError, match="stage_slowdowns"):
        time_balanced_counts([1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"stage_slowdowns\[0\]"):
        time_balanced_counts([1.0, 1.0], [0.5, 1.0])


def test_slowed_sleeps_factor_minus_one_times_the_work():
    clock = SlowClock()
    with slowed(3.0, clock):
        sum(range(20000))
    assert clock.slept == pytest.approx(2 * clock.work)
    slept = clock.slept
    with slowed(1.0, clock):
        sum(range(20000))
    assert clock.slept == slept  # factor 1: no sleep
    with pytest.raises(ValueError, match="factor"):
        with slowed(0.0):
            pass
