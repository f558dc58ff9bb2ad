"""Heterogeneous ranks: a slower device injected, and the three fixes for it.

Synchronous data parallelism runs at the pace of its slowest rank: every all-reduce waits for the
last gradient. When ranks differ (mixed GPU generations, a throttled or shared device) there are
three standard remedies, each here:

* **give each rank a share of the batch proportional to its speed** (:func:`proportional_batch_sizes`,
  as in heterogeneity-aware schedulers, e.g. HetPipe, Park et al. 2020, and Whale, Jia et al. 2022)
  and average the gradients **weighted by sample count** (:func:`weighted_average_gradients`):
  with a mean loss per rank, ``sum_r n_r g_r / sum_r n_r`` is exactly the gradient of the mean
  loss over the whole global batch, so training still equals one process;
* **balance pipeline stages by measured time** (:func:`time_balanced_counts`): a slow stage gets
  fewer layers, so that every stage takes about as long;
* **stop waiting** (asynchronous training, :mod:`dtlib.parallel.parameter_server`).

A slower device is *emulated* by :func:`slowed`: the block's work is timed and then the rank sleeps
``(factor - 1)`` times as long. A sleep (unlike spinning) leaves the shared CPU cores to the other
ranks, so a rank is ``factor`` times slower even on a loaded 2-core machine.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtlib.analytic import validate
from dtlib.parallel.collectives import all_reduce_coalesced
from dtlib.parallel.pipeline import balanced_split

__all__ = ["slowed", "SlowClock", "proportional_batch_sizes", "weighted_average_gradients",
           "time_balanced_counts"]


class SlowClock:
    """The seconds of real work a :func:`slowed` block did and the seconds it slept, summed."""

    def __init__(self) -> None:
        self.work = 0.0
        self.slept = 0.0


@contextmanager
def slowed(factor: float, clock: SlowClock | None = None) -> Iterator[SlowClock]:
    """Run the block as if on a device ``factor`` times slower: time it, then sleep
    ``(factor - 1) x`` its duration. ``factor = 1`` changes nothing."""
    factor = validate.number("factor", factor, minimum=1, exclusive=False)
    clock = clock if clock is not None else SlowClock()
    start = time.perf_counter()
    yield clock
    work = time.perf_counter() - start
    clock.work += work
    if factor > 1:
        time.sleep((factor - 1) * work)
        clock.slept += (factor - 1) * work


def proportional_batch_sizes(throughputs: Sequence[float], global_batch: int) -> list[int]:
    """Split ``global_batch`` samples in proportion to each rank's measured ``throughputs``
    (samples/s), every rank at least one sample, summing exactly to ``global_batch``.

    Largest remainder (Hamilton's method): floor each exact share, then hand the leftover samples
    to the largest fractional parts, so no rank is off its ideal share by a whole sample.
    """
    speeds = [validate.number(f"throughputs[{i}]", t) for i, t in enumerate(throughputs)]
    if not speeds:
        raise ValueError("throughputs must name at least one rank")
    global_batch = validate.integer("global_batch", global_batch, minimum=len(speeds))
    # one sample each first (a rank with no data would have no gradient to weight), then the rest
    rest = global_batch - len(speeds)
    exact = [rest * s / sum(speeds) for s in speeds]
    sizes = [1 + math.floor(e) for e in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda i: exact[i] - math.floor(exact[i]), reverse=True)
    for i in by_remainder[:global_batch - sum(sizes)]:
        sizes[i] += 1
    return sizes


@torch.no_grad()
def weighted_average_gradients(model: nn.Module, num_samples: int, group: Any = None) -> None:
    """Average gradients over ranks weighted by how many samples each rank's (mean) loss covered.

    ``g = sum_r n_r g_r / sum_r n_r``: rank r's gradient is the mean over its ``n_r`` samples, so
    ``n_r g_r`` is its *sum*; summing those and dividing by the total number of samples gives the
    mean over the global batch - one process's gradient. (A plain mean ``sum_r g_r / world`` would
    over-weight the samples of small batches.) Two all-reduces: the sample count with a flag per
    parameter (did this rank's loss reach it?), then the weighted gradients as one flat buffer.

    The buffer has the same layout on every rank: every trainable parameter, zeros where a rank
    has no gradient (its samples did not use that parameter: a skipped branch, an expert no token
    chose), which is exactly their contribution to the global mean. Packing only the gradients that
    exist would sum one parameter's gradient into another's when ranks skip different ones. A
    parameter no rank used keeps ``.grad = None``, as in one process.
    """
    num_samples = validate.integer("num_samples", num_samples, minimum=1)
    params = [p for p in model.parameters() if p.requires_grad]
    counts = torch.tensor([float(num_samples)] + [float(p.grad is not None) for p in params],
                          device=params[0].device if params else None)
    if dist.is_initialized():
        dist.all_reduce(counts, group=group)
    used = (counts[1:] > 0).tolist()
    for p, used_anywhere in zip(params, used):
        if p.grad is None and used_anywhere:
            p.grad = torch.zeros_like(p)  # this rank's samples add nothing to it
    grads = [p.grad for p, used_anywhere in zip(params, used) if used_anywhere]
    for g in grads:  # each rank's mean gradient x its samples: the sum over its samples
        g.mul_(num_samples)
    all_reduce_coalesced(grads, group, divisor=counts[0].item())


def time_balanced_counts(layer_seconds: Sequence[float], stage_slowdowns: Sequence[float]) -> list[int]:
    """Consecutive layers per pipeline stage minimising the slowest stage's time, when stage ``k``
    runs ``stage_slowdowns[k]`` times slower than the ``layer_seconds`` measured on one device.

    Stage k's time is ``slowdown_k x sum(its layers' seconds)``; the pipeline's pace is the largest
    of those (the slowest stage sets the pace, lesson 06). Dynamic programming over cut points, as
    :func:`dtlib.parallel.pipeline.partition` does for equal stages (the same :func:`~dtlib.parallel.pipeline.balanced_split`); each stage gets >= 1 layer.
    """
    costs = [validate.number(f"layer_seconds[{i}]", t, minimum=0, exclusive=False)
             for i, t in enumerate(layer_seconds)]
    slow = [validate.number(f"stage_slowdowns[{k}]", s, minimum=1, exclusive=False)
            for k, s in enumerate(stage_slowdowns)]
    n, parts = len(costs), len(slow)
    if not 1 <= parts <= n:
        raise ValueError(f"stage_slowdowns must name between 1 and {n} stages (one layer each at "
                         f"least), got {parts}")
    return balanced_split(costs, parts, slow)
