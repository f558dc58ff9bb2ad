"""A planned layout shrunk to TinyGPT on a few CPU ranks: the config and what changed, and why.

The planner (:mod:`dtlib.plan`) picks a layout for thousands of GPUs; before paying for them the
same combination of parallelisms can run here, small (:mod:`dtlib.experiments.shrunk_layout` runs
it through the trainer, :mod:`dtlib.frameworks.rehearse` under a real framework).

Rules, in order: every parallel size the plan uses (> 1) becomes :data:`SIZE` (2: the smallest
that still splits); dimensions are then dropped in :data:`DROP_ORDER` while ``dp x tp x pp x cp``
exceeds ``max_ranks``; if the trainer refuses the combination (``TrainConfig.check``), the ZeRO
stage gives way first, then sequence parallelism (a parallelism is kept over a sharding stage),
each change with the trainer's own one-line reason.
"""
from __future__ import annotations

import math
from typing import Sequence

from dtlib.analytic import validate
from dtlib.analytic.layout import Parallelism
from dtlib.trainer.config import SCHEDULES as TRAIN_SCHEDULES, TrainConfig

__all__ = ["TINY", "SIZE", "DROP_ORDER", "DIMENSIONS", "shrink_layout"]

# the model every shrunk layout trains (tests/test_train.py's): small enough for 8 ranks on 2
# cores in seconds. SGD, because its update is proportional to the gradient: a gradient off by a
# constant factor moves the weights, where Adam's normalised update would hide it.
TINY = TrainConfig(layers=2, hidden=32, heads=4, seq=16, steps=5, micro_batch_size=1, optimizer="sgd", lr=0.5)
SIZE = 2
# dropped first to last: CP (TinyGPT's 16-token sequences are where it matters least), then PP
# and TP, and the data-parallel group last, since ZeRO/FSDP (which most plans use) shard over it
DROP_ORDER = ("cp", "pp", "tp", "dp")
DIMENSIONS = ("dp", "tp", "pp", "cp")


def _refusal(config: TrainConfig) -> str | None:
    """The trainer's one-line reason for refusing ``config``, or None if it runs."""
    try:
        config.check()
    except ValueError as exc:
        return str(exc)
    return None


def _relax(config: TrainConfig, lines: list[str]) -> TrainConfig:
    """The first setting the trainer accepts, keeping sequence parallelism if it can (a
    parallelism), then the highest ZeRO stage; one line per option weakened, with the trainer's
    reason for refusing the planned setting."""
    candidates = [config.with_(sequence_parallel=sp, zero=z)
                  for sp in dict.fromkeys((config.sequence_parallel, False)) for z in range(config.zero, -1, -1)]
    accepted = next((c for c in candidates if _refusal(c) is None), None)
    if accepted is None:  # a shrink rule is wrong, not the plan
        raise ValueError(f"the shrunk layout is refused whatever its ZeRO stage: {_refusal(candidates[-1])}")
    if accepted.sequence_parallel != config.sequence_parallel:  # refused even without ZeRO: say why
        lines.append(f"sequence_parallel True -> False: {_refusal(accepted.with_(sequence_parallel=True, zero=0))}")
    if accepted.zero != config.zero:  # the reason of every stage skipped, once each
        reasons = dict.fromkeys(_refusal(accepted.with_(zero=z)) for z in range(config.zero, accepted.zero, -1))
        lines.append(f"zero {config.zero} -> {accepted.zero}: {' / '.join(reasons)}")
    return accepted


