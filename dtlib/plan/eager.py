"""HBM traffic of a Llama block's memory-bound operators when PyTorch runs them eagerly, one kernel each.

Fused stacks (Megatron-LM / Transformer Engine, ``torch.compile``) write each activation tensor
once forward and read it once backward: the ``elementwise`` term of :mod:`dtlib.plan.steptime`
counts that from Korthikanti et al. 2022, Sec. 4.1. Eager PyTorch launches one kernel per
operator, and each kernel reads its inputs from HBM and writes its output back. This module
counts those bytes per token and per layer for the reference Llama code that torchtitan runs
(``torchtitan/models/llama/model.py``, December 2024: RMSNorm computed in fp32, RoPE as a
complex multiplication in fp32, SwiGLU as ``silu(w1 x) * w3 x``, K/V repeated for GQA), with
bf16 activations (2 bytes) and fp32 temporaries (4 bytes):

=====================  ========================================================  ==============
operator (forward)     kernels: bytes read + written per element                 elements
=====================  ========================================================  ==============
RMSNorm, x2            cast (2+4), pow (4+4), mean (4), mul (4+4), cast (4+2),   h each
                       x weight (2+2): 36
RoPE on q and k        cast (2+4), complex multiply (4+4), cast (4+2): 20        h + kv
SwiGLU                 silu (2+2), multiply (2+2+2): 10                           ffn
residual adds, x2      2+2+2: 6                                                   h each
GQA repeat of K, V     read kv, write h, for K and V: 2 (kv + h)                  -
attention output       transpose + contiguous copy (2+2): 4                       h
=====================  ========================================================  ==============

Other blocks change three rows (keyword arguments of :func:`eager_forward_bytes`): a LayerNorm
model runs each norm as one kernel reading and writing bf16 (4 bytes per element: llm-foundry's
MPT uses ``norm_type="low_precision_layernorm"``, its ``MPTConfig`` default, which keeps
``F.layer_norm`` in bf16 under autocast, Composer's "Low Precision LayerNorm"; a plain
``nn.LayerNorm`` under autocast would run in fp32 and move 16), a GELU MLP runs one kernel on its
``ffn``-wide tensor (2+2: 4), a model without RoPE has no RoPE kernels, and multi-head attention
(``kv_heads == heads``) repeats nothing (``repeat_kv`` returns its input when ``n_rep == 1``).

Backward reads the saved inputs and the output gradient and writes the input gradient of every
such kernel: about twice the forward's traffic (the same factor of 2 as the matmuls' backward,
Kaplan et al. 2020 Sec. 2.1), so forward + backward is :data:`PASSES` = 3 x the forward.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PASSES", "eager_forward_bytes", "eager_bytes"]

PASSES = 3  # forward + backward (twice the forward's traffic)


def eager_forward_bytes(hidden: Any, kv_dim: Any, ffn: Any, *, rmsnorm: Any = True, swiglu: Any = True,
                        rope: Any = True, kv_repeat: Any = True, tp: Any = 1, sequence_parallel: Any = True) -> Any:
    """Bytes one token moves through HBM in one layer's memory-bound operators, forward, eager
    (the table of the module docstring; ``kv_dim`` = kv_heads x head_dim), on one of ``tp``
    tensor-parallel ranks. The defaults are torchtitan's Llama block; ``rmsnorm``/``swiglu``/
    ``rope``/``kv_repeat`` False (or 0 in an array) describe a LayerNorm, GELU, RoPE-free or
    multi-head-attention block. The operators inside the attention and MLP split over ``tp`` with
    their heads and columns; the norms and residual adds outside them split only with
    ``sequence_parallel``, and are otherwise run whole on every rank (Korthikanti et al. 2022,
    Sec. 4.2.2: "replicated across the tensor parallel group")."""
    norms = 2 * np.where(rmsnorm, 36, 4) * hidden
    rotary = np.where(rope, 20 * (hidden + kv_dim), 0)
    activation = np.where(swiglu, 10, 4) * ffn
    residual = 2 * 6 * hidden
    repeat_kv = np.where(kv_repeat, 2 * 2 * (kv_dim + hidden), 0)
    attention_out = 4 * hidden
    outside = (norms + residual) / np.where(sequence_parallel, tp, 1)
    return outside + (rotary + activation + repeat_kv + attention_out) / tp


def eager_bytes(hidden: Any, kv_dim: Any, ffn: Any, **block: Any) -> Any:
    """Forward + backward bytes per token and layer (:data:`PASSES` x the forward)."""
    return PASSES * eager_forward_bytes(hidden, kv_dim, ffn, **block)
