"""Lesson 0's collectives give what the NCCL/torch.distributed semantics say, on several world sizes."""
import pytest
import torch

from dtlib.primitives import COLLECTIVES, expected_result, run_collective
from dtlib.viz.collectives import plot_collective


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_collective_matches_semantics(name, world_size):
    result = run_collective(name, world_size)
    for got, want in zip(result["after"], expected_result(name, world_size)):
        assert torch.equal(got, want)


def test_all_reduce_is_reduce_scatter_then_all_gather():
    n = 4
    scattered = torch.cat(expected_result("reduce_scatter", n))
    assert torch.equal(scattered, expected_result("all_reduce", n)[0])


def test_plot_and_bad_name():
    fig = plot_collective(run_collective("all_to_all", 3))
    assert len(fig.axes) == 2
    with pytest.raises(ValueError, match="valid: broadcast"):
        run_collective("allreduce")
