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

__all__ = ["scaling_efficiency", "measure_throughput"]


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
    throughput = {}
    for n in tqdm(world_sizes, desc="measuring world sizes", disable=not progress, leave=False):
        results = launch(train, n, args=(data, steps, per_rank_batch * n), timeout=timeout,
                         output="none")
        slowest = max(r["seconds_per_step"] for r in results)
        throughput[n] = per_rank_batch * n / slowest
    return throughput
