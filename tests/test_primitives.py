"""Lesson 0's collectives give what the NCCL/torch.distributed semantics say, on several world sizes."""
import pytest
import torch

from dtlib.primitives import COLLECTIVES, all_reduce_in_two_phases, expected_result, run_collective
from dtlib.viz.collectives import plot_collective


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_matches_semantics(name, world_size):
    result = run_collective(name, world_size)
    for got, want in zip(result["after"], expected_result(name, world_size)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_is_reduce_scatter_then_all_gather(world_size):
    out = all_reduce_in_two_phases(world_size)
    expected = expected_result("all_reduce", world_size)
    for two_phase, all_reduce, want in zip(out["two_phase"], out["all_reduce"], expected):
        assert torch.equal(two_phase, want) and torch.equal(all_reduce, want)


def test_plot_and_bad_name():
    fig = plot_collective(run_collective("all_to_all", 3))
    assert len(fig.axes) == 2
    with pytest.raises(ValueError, match="valid: broadcast"):
        run_collective("allreduce")
