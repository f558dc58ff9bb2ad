"""FLOPs per token and per step, model vs hardware FLOPs, and MFU/HFU.

The general count (:func:`forward_flops_per_token`) counts matrix multiplications, 2 FLOPs per
multiply-add, as ``torch.utils.flop_counter.FlopCounterMode`` does: the weight matmuls of every
layer, the attention products ``QK^T`` and ``A V``, and the vocabulary projection. Backward costs
twice the forward (Kaplan et al. 2020, Sec. 2.1), so a training step is 3x forward ("model FLOPs");
recomputation adds forward work the hardware really does ("hardware FLOPs", Chowdhery et al. 2022,
App. B; Korthikanti et al. 2022, Sec. 6).

Conventions (explicit options):

* ``attention="full"`` (default) counts the whole s x s score matrix, as the Megatron-LM and PaLM
  formulas and FlopCounterMode do; ``"causal"`` halves it (only the unmasked half is useful work).
* ``count_logits=True`` (default) counts the vocabulary projection (Megatron-LM formula);
  the input embedding is a lookup and never counts. ``False`` gives the "non-embedding" 6N.
* ``packed_flops`` (:data:`PACKED_FLOPS`): with packed sequences (``packed_doc_length`` L > 0 in the
  shape: documents of L tokens each, attending only within themselves; :func:`keys_per_query`) the
  hardware FLOPs always count the documents' attention, what the variable-length kernels run; the
  model FLOPs count it too with ``"documents"``, or over the whole sequence with ``"sequence"``
  (default), as Megatron-LM's ``num_floating_point_operations`` (``args.seq_length``) and torchtitan's
  ``get_num_flop_per_token`` (``seq_len``) do whatever the data's document mask, so that MFU compares
  with the MFU those frameworks log.

For GPT blocks the general count equals Narayanan et al. 2021 eq. (3) exactly (tests check it).
MFU divides model FLOPs by ``step_time * gpus * peak`` with the peak from :mod:`dtlib.analytic.hardware`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.hardware import Accelerator, get_gpu, matmul_peak
from dtlib.analytic.config import TransformerConfig, attention_params
from dtlib.analytic.finetune import FineTuning, adapter_params, check_targets, resolve_finetune

__all__ = ["matmul_params_per_layer", "layers_matmul_params", "keys_per_query", "forward_flops_per_token",
           "attention_flops_per_token", "step_flops", "recompute_flops_per_token", "megatron_flops_per_step",
           "palm_flops_per_token", "six_n_flops_per_token", "utilization", "flops_report", "shape_of", "ATTENTION",
           "PACKED_FLOPS", "check_packed"]

ATTENTION = ("full", "causal")
# what model FLOPs count of a packed sequence's attention (module docstring)
PACKED_FLOPS = ("sequence", "documents")


def check_packed(packed_doc_length: Any, seq: Any) -> int:
    """``packed_doc_length`` as an int: tokens per packed document, 1..``seq``."""
    return validate.integer("packed_doc_length", packed_doc_length, minimum=1, maximum=int(np.min(seq)))


def _attention_factor(attention: str) -> float:
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    return 0.5 if attention == "causal" else 1.0


def matmul_params_per_layer(hidden: Any, heads: Any, kv_heads: Any, ffn: Any, mlp_matrices: Any,
                            experts: Any = 0, top_k: Any = 0, *, moe_ffn: Any = None,
                            shared_experts: Any = 0, head_dim: Any = None, q_lora_rank: Any = 0,
                            kv_lora_rank: Any = 0, qk_nope_head_dim: Any = 0, qk_rope_head_dim: Any = 0,
                            v_head_dim: Any = 0, **_unused: Any) -> Any:
    """Weights a token is multiplied by in one layer (a dense layer when ``experts == 0``).

    Attention: the projections of :func:`dtlib.analytic.config.attention_params` without biases
    and norms (Q and O heads x head_dim wide; MLA's down- and up-projections, DeepSeek-V2 Sec.
    2.1.2-2.1.3). MLP: one ``ffn``-wide MLP, or in an MoE layer ``top_k`` routed plus
    ``shared_experts`` always-active ``moe_ffn``-wide MLPs and the h x E router (Megatron-Core's
    ``num_floating_point_operations`` counts the same experts but not the router)."""
    weights_and_norms = attention_params(hidden, heads, kv_heads, 0, head_dim, q_lora_rank, kv_lora_rank,
                                         qk_nope_head_dim, qk_rope_head_dim, v_head_dim)
    mla_norms = (kv_lora_rank > 0) * (q_lora_rank + kv_lora_rank)  # RMSNorm weights, not matmuls
    moe = experts > 0
    moe_ffn = ffn if moe_ffn is None else moe_ffn
    mlp = ((experts == 0) * mlp_matrices * hidden * ffn
           + moe * ((top_k + shared_experts) * mlp_matrices * hidden * moe_ffn + hidden * experts))
    return weights_and_norms - mla_norms + mlp


def layers_matmul_params(*, layers: Any, hidden: Any, heads: Any, kv_heads: Any, ffn: Any,
                         mlp_matrices: Any = 2, experts: Any = 0, top_k: Any = 0, moe_layers: Any = None,
                         **shape: Any) -> Any:
    """Weights a token is multiplied by in all layers: ``layers - moe_layers`` dense layers and
    ``moe_layers`` MoE layers (default: every layer of an MoE model) of
    :func:`matmul_params_per_layer`; ``shape`` holds the other keys of
    :meth:`~dtlib.analytic.config.TransformerConfig.numbers`."""
    moe_layers = (experts > 0) * layers if moe_layers is None else moe_layers
    dense = matmul_params_per_layer(hidden, heads, kv_heads, ffn, mlp_matrices, 0, 0, **shape)
    moe = matmul_params_per_layer(hidden, heads, kv_heads, ffn, mlp_matrices, experts, top_k, **shape)
    return (layers - moe_layers) * dense + moe_layers * moe


def keys_per_query(seq: Any, window: Any = 0, attention: str = "full", packed_doc_length: Any = 0) -> Any:
    """Keys each query is counted against: ``seq`` (or ``window`` when 0 < window < seq) under the
    ``"full"`` convention; under ``"causal"`` the mean over queries of min(window, position), taken
    continuously, w - w^2 / 2s (= s/2 without a window, Megatron-Core's causal halving). A
    sliding-window kernel (FlashAttention's ``window_size``, Mistral 7B Sec. 2) does O(s w) work.

    Packed sequences (``packed_doc_length`` L, 0 < L <= seq): each query sees only its own document,
    so L takes the place of ``seq`` (s/L documents of L^2 / 2 causal pairs each: s L / 2 per sequence
    instead of s^2 / 2), as the variable-length kernels run them (FlashAttention-2's
    ``flash_attn_varlen_func`` with ``cu_seqlens``, Megatron-Core's THD format / ``PackedSeqParams``;
    NeMo's sequence packing docs: attention costs sum_i s_i^2, not (sum_i s_i)^2). Documents of equal
    length L: with lengths l_i of mean E[l] the same work needs L = E[l^2] / E[l], which is larger
    than the mean whenever the lengths vary."""
    factor = _attention_factor(attention)
    doc = np.where(np.asarray(packed_doc_length) > 0, np.minimum(packed_doc_length, seq), seq)
    span = doc + (window > 0) * (np.minimum(window, doc) - doc)
    causal = span - span * (span / (2 * doc))  # the ratio first: span * span overflows int64 past 2**31.5
    return (factor == 1.0) * span + (factor != 1.0) * causal


def attention_flops_per_token(seq: Any, hidden: Any, layers: Any, attention: str = "full", *,
                              heads: Any = None, head_dim: Any = None, v_head_dim: Any = 0,
                              sliding_window: Any = 0, sliding_layers: Any = 0, packed_doc_length: Any = 0,
                              **_unused: Any) -> Any:
    """Forward FLOPs of ``QK^T`` and ``A V`` per token: ``2 * 2 * s * h`` per layer (Narayanan et al.
    2021, Sec. 5.1; ``h`` = heads x head_dim), halved for ``attention="causal"``.

    In general ``2 * heads * (head_dim + v_head_dim) * keys`` per layer: the query/key head size
    (MLA: nope + rope) for the scores, the value head size for ``A V`` (Megatron-Core's MLA count);
    ``sliding_layers`` of the ``layers`` see :func:`keys_per_query` of ``sliding_window``; with
    ``packed_doc_length`` every layer attends within documents of that length (:func:`keys_per_query`)."""
    width = hidden if heads is None else heads * (hidden // heads if head_dim is None else head_dim)
    v_width = width if heads is None else heads * (v_head_dim + (v_head_dim == 0) * width / heads)
    per_key = 2 * (width + v_width)
    full = keys_per_query(seq, 0, attention, packed_doc_length)
    windowed = keys_per_query(seq, sliding_window, attention, packed_doc_length)
    return per_key * ((layers - sliding_layers) * full + sliding_layers * windowed)


def forward_flops_per_token(*, layers: Any, hidden: Any, heads: Any, kv_heads: Any, ffn: Any,
                            vocab: Any, seq: Any, mlp_matrices: Any = 2, experts: Any = 0,
                            top_k: Any = 0, attention: str = "full", count_logits: bool = True,
                            **shape: Any) -> Any:
    """Forward FLOPs per token: 2 x matmul weights + attention + (optionally) the 2hV logits.

    ``mtp_layers`` D (in ``shape``; DeepSeek-V3 Sec. 2.2) add per token D x (their block, dense or
    MoE as ``mtp_moe`` says, with full attention; the h x 2h projection; the shared head's 2hV logits
    again, eq. 22)."""
    weights = layers_matmul_params(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn,
                                   mlp_matrices=mlp_matrices, experts=experts, top_k=top_k, **shape)
    attn = attention_flops_per_token(seq, hidden, layers, attention, heads=heads, **shape)
    main = 2 * weights + attn + count_logits * 2 * hidden * vocab
    mtp, mtp_moe = shape.get("mtp_layers", 0), shape.get("mtp_moe", 0)
    if not np.any(mtp):
        return main
    block = matmul_params_per_layer(hidden, heads, kv_heads, ffn, mlp_matrices, experts * mtp_moe, top_k * mtp_moe,
                                    **shape)
    mtp_attention = attention_flops_per_token(seq, hidden, 1, attention, heads=heads,
                                              **dict(shape, sliding_layers=0))
    return main + mtp * (2 * (block + 2 * hidden * hidden) + mtp_attention + count_logits * 2 * hidden * vocab)


def recompute_flops_per_token(recompute: str, layers_forward: Any, attention_forward: Any) -> Any:
    """Forward FLOPs per token done again in backward: full recompute repeats the transformer
    layers (not the logits: Narayanan et al. 2021 eq. 3 counts layers 4x, logits 3x); selective
    repeats the attention products (Korthikanti et al. 2022, Sec. 5)."""
    extra = {"none": 0 * layers_forward, "selective": attention_forward, "full": layers_forward}
    if recompute not in extra:
        raise ValueError(f"recompute must be one of {tuple(extra)}, got {recompute!r}")
    return extra[recompute]


def step_flops(tokens: Any, *, recompute: str = "none", attention: str = "full",
               count_logits: bool = True, packed_flops: str = "sequence", **shape: Any) -> dict[str, Any]:
    """Model FLOPs (3 x forward) and hardware FLOPs (+ recomputation) of a step of ``tokens``.

    With ``lora_rank`` > 0 in ``shape`` (LoRA, :mod:`dtlib.analytic.finetune`) the forward adds the
    adapters' ``2 r (d_in + d_out)`` per targeted matrix and token, and the frozen weights (the
    layers' and the LM head's) skip their weight gradient: 2x their forward instead of 3x (Hu et
    al. 2021, Sec. 4.2; backward = dgrad + wgrad, each 1x forward, Narayanan et al. 2021, Sec. 5.1);
    attention and the adapters keep 3x. ``frozen_per_token``: the forward FLOPs of the frozen weights.
    ``packed_flops`` (:data:`PACKED_FLOPS`): with ``packed_doc_length`` > 0 in ``shape``, whether the
    model FLOPs count the attention within the documents or over the whole sequence (the hardware
    FLOPs count the documents' either way; module docstring)."""
    validate.one_of("packed_flops", packed_flops, PACKED_FLOPS)
    adapters = 2 * adapter_params(shape, active=True)
    fwd = forward_flops_per_token(attention=attention, count_logits=count_logits, **shape) + adapters
    layers_fwd = fwd - count_logits * 2 * shape["hidden"] * shape["vocab"]
    attn_fwd = attention_flops_per_token(attention=attention, **shape)
    extra = recompute_flops_per_token(recompute, layers_fwd, attn_fwd)
    frozen = (np.asarray(shape.get("lora_rank", 0)) > 0) * (fwd - attn_fwd - adapters)
    train = 3 * fwd - frozen
    model = train  # per token
    if packed_flops == "sequence" and np.any(np.asarray(shape.get("packed_doc_length", 0)) > 0):
        model = step_flops(tokens, attention=attention, count_logits=count_logits,
                           **dict(shape, packed_doc_length=0))["model_per_token"]
    return {"forward_per_token": fwd, "frozen_per_token": frozen, "model_per_token": model,
            "model": model * tokens, "hardware": (train + extra) * tokens}


def megatron_flops_per_step(batch: float, seq: float, layers: float, hidden: float, vocab: float,
                            recompute: bool = True) -> float:
    """Narayanan et al. 2021, eq. (3): ``96 B s l h^2 (1 + s/6h + V/16lh)`` with full activation
    recompute; without it (their Sec. 5.1 derivation, Korthikanti et al. 2022 App.) ``72 B s l h^2
    (1 + s/6h + V/12lh)``. GPT blocks only (ffn = 4h, MHA)."""
    b, s, l, h, v = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * b * s * l * h ** 2 * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h ** 2 * (1 + s / (6 * h) + v / (12 * l * h))


def palm_flops_per_token(non_embedding_params: float, layers: float, heads: float, head_dim: float,
                         seq: float) -> float:
    """Chowdhery et al. 2022 (PaLM), App. B: ``6N + 12 L H Q T`` training FLOPs per token
    (N non-embedding parameters, attention not halved for causality)."""
    return 6 * non_embedding_params + 12 * layers * heads * head_dim * seq


def six_n_flops_per_token(params: float) -> float:
    """The 6N rule (Kaplan et al. 2020, Sec. 2.1): training FLOPs per token without attention."""
    return 6 * params


def utilization(flops_per_step: Any, step_time: Any, gpus: Any, gpu: "str | Accelerator",
                dtype: str = "bf16") -> Any:
    """``flops / (step_time * gpus * peak)``: MFU with model FLOPs, HFU with hardware FLOPs
    (Chowdhery et al. 2022, App. B). The peak is the catalogue's dense ``dtype`` peak
    (:func:`dtlib.analytic.hardware.matmul_peak`: ``nvfp4`` is the FP4 peak of a Blackwell GPU).
    Scalars or arrays; FLOPs must be finite and >= 0, ``step_time`` > 0, ``gpus`` integers >= 1."""
    validate.array("flops_per_step", flops_per_step, integer=False, minimum=0)
    validate.array("step_time", step_time, integer=False, minimum=0, exclusive=True)
    validate.array("gpus", gpus, integer=True, minimum=1, exclusive=False)
    acc = get_gpu(gpu) if isinstance(gpu, str) else gpu
    return flops_per_step / (step_time * gpus * matmul_peak(acc, dtype))


def shape_of(cfg: TransformerConfig, seq: int | None = None) -> dict[str, Any]:
    """The numbers :func:`forward_flops_per_token` reads from a config (:meth:`TransformerConfig.numbers`)."""
    return cfg.numbers(seq)


def flops_report(model: "TransformerConfig | float", batch: int, *, seq: int | None = None,
                 step_time: float | None = None, gpus: int = 1, gpu: "str | Accelerator" = "h100-sxm",
                 dtype: str = "bf16", recompute: str = "none", attention: str = "full",
                 count_logits: bool = True, finetune: FineTuning | None = None, packed_doc_length: int | None = None,
                 packed_flops: str = "sequence") -> dict[str, Any]:
    """FLOPs of a step of ``batch`` sequences; with ``step_time`` (s) also MFU and HFU.

    ``model`` is a config, or a bare parameter count (then ``seq`` is required and the count is
    6N per token without attention, Kaplan et al. 2020; selective recompute adds nothing).
    ``finetune``: LoRA counts its adapters and no weight gradients of the frozen weights
    (:func:`step_flops`; a model shape only). ``packed_doc_length``: sequences packed from documents of
    that many tokens (1..seq; a model shape only), attention within each (:func:`keys_per_query`), and
    ``packed_flops`` what the model FLOPs count of it (:data:`PACKED_FLOPS`)."""
    finetune = resolve_finetune(finetune, isinstance(model, TransformerConfig))
    validate.integer("batch", batch)
    validate.integer("gpus", gpus)
    if seq is not None:
        validate.integer("seq", seq)
    validate.one_of("recompute", recompute, ("none", "selective", "full"))
    validate.boolean("count_logits", count_logits)
    validate.one_of("packed_flops", packed_flops, PACKED_FLOPS)
    if packed_doc_length is not None and not isinstance(model, TransformerConfig):
        raise validate.InvalidArgument("packed_doc_length", "unset with a bare parameter count (its 6N counts no "
                                       "attention to pack; give a model shape)", packed_doc_length)
    if isinstance(model, TransformerConfig):
        shape = dict(shape_of(model, seq), **finetune.numbers())
        if packed_doc_length is not None:
            shape["packed_doc_length"] = check_packed(packed_doc_length, shape["seq"])
        check_targets(finetune, shape)
        tokens = batch * shape["seq"]
        f = step_flops(tokens, recompute=recompute, attention=attention, count_logits=count_logits,
                       packed_flops=packed_flops, **shape)
        name = model.name
        counts = {"parameters": model.num_parameters(), "active_parameters": model.active_parameters()}
        if finetune.lora:
            counts["trainable_parameters"] = float(adapter_params(shape))
    else:
        model = validate.number("params", model)
        if seq is None:
            raise ValueError("a bare parameter count needs seq (tokens per sequence) to count FLOPs per step")
        _attention_factor(attention)
        tokens, fwd = batch * seq, six_n_flops_per_token(model) / 3
        extra = recompute_flops_per_token(recompute, fwd, 0 * fwd)
        f = {"forward_per_token": fwd, "model_per_token": 3 * fwd, "model": 3 * fwd * tokens,
             "hardware": (3 * fwd + extra) * tokens}
        name = f"{model:.4g} parameters"
        counts = {"parameters": model, "active_parameters": model}
    acc = get_gpu(gpu) if isinstance(gpu, str) else gpu
    peak = matmul_peak(acc, dtype)  # a COMPUTE_DTYPES name, or nvfp4: the FP4 peak of an NVFP4 GPU
    out = {"model": name, **counts, "tokens_per_step": tokens,
           "flops_per_token": f["model_per_token"],
           "model_flops_per_step": f["model"], "hardware_flops_per_step": f["hardware"],
           "gpu": acc.name, "dtype": dtype, "peak_flops_per_gpu": peak, "gpus": gpus,
           "ideal_step_time": f["model"] / (gpus * peak),
           "conventions": {"attention": attention, "count_logits": count_logits, "recompute": recompute,
                           "finetune": finetune.describe(), "packed_doc_length": packed_doc_length,
                           "packed_flops": packed_flops}}
    if step_time is not None:
        validate.number("step_time", step_time)
        fastest = f["hardware"] / (gpus * peak)
        if step_time < fastest:  # HFU > 100%, and MFU <= HFU
            raise validate.InvalidArgument(
                "step_time", f"at least {fastest:.4g} s ({gpus} {acc.name} GPUs at their dense "
                f"{dtype} peak need that long for the {f['hardware']:.4g} FLOPs of this step: "
                f"{step_time:g} s would need {100 * fastest / step_time:,.0f} % of the peak, an MFU "
                f"of {100 * f['model'] / (step_time * gpus * peak):,.0f} %; impossible on this hardware)",
                step_time)
        out.update(step_time=step_time, mfu=utilization(f["model"], step_time, gpus, acc, dtype),
                   hfu=utilization(f["hardware"], step_time, gpus, acc, dtype),
                   tokens_per_second=tokens / step_time)
    return out
