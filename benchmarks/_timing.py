"""Step timing shared by the benchmarks: implementations alternate step by step on the same data.

A step is forward + backward + gradient synchronisation + optimizer step of a TinyGPT on random
tokens; its time is the slowest rank's (a collective step lasts as long as its slowest rank).
Implementations run alternately, and who goes first alternates too, so drifts of a noisy
machine hit all of them alike.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def timed_step(model: torch.nn.Module, opt: Any, sync: Any, x: torch.Tensor, y: torch.Tensor,
               backward: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> float:
    """One training step; ``sync.finish_gradient_synchronization()`` is called when ``sync`` is
    given. ``backward(logits, y)`` computes the loss and its backward (default: cross-entropy)."""
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    if backward is None:
        _cross_entropy(model(x), y).backward()
    else:
        backward(model(x), y)
    if sync is not None:
        sync.finish_gradient_synchronization()
    opt.step()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def time_alternating(impls: dict[Hashable, tuple], vocab: int, seq: int,
                     batch: int, rank: int, warmup: int, steps: int) -> dict[Hashable, list[float]]:
    """Step times after ``warmup`` steps of each ``(model, optimizer, sync[, backward])`` (see
    :func:`timed_step`), on identical batches. ``rank`` seeds the data: ranks that must see the
    same tokens (a tensor-parallel group) pass the same value."""
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    times: dict[Hashable, list[float]] = {k: [] for k in impls}
    for step in range(warmup + steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        for key in (list(impls) if step % 2 == 0 else list(reversed(impls))):
            model, opt, sync, *backward = impls[key]
            t = timed_step(model, opt, sync, x, y, *backward)
            if step >= warmup:
                times[key].append(t)
    return times
