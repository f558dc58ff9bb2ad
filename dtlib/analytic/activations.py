"""Activation memory of a transformer, after Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (Sec. 4, Table 2).

The paper's per-layer count for a GPT block (16-bit activations, 1-byte dropout masks) is
``s*b*h*(34 + 5*a*s/h)`` bytes; with tensor parallelism t it becomes
``s*b*h*(10 + 24/t + 5*a*s/(h*t))``, with sequence parallelism ``s*b*h*(34 + 5*a*s/h)/t``, with
selective recompute the ``5*a*s/h`` term goes, and with full recompute only the layer input
``2*s*b*h`` (``/t`` with SP) is kept. :func:`layer_bytes` re-derives that sum tensor by tensor
(Sec. 4.1) so that it also covers GQA, any FFN width, SwiGLU, no dropout, other dtypes and context
parallelism, and reduces exactly to the paper's expressions for a GPT block.

All functions accept Python numbers or numpy arrays (used by :mod:`dtlib.analytic.vectorised`).
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["layer_bytes", "embedding_bytes", "output_bytes", "activation_breakdown"]


def _where(cond: Any, a: Any, b: Any) -> Any:
    return np.where(cond, a, b) if isinstance(cond, np.ndarray) else (a if cond else b)


def layer_bytes(seq: Any, micro_batch_size: Any, hidden: Any, heads: Any, kv_heads: Any, ffn: Any,
                tp: Any = 1, cp: Any = 1, sequence_parallel: Any = False, recompute: str = "none",
                swiglu: Any = False, dropout: Any = True, act_bytes: Any = 2, mask_bytes: Any = 1,
                norm_saved: Any = 1, experts: Any = 0, top_k: Any = 0) -> Any:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one GPU.

    An MoE layer (``experts > 0``) routes each token to ``top_k`` experts: the paper's per-token
    MLP terms (Sec. 4.1) are kept once per routed copy, plus the copy itself, which is the input
    the expert's first matmul saves (the dispatcher permutes tokens into a new buffer, as
    Megatron-Core's ``MoEAlltoAllTokenDispatcher`` does). The norm output (router and dispatch
    input) and the residual dropout mask stay once per token; the router's s x E logits are left
    out (E/h of one h-sized tensor: 0.2% for 8 experts and h = 4096). With balanced routing each
    expert-parallel rank processes ``top_k`` copies of its own tokens, so ``ep`` does not appear.

    ``norm_saved``: h-sized tensors each norm keeps (1 for fused LayerNorm/RMSNorm as counted by
    the paper; 2 for PyTorch's composite ``nn.RMSNorm``, which also keeps its normalised output).
    ``cp`` splits the sequence; each rank's queries still attend to all ``seq`` keys.
    """
    s, b, h, a = seq / cp, micro_batch_size, hidden, heads
    sbh = s * b * h
    kv = kv_heads / heads                     # K and V are kv/a the size of Q (GQA)
    sp = _where(sequence_parallel, tp, 1)     # SP also shards the "outside TP" tensors (Sec. 4.2.2)
    drop = _where(dropout, 1, 0)
    # Sec. 4.1, attention block: QKV input, Q and K, V, output-projection input; with dropout also
    # the residual dropout mask.
    attention = (act_bytes * sbh / sp                        # QKV input (norm output)
                 + act_bytes * sbh * (2 + 2 * kv) / tp       # Q, K (for QK^T), V, projection input
                 + drop * mask_bytes * sbh / sp)             # residual dropout mask
    # softmax output, its dropout mask, and the dropout output (= softmax output without dropout)
    scores = a * s * seq * b * (act_bytes + drop * (mask_bytes + act_bytes)) / tp
    # MLP: input; GELU keeps its input and fc2 input (2 f-sized tensors), unfused SwiGLU keeps gate,
    # silu(gate), up and their product (4); plus the residual dropout mask. MoE: top_k routed
    # copies, each with its f-sized tensors and its own h-sized expert input.
    moe = experts > 0
    routed = _where(moe, top_k, 1)
    mlp = (act_bytes * sbh / sp
           + routed * (act_bytes * s * b * ffn * _where(swiglu, 4, 2) / tp + _where(moe, act_bytes * sbh / sp, 0))
           + drop * mask_bytes * sbh / sp)
    norms = 2 * norm_saved * act_bytes * sbh / sp             # inputs of the two norms
    stored = norms + attention + mlp
    if recompute == "none":
        return stored + scores
    if recompute == "selective":               # recompute QK^T, softmax, dropout, attn@V (Sec. 5)
        return stored
    if recompute == "full":                    # keep only each layer's input (Sec. 4.3)
        return act_bytes * sbh / sp
    raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")