def shrink_layout(layout: Parallelism, max_ranks: int = 8,
                  drop_order: Sequence[str] = DROP_ORDER) -> tuple[TrainConfig, list[str]]:
    """``layout`` (e.g. ``dtlib.plan.search.to_layout`` of the planner's best) as a
    :class:`TrainConfig` of :data:`TINY` on at most ``max_ranks`` ranks, and one line per change
    saying why. The result always passes :meth:`TrainConfig.check` (see the module docstring).
    ``drop_order``: which dimensions give way first when the sizes need more than ``max_ranks``
    (a permutation of :data:`DIMENSIONS`; e.g. ``("dp", "pp", "tp", "cp")`` rehearses a layout with
    all four dimensions as tp x pp x cp = 8 ranks, keeping context parallelism)."""
    validate.integer("max_ranks", max_ranks)
    if sorted(drop_order) != sorted(DIMENSIONS):
        raise ValueError(f"drop_order must be an ordering of {DIMENSIONS}, got {tuple(drop_order)!r}")
    lines = []
    sizes = {}
    for d in DIMENSIONS:
        planned = getattr(layout, d)
        sizes[d] = min(planned, SIZE)
        if planned > SIZE:
            lines.append(f"{d} {planned} -> {SIZE}: the smallest size that still splits (same collectives, fewer ranks)")
    for d in drop_order:
        world = math.prod(sizes.values())
        if world <= max_ranks:
            break
        if sizes[d] > 1:
            lines.append(f"{d} {sizes[d]} -> 1: dp x tp x pp x cp = {world} > {max_ranks} ranks "
                         f"(dropped in the order {', '.join(drop_order)})")
            sizes[d] = 1
    if layout.ep > 1:
        lines.append(f"ep {layout.ep} -> 1: the shrunk TinyGPT is dense (the trainer composes MoE with dp only; "
                     f"lesson 09 trains experts with --moe-experts and --ep)")
    for name, off in (("offload", "none"), ("shard_size", None)):
        if getattr(layout, name) != off:
            lines.append(f"{name} {getattr(layout, name)} dropped: the trainer keeps every state on its ranks "
                         f"and shards ZeRO over all dp x cp ranks")
    pp = sizes["pp"]
    virtual = min(layout.virtual_stages, SIZE) if pp > 1 else 1
    if virtual != layout.virtual_stages:
        lines.append(f"virtual stages {layout.virtual_stages} -> {virtual}" + (
            "" if pp > 1 else ": no pipeline left to interleave"))
    schedule = layout.schedule if virtual > 1 or layout.schedule != "interleaved" else "1f1b"
    # the trainer's schedules (dtlib.parallel.schedules) have no DualPipe: its pipeline and micro-batches run
    # as 1F1B, DualPipeV's two chunks a rank as interleaved 1F1B
    if layout.schedule in ("dualpipe", "dualpipev"):
        schedule = "interleaved" if layout.schedule == "dualpipev" and virtual > 1 else "1f1b"
        lines.append(f"schedule {layout.schedule} -> {schedule}: dtlib train runs {', '.join(TRAIN_SCHEDULES)}")
    if pp > 1:  # two micro-batches per stage: warm-up, steady state and cool-down all happen
        microbatches = max(pp, min(layout.num_microbatches, 2 * pp) // pp * pp)
    else:  # gradient accumulation, kept if planned
        microbatches = min(layout.num_microbatches, SIZE)
    micro_batch = min(layout.micro_batch_size, SIZE)
    batch = [f"{what} {planned} -> {shrunk}" for what, planned, shrunk in (
        ("micro-batch size", layout.micro_batch_size, micro_batch),
        ("micro-batches", layout.num_microbatches, microbatches)) if planned != shrunk]
    if batch:
        lines.append(f"{', '.join(batch)}: global batch {layout.global_batch} -> "
                     f"{sizes['dp'] * micro_batch * microbatches} sequences")
    if layout.recompute == "selective":
        lines.append("recompute selective -> full: the trainer recomputes whole blocks (same numbers, more compute)")
    layers = max(TINY.layers, pp * virtual)
    config = TINY.with_(**sizes, layers=layers, zero=layout.zero, sequence_parallel=layout.sequence_parallel,
                        schedule=schedule, virtual_stages=virtual, micro_batch_size=micro_batch,
                        num_microbatches=microbatches, recompute=layout.recompute != "none")
    config = _relax(config, lines)
    lines.append(f"TinyGPT: {layers} layers (at least pp x virtual stages), hidden {TINY.hidden}, {TINY.heads} heads, "
                 f"{TINY.seq}-token sequences; {TINY.steps} steps of SGD at lr {TINY.lr:g}")
    return config, lines
