"""Step timing shared by the benchmarks: implementations alternate step by step on the same data.

A step is forward + backward + gradient synchronisation + optimizer step of a TinyGPT on random
tokens; its time is the slowest rank's (a collective step lasts as long as its slowest rank).
Implementations run alternately, and who goes first alternates too, so drifts of a noisy
machine hit all of them alike.
"""
from __future__ import annotations

import time
from typing import Any, Hashable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def timed_step(model: torch.nn.Module, opt: Any, sync: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step; ``sync.finish_gradient_synchronization()`` is called when ``sync`` is given."""
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    if sync is not None:
        sync.finish_gradient_synchronization()
    opt.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def time_alternating(impls: dict[Hashable, tuple[torch.nn.Module, Any, Any]], vocab: int, seq: int,
                     batch: int, rank: int, warmup: int, steps: int) -> dict[Hashable, list[float]]:
    """Step times after ``warmup`` steps of each ``(model, optimizer, sync)``, on identical batches."""
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    times: dict[Hashable, list[float]] = {k: [] for k in impls}
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        for key in (list(impls) if step % 2 == 0 else list(reversed(impls))):
            t = timed_step(*impls[key], x, y)
            if step >= warmup:
                times[key].append(t)
    return times
