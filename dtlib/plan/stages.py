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

from dtlib.analytic.stages import candidate_ranks, on_structures, rank_layers

__all__ = ["slowest_stage"]


def slowest_stage(n: dict[str, Any], per_layer: dict[str, Any], balanced: Any = False) -> dict[str, Any]:
    """The slowest rank of every layout in ``n``: its ``rank``, ``layers``, ``moe_layers``,
    ``head`` (1 on the last rank) and ``embedding`` (1 on the first; MTP layers add one of each), and its ``gemm`` and ``attention`` seconds per step, the sums of
    ``per_layer``'s (:func:`dtlib.plan.gemm.transformer_compute`: one ``dense_layer``'s and one
    ``moe_layer``'s weight GEMMs, the ``head``'s, one layer's ``attention_layer``) over the rank's
    layers and head."""
    n = dict(n, first_stage_layers=n.get("first_stage_layers", 0), last_stage_layers=n.get("last_stage_layers", 0))
    best: dict[str, Any] = {}
    table = on_structures(lambda s: [dict(rank_layers(s, r, balanced), rank=r, head=(r == s["pp"] - 1) * 1.0)
                                     for r in candidate_ranks(s, balanced)], n)
    for stage in table:
        # MTP layers (DeepSeek-V3 Sec. 2.2): one more layer of their kind each and the shared head again
        mtp = stage.pop("mtp", 0)
        stage["layers"] = stage["layers"] + mtp
        stage["moe_layers"] = stage["moe_layers"] + mtp * n.get("mtp_moe", 0)
        stage["head"] = stage["head"] + mtp
        stage["embedding"] = (stage["rank"] == 0) * 1.0 + mtp  # each MTP layer embeds its tokens again
        stage["gemm"] = ((stage["layers"] - stage["moe_layers"]) * per_layer["dense_layer"]
                         + stage["moe_layers"] * per_layer["moe_layer"] + stage["head"] * per_layer["head"])
        stage["attention"] = stage["layers"] * per_layer["attention_layer"]
        slower = stage["gemm"] + stage["attention"] > best["gemm"] + best["attention"] if best else True
        best = {k: np.where(slower, v, best[k]) if best else v for k, v in stage.items()}
    return best
