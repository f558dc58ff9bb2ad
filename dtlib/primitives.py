"""The five collectives, run live on N ranks so their before/after can be drawn.

Semantics follow the NCCL User Guide ("Collective Operations") and ``torch.distributed``: each
rank starts with ``world_size`` numbers, ``10 * rank + i``, so every value says where it came from.
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

import torch
import torch.distributed as dist

from dtlib.launcher import launch
from dtlib.parallel.collectives import all_gather_into, reduce_scatter_into

__all__ = ["COLLECTIVES", "initial_values", "run_collective", "expected_result", "two_phase_all_reduce",
           "all_reduce_in_two_phases"]

COLLECTIVES = ("broadcast", "all_reduce", "reduce_scatter", "all_gather", "all_to_all")



def initial_values(rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s input: ``[10r, 10r+1, ..., 10r+N-1]``."""
    return torch.arange(world_size, dtype=torch.float32) + 10 * rank


def _apply(name: str, x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    if name == "broadcast":  # rank 0's tensor everywhere
        dist.broadcast(x, src=0)
        return x
    if name == "all_reduce":  # element-wise sum everywhere
        dist.all_reduce(x)
        return x
    if name == "reduce_scatter":  # element-wise sum, rank r keeps chunk r
        out = torch.empty(1)
        reduce_scatter_into(out, x)
        return out
    if name == "all_gather":  # rank r contributes its chunk r; everyone gets all chunks
        out = torch.empty(world_size)
        all_gather_into(out, x[rank:rank + 1].clone())
        return out
    if name == "all_to_all":  # rank r sends its chunk j to rank j: a transpose across ranks
        out = torch.empty(world_size)
        dist.all_to_all_single(out, x)
        return out
    raise ValueError(f"unknown collective {name!r}; valid: {', '.join(COLLECTIVES)}")


def _worker(rank: int, world_size: int, name: str) -> dict:
    x = initial_values(rank, world_size)
    before = x.clone()
    return {"before": before, "after": _apply(name, x, rank, world_size).clone()}


def run_collective(name: str, world_size: int = 4, timeout: float = 30.0) -> dict:
    """Run collective ``name`` on ``world_size`` real ranks; per-rank ``before`` and ``after`` lists."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; valid: {', '.join(COLLECTIVES)}")
    out = launch(_worker, world_size, args=(name,), timeout=timeout, output="none")
    return {"name": name, "world_size": world_size,
            "before": [o["before"] for o in out], "after": [o["after"] for o in out]}


def two_phase_all_reduce(rank: int, world_size: int) -> dict:
    """All-reduce as reduce-scatter, then all-gather (Patarasuk & Yuan 2009), next to ``all_reduce``."""
    x = initial_values(rank, world_size)
    chunk = torch.empty(1)
    reduce_scatter_into(chunk, x.clone())  # phase 1: my chunk of the sum (dist.reduce_scatter_tensor)
    full = torch.empty(world_size)
    all_gather_into(full, chunk)  # phase 2: every rank's reduced chunk (dist.all_gather_into_tensor)
    reference = x.clone()
    dist.all_reduce(reference)
    return {"two_phase": full, "all_reduce": reference}


def all_reduce_in_two_phases(world_size: int = 4, timeout: float = 30.0) -> dict:
    """Run :func:`two_phase_all_reduce` on ``world_size`` ranks; per-rank results of both routes."""
    out = launch(two_phase_all_reduce, world_size, timeout=timeout, output="none")
    return {key: [o[key] for o in out] for key in ("two_phase", "all_reduce")}


def expected_result(name: str, world_size: int) -> list[torch.Tensor]:
    """What each rank should hold after ``name``, computed without any communication."""
    inputs = torch.stack([initial_values(r, world_size) for r in range(world_size)])  # [rank, i]
    total = inputs.sum(0)
    table = {
        "broadcast": [inputs[0]] * world_size,
        "all_reduce": [total] * world_size,
        "reduce_scatter": [total[r:r + 1] for r in range(world_size)],
        "all_gather": [inputs.diagonal()] * world_size,
        "all_to_all": [inputs[:, r] for r in range(world_size)],
    }
    if name not in table:
        raise ValueError(f"unknown collective {name!r}; valid: {', '.join(COLLECTIVES)}")
    return table[name]
