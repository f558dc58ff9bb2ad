"""Pipeline parallelism: the experiments the lesson runs on real ranks.

* :func:`measure_timelines` - each schedule run by :class:`~dtlib.parallel.PipelineExecutor` on
  ``pp`` gloo ranks with an emulated stage cost (a sleep, which does not compete for the cores
  that several CPU ranks share); the event log of the least disturbed of a few steps, as a
  :class:`~dtlib.parallel.schedules.Timeline`.
* :func:`compare_with_single_process` - loss and largest gradient difference of each schedule
  against one process on the whole batch.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.launcher import launch
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.parallel.pipeline import PipelineExecutor, partition, rank_chunks, timeline_of
from dtlib.parallel.schedules import Timeline, schedule

__all__ = ["measure_timelines", "compare_with_single_process", "DEMO_CONFIG", "Config", "demo_model",
           "demo_batch", "lm_loss"]

# (schedule name, micro-batches, chunks per rank)
Config = tuple[str, int, int]
DEMO_CONFIG = dict(layers=8, hidden=32, heads=2, vocab=64, seq=16)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position, as the single-process reference computes it."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def demo_model(cfg_kwargs: Mapping[str, Any]) -> TinyGPT:
    """The same seeded TinyGPT on every rank and in the reference."""
    torch.manual_seed(0)
    return TinyGPT(tiny_gpt_config(**cfg_kwargs))


def demo_batch(cfg_kwargs: Mapping[str, Any], batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded (inputs, next-token targets) of ``batch`` sequences."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg_kwargs["vocab"], (batch, cfg_kwargs["seq"] + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _timing_worker(rank: int, world_size: int, configs: Sequence[Config], cost: Any, steps: int,
                   cfg_kwargs: Mapping[str, Any], batch: int) -> list[list[Any]]:
    torch.set_num_threads(1)
    x, y = demo_batch(cfg_kwargs, batch)
    out = []
    for name, m, v in configs:
        rank_cost = cost[rank] if isinstance(cost, (list, tuple)) else cost
        chunks = rank_chunks(partition(demo_model(cfg_kwargs), world_size, v), rank, world_size)
        ex = PipelineExecutor(chunks, schedule(name, world_size, m, v), rank, lm_loss, emulate=rank_cost)
        logs = []
        for _ in range(steps):
            dist.barrier()
            logs.append(ex.step(x, y))
        out.append(logs)
    return out


def measure_timelines(pp: int, configs: Sequence[Config], cost: Mapping[str, float] | Sequence[Mapping[str, float]],
                      steps: int = 3, cfg_kwargs: Mapping[str, Any] = DEMO_CONFIG, batch: int = 16,
                      timeout: float = 120.0) -> dict[Config, Timeline]:
    """The measured timeline of each ``(schedule, m, v)`` on ``pp`` ranks: the step with the
    shortest makespan of ``steps``, so that a busy machine's late wake-ups (and the first step's
    warm-up) disturb it least. ``cost``: emulated seconds ``{"F", "B", "W"}`` per micro-batch for a rank's
    whole share, or one such mapping per rank (e.g. a slower stage)."""
    for name, m, v in configs:
        schedule(name, pp, m, v)  # bad settings fail here, before any process starts
        if batch % m:
            raise ValueError(f"batch={batch} must be a multiple of the micro-batches ({m})")
    if isinstance(cost, (list, tuple)) and len(cost) != pp:
        raise ValueError(f"cost gives {len(cost)} ranks' costs for pp={pp}: give one mapping, or one per rank")
    logs = launch(_timing_worker, pp, args=(list(configs), cost, steps, dict(cfg_kwargs), batch),
                  timeout=timeout)
    return {config: min((timeline_of([logs[r][i][k] for r in range(pp)]) for k in range(steps)),
                        key=lambda t: t.makespan)
            for i, config in enumerate(configs)}


def _exactness_worker(rank: int, world_size: int, configs: Sequence[Config], cfg_kwargs: Mapping[str, Any],
                      batch: int) -> list[dict[str, Any]]:
    x, y = demo_batch(cfg_kwargs, batch, seed=1)
    out = []
    for name, m, v in configs:
        model = demo_model(cfg_kwargs)
        ex = PipelineExecutor(rank_chunks(partition(model, world_size, v), rank, world_size),
                              schedule(name, world_size, m, v), rank, lm_loss)
        log = ex.step(x, y)
        mine = {id(p) for p in ex.parameters()}
        out.append({"loss": log.loss, "grads": {k: p.grad for k, p in model.named_parameters() if id(p) in mine}})
    return out


def compare_with_single_process(pp: int, configs: Sequence[Config], cfg_kwargs: Mapping[str, Any] = DEMO_CONFIG,
                                batch: int = 16, timeout: float = 120.0) -> dict[Config, dict[str, float]]:
    """For each ``(schedule, m, v)``: the pipeline's loss (last stage), one process's loss on the
    whole batch (computed here, once), and the largest gradient difference over every rank's
    parameters."""
    for name, m, v in configs:
        schedule(name, pp, m, v)
        if batch % m:
            raise ValueError(f"batch={batch} must be a multiple of the micro-batches ({m})")
    per_rank = launch(_exactness_worker, pp, args=(list(configs), dict(cfg_kwargs), batch), timeout=timeout)
    ref = demo_model(cfg_kwargs)
    x, y = demo_batch(cfg_kwargs, batch, seed=1)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    return {config: {"loss": per_rank[-1][i]["loss"], "ref_loss": ref_loss.item(),
                     "max_grad_diff": max((g - ref_grads[k]).abs().max().item()
                                          for r in per_rank for k, g in r[i]["grads"].items())}
            for i, config in enumerate(configs)}
