"""Scaling efficiency of data parallelism, measured with real ranks.

Weak scaling, as the course's sources define it: each rank keeps its batch, the global batch
grows with N, and efficiency = throughput at N ranks / (N x throughput at 1 rank).
Below ~80% is worth investigating (communication, stragglers, or, on a laptop, too few cores).
"""
from __future__ import annotations

from tqdm.auto import tqdm

from dtlib.data import Digits
from dtlib.launcher import launch
from dtlib.experiments.data_parallel import train

__all__ = ["scaling_efficiency", "measure_throughput", "measure_scaling"]


def scaling_efficiency(throughput: dict[int, float]) -> dict[int, float]:
    """``{N: throughput_N / (N * throughput_1)}``; needs the 1-rank measurement."""
    if 1 not in throughput:
        raise ValueError(f"need the 1-rank throughput as the baseline; got world sizes {sorted(throughput)}")
    if any(n < 1 or t <= 0 for n, t in throughput.items()):
        raise ValueError(f"world sizes must be >= 1 and throughputs > 0, got {throughput}")
    return {n: t / (n * throughput[1]) for n, t in sorted(throughput.items())}


def measure_throughput(world_sizes: list[int], data: Digits, per_rank_batch: int = 32,
                       steps: int = 6, timeout: float = 60.0, progress: bool = True) -> dict[int, float]:
    """Samples per second of data-parallel training at each world size (weak scaling).

    A step of N ranks lasts as long as its slowest rank, so the slowest rank's median step
    time is what counts.
    """
    scaling = measure_scaling(world_sizes, data, per_rank_batch, steps, timeout, progress)
    return {n: s["throughput"] for n, s in scaling.items()}


def measure_scaling(world_sizes: list[int], data: Digits, per_rank_batch: int = 32,
                    steps: int = 6, timeout: float = 60.0, progress: bool = True) -> dict[int, dict[str, float]]:
    """:func:`measure_throughput` with the slowest rank's step split, to say *why* efficiency drops.

    For each world size: ``throughput`` (samples/s), ``step`` (the slowest rank's median step,
    s), of it ``all_reduce`` (the gradient all-reduce) and ``compute`` (the rest: forward,
    backward, optimizer), and ``cpu_share``: the CPU time that rank got over its step's length
    (1.0 = a whole core all step; lower = it waited, for a peer or for a core shared with other
    processes). Weak scaling keeps each rank's work, so at N ranks compute should take what it took
    on one; what it grows by is the ranks (and other jobs) competing for the cores.
    """
    scaling = {}
    for n in tqdm(world_sizes, desc="measuring world sizes", disable=not progress, leave=False):
        results = launch(train, n, args=(data, steps, per_rank_batch * n), timeout=timeout,
                         output="none")
        slowest = max(results, key=lambda r: r["seconds_per_step"])
        step = slowest["seconds_per_step"]
        all_reduce = min(slowest["sync_seconds_per_step"], step)
        scaling[n] = {"throughput": per_rank_batch * n / step, "step": step, "all_reduce": all_reduce,
                      "compute": step - all_reduce, "cpu_share": slowest["cpu_seconds_per_step"] / step}
    return scaling