def embedding_bytes(seq: Any, micro_batch_size: Any, hidden: Any, tp: Any = 1, cp: Any = 1,
                    sequence_parallel: Any = False, dropout: Any = True, mask_bytes: Any = 1) -> Any:
    """First stage: the embedding-dropout mask, ``s*b*h`` (``/t`` with SP) (Korthikanti Sec. 4.3)."""
    return _where(dropout, 1, 0) * mask_bytes * seq / cp * micro_batch_size * hidden / _where(
        sequence_parallel, tp, 1)


def output_bytes(seq: Any, micro_batch_size: Any, hidden: Any, vocab: Any, tp: Any = 1, cp: Any = 1,
                 sequence_parallel: Any = False, act_bytes: Any = 2, logits_bytes: Any = 4,
                 norm_saved: Any = 1) -> Any:
    """Last stage: final-norm input, LM-head input and the fp32 logits kept by the cross-entropy,
    ``4*s*b*h*(1 + v/h)/t`` for 16-bit activations with SP (Korthikanti Sec. 4.3)."""
    sb = seq / cp * micro_batch_size
    sp = _where(sequence_parallel, tp, 1)
    return (norm_saved + 1) * act_bytes * sb * hidden / sp + logits_bytes * sb * vocab / tp


def activation_breakdown(*, seq: Any, micro_batch_size: Any, hidden: Any, heads: Any, kv_heads: Any,
                         ffn: Any, vocab: Any, layers_first: Any, layers_last: Any,
                         in_flight_first: Any, in_flight_last: Any, tp: Any = 1, cp: Any = 1,
                         sequence_parallel: Any = False, recompute: str = "none", swiglu: Any = False,
                         dropout: Any = True, act_bytes: Any = 2, mask_bytes: Any = 1,
                         logits_bytes: Any = 4, norm_saved: Any = 1,
                         pp: Any = 1, experts: Any = 0, top_k: Any = 0) -> dict[str, dict[str, Any]]:
    """Activation bytes on the first and the last pipeline rank, by component.

    ``layers``: stored per-layer activations x the rank's layers x micro-batches in flight
    (:func:`dtlib.analytic.layout.in_flight`); ``embedding`` (first rank) and ``output`` (last rank)
    likewise; ``recompute_buffer``: with full recompute, one layer's activations are rebuilt during
    its backward, a transient the paper leaves out but the GPU must hold.
    """
    common = dict(seq=seq, micro_batch_size=micro_batch_size, hidden=hidden, tp=tp, cp=cp,
                  sequence_parallel=sequence_parallel)
    shape = dict(common, heads=heads, kv_heads=kv_heads, ffn=ffn, swiglu=swiglu, dropout=dropout,
                 act_bytes=act_bytes, mask_bytes=mask_bytes, norm_saved=norm_saved, experts=experts,
                 top_k=top_k)
    per_layer = layer_bytes(recompute=recompute, **shape)
    rebuilt = layer_bytes(recompute="none", **shape) if recompute == "full" else 0 * per_layer
    emb = embedding_bytes(dropout=dropout, mask_bytes=mask_bytes, **common)
    out = output_bytes(vocab=vocab, act_bytes=act_bytes, logits_bytes=logits_bytes,
                       norm_saved=norm_saved, **common)
    single = pp == 1  # one rank holds both ends
    first = {"layers": per_layer * layers_first * in_flight_first,
             "embedding": emb * in_flight_first,
             "output": _where(single, out, 0 * out),
             "recompute_buffer": rebuilt}
    last = {"layers": per_layer * layers_last * in_flight_last,
            "embedding": _where(single, emb * in_flight_last, 0 * emb),
            "output": out * in_flight_last,
            "recompute_buffer": rebuilt}
    for d in (first, last):
        d["total"] = d["layers"] + d["embedding"] + d["output"] + d["recompute_buffer"]
    return {"first": first, "last": last}
