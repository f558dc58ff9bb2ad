"""What Megatron-Core's per-module recomputation costs in the step time.

``--recompute-granularity selective --recompute-modules ...`` (Megatron-Core 0.16,
:data:`dtlib.analytic.activations.RECOMPUTE_MODULES`) drops a module's stored outputs
(:func:`dtlib.analytic.activations.recompute_module_bytes` counts them) and runs the module's
forward again in backward. Per layer, micro-batch and rank that forward is:

* ``layernorm``: the norm again, reading its input and writing its output (2 x the dropped
  bytes), in MoE layers (the pre-MLP norm) and MLA layers (the input norm);
* ``moe_act``: the expert activation again, reading FC1's output (2 ``moe_ffn`` wide with a GLU,
  one without) and writing FC2's input, for every routed copy;
* ``mla_up_proj``: the up-projections of MLA's latents, ``2 (q_lora_rank x heads x (nope + rope)
  + kv_lora_rank x heads x (nope + v))`` FLOPs per token, / tp (DeepSeek-V2, Sec. 2.1.2's
  matrices ``W^UQ``, ``W^QR``, ``W^UK``, ``W^UV``);
* ``mlp``: a dense layer's MLP forward, ``2 x mlp_matrices x h x ffn`` FLOPs per token / tp;
* ``shared_experts``: the shared experts' forward, ``2 x mlp_matrices x h x moe_ffn`` each;
* ``moe``: the routed experts' forward (``top_k`` copies, each ``2 x mlp_matrices x h x
  moe_ffn``) and the router's ``2 h E`` (its repeated all-to-alls are not counted);
* ``core_attn``: the attention core again, as selective recompute (Korthikanti et al. 2022,
  Sec. 5); nothing is dropped with FlashAttention, so Megatron-Core's check keeps it off there.

The FLOPs run at the weight GEMMs' precision and efficiency, the bytes at the HBM bandwidth
(roofline, Williams et al. 2009), like the terms they join in :mod:`dtlib.plan.steptime`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic.activations import recompute_module_bytes

__all__ = ["recompute_module_work"]

# modules that exist only in MoE layers / only in dense layers (the rest: every layer)
_MOE_ONLY = ("moe_act", "moe", "shared_experts")
_DENSE_ONLY = ("mlp",)


def recompute_module_work(modules: tuple[str, ...], n: dict[str, Any], act_bytes: float,
                          dropout: bool, flash_attention: bool) -> dict[str, Any]:
    """Forward work repeated per layer (averaged over the model's dense and MoE layers), micro-batch
    and rank for ``modules``: ``flops`` (weight-GEMM FLOPs), ``bytes`` (HBM traffic) and
    ``attention`` (1 where ``core_attn`` repeats the attention core, else 0)."""
    tokens = n["micro_batch_size"] * n["seq"] / n["cp"]
    tp, h = n["tp"], n["hidden"]
    moe_share = np.asarray(n["moe_layers"]) / np.asarray(n["layers"])
    matrices = n["mlp_matrices"]
    moe_ffn = np.where(np.asarray(n["moe_ffn"]) > 0, n["moe_ffn"], n["ffn"])
    shape = n | dict(act_bytes=act_bytes, dropout=dropout)
    flops = 0 * tokens
    nbytes = 0 * tokens
    attention = 0 * tokens
    for module in modules:
        share = moe_share if module in _MOE_ONLY else (1 - moe_share) if module in _DENSE_ONLY else 1
        if module == "layernorm":  # the pre-MLP norm is its own module in MoE layers only
            in_moe = recompute_module_bytes("layernorm", **shape)
            in_dense = recompute_module_bytes("layernorm", **(shape | {"experts": 0 * n["experts"]}))
            nbytes = nbytes + 2 * (moe_share * in_moe + (1 - moe_share) * in_dense)
        elif module == "moe_act":
            # FC1's output read (matrices - 1 FFN-wide tensors: 2 with a GLU), FC2's input written
            routed = n["top_k"] * tokens / tp
            nbytes = nbytes + share * routed * moe_ffn * matrices * act_bytes
        elif module == "mla_up_proj":
            qk = n["qk_nope_head_dim"] + n["qk_rope_head_dim"]
            up = n["q_lora_rank"] * n["heads"] * qk + n["kv_lora_rank"] * n["heads"] * (
                n["qk_nope_head_dim"] + n["v_head_dim"])
            flops = flops + (n["kv_lora_rank"] > 0) * 2 * up * tokens / tp
        elif module == "mlp":
            flops = flops + share * 2 * matrices * h * n["ffn"] * tokens / tp
        elif module == "shared_experts":
            flops = flops + share * n["shared_experts"] * 2 * matrices * h * moe_ffn * tokens / tp
        elif module == "moe":
            routed = n["top_k"] * 2 * matrices * h * moe_ffn + 2 * h * n["experts"]
            flops = flops + share * routed * tokens / tp
        elif module == "core_attn":
            attention = attention + (not flash_attention)
    return {"flops": flops, "bytes": nbytes, "attention": attention}
