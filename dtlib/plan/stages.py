"""The slowest pipeline stage: a pipeline runs at the pace of its slowest rank (Narayanan et al.
2021, Sec. 2.2: every micro-batch waits for the slowest stage at each step of the schedule), so the
step time's pipelined terms are that rank's, not the balanced ``layers / pp``.

Each candidate rank (:func:`dtlib.analytic.stages.candidate_ranks`: the first, the last, where the mix of
dense and MoE layers changes) is timed with its own layers, MoE layers and, on the last, the LM
head (the per-layer times of :func:`dtlib.plan.gemm.transformer_compute`); the slowest is kept. With 61
layers over pp 32 that is a rank of 2 layers, not 61/32.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic.stages import candidate_ranks, holds_ends, on_structures, rank_layers

__all__ = ["slowest_stage"]


def slowest_stage(n: dict[str, Any], per_layer: dict[str, Any], balanced: Any = False,
                  schedule: str = "1f1b") -> dict[str, Any]:
    """The slowest rank of every layout in ``n``: its ``rank``, ``layers``, ``moe_layers``,
    ``head`` (1 on the last rank) and ``embedding`` (1 on the first; MTP layers add one of each), and its ``gemm`` and ``attention`` seconds per step, the sums of
    ``per_layer``'s (:func:`dtlib.plan.gemm.transformer_compute`: one ``dense_layer``'s and one
    ``moe_layer``'s weight GEMMs, the ``head``'s, one layer's ``attention_layer``) over the rank's
    layers and head. DualPipe: each micro-batch runs one of the rank's two stages (half the
    micro-batches enter from each end), so a rank's work per micro-batch is the mean of the two."""
    n = dict(n, first_stage_layers=n.get("first_stage_layers", 0), last_stage_layers=n.get("last_stage_layers", 0))
    best: dict[str, Any] = {}
    share = 0.5 if schedule == "dualpipe" else 1.0
    table = on_structures(lambda s: [dict(rank_layers(s, r, balanced, schedule), rank=r, **_ends(s, r, schedule))
                                     for r in candidate_ranks(s, balanced, schedule)], n)
    for stage in table:
        stage.update({k: share * stage[k] for k in ("layers", "moe_layers", "mtp")})
        # MTP layers (DeepSeek-V3 Sec. 2.2): one more layer of their kind each and the shared head again
        mtp = stage.pop("mtp", 0)
        stage["layers"] = stage["layers"] + mtp
        stage["moe_layers"] = stage["moe_layers"] + mtp * n.get("mtp_moe", 0)
        stage["head"] = stage["head"] + mtp
        stage["embedding"] = stage["embedding"] + mtp  # each MTP layer embeds its tokens again
        stage["gemm"] = ((stage["layers"] - stage["moe_layers"]) * per_layer["dense_layer"]
                         + stage["moe_layers"] * per_layer["moe_layer"] + stage["head"] * per_layer["head"])
        stage["attention"] = stage["layers"] * per_layer["attention_layer"]
        slower = stage["gemm"] + stage["attention"] > best["gemm"] + best["attention"] if best else True
        best = {k: np.where(slower, v, best[k]) if best else v for k, v in stage.items()}
    return best


def _ends(s: dict[str, Any], rank: Any, schedule: str) -> dict[str, Any]:
    """The embedding's and the LM head's share of a micro-batch's work on ``rank``
    (:func:`~dtlib.analytic.stages.holds_ends`); DualPipe: half each, half the micro-batches running
    the rank's stage that holds them."""
    share = 0.5 if schedule == "dualpipe" else 1.0
    embeds, heads = holds_ends(rank, s["pp"], schedule)
    return {"embedding": share * embeds, "head": share * heads}
