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

__all__ = ["layer_bytes", "mean_layer_bytes", "embedding_bytes", "output_bytes", "op_selective_bytes",
           "stored_layer_bytes", "activation_breakdown", "RECOMPUTE_MODULES", "recompute_module_bytes",
           "check_recompute_modules"]

# Megatron-Core's selective-recompute submodules (``TransformerConfig.recompute_modules``, 0.16:
# transformer/transformer_config.py; the same names as --recompute-modules)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


def _where(cond: Any, a: Any, b: Any) -> Any:
    return np.where(cond, a, b) if isinstance(cond, np.ndarray) else (a if cond else b)


def _cached_input(fp8_inputs: Any, act: Any) -> Any:
    """Bytes per element of a GEMM input as Transformer Engine caches it for backward: ``fp8_inputs``
    True (FP8, 1 byte) or a number (the bytes of the quantized copy: NVFP4's 9/16); False/0: ``act``."""
    return _where(fp8_inputs, 1.0 * fp8_inputs, act)


def layer_bytes(seq: Any, micro_batch_size: Any, hidden: Any, heads: Any, kv_heads: Any, ffn: Any,
                tp: Any = 1, cp: Any = 1, sequence_parallel: Any = False, recompute: str = "none",
                swiglu: Any = False, dropout: Any = True, act_bytes: Any = 2, mask_bytes: Any = 1,
                norm_saved: Any = 1, experts: Any = 0, top_k: Any = 0, *, moe_ffn: Any = None,
                shared_experts: Any = 0, capacity_factor: Any = 0, etp: Any = 1, head_dim: Any = None,
                q_lora_rank: Any = 0, kv_lora_rank: Any = 0, qk_nope_head_dim: Any = 0,
                qk_rope_head_dim: Any = 0, v_head_dim: Any = 0, sliding_window: Any = 0,
                **_unused: Any) -> Any:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one GPU.

    An MoE layer (``experts > 0``) routes each token to ``top_k`` experts: the paper's per-token
    MLP terms (Sec. 4.1) are kept once per routed copy, plus the copy itself, which is the input
    the expert's first matmul saves (the dispatcher permutes tokens into a new buffer, as
    Megatron-Core's ``MoEAlltoAllTokenDispatcher`` does). The norm output (router and dispatch
    input) and the residual dropout mask stay once per token; the router's s x E logits are left
    out (E/h of one h-sized tensor: 0.2% for 8 experts and h = 4096). With balanced routing each
    expert-parallel rank processes ``top_k`` copies of its own tokens, so ``ep`` does not appear;
    expert tensor parallelism gathers each copy over the ``etp`` ranks that split its ``moe_ffn``
    columns (Megatron-Core's ``MoEAlltoAllTokenDispatcher`` all-gathers over the expert-TP group),
    so the h-sized copies count ``etp`` times and the f-sized ones once. With a capacity factor
    C the expert buffers hold up to C x the balanced load (GShard, Lepikhin et al. 2020, Sec. 2.2;
    Megatron-Core pads to capacity with ``--moe-pad-expert-input-to-capacity``): ``top_k x C``
    copies. ``shared_experts`` MLPs (``moe_ffn`` wide) read the norm output and keep their own
    f-sized tensors for every token. A dense layer (``experts == 0``) keeps one ``ffn``-wide MLP.

    Attention keeps Q, K, V and the attention output, ``heads x head_dim`` and ``kv_heads x
    head_dim`` wide (``head_dim`` default h / heads). Multi-head latent attention (``kv_lora_rank
    > 0``; Megatron-Core ``MLASelfAttention``): the compressed query and key-value latents
    (``q_lora_rank``, ``kv_lora_rank``) twice each, as their RMSNorm's input and as the
    up-projection's input, sequence-sharded with SP but not split by TP (the down-projections are
    replicated), the shared rope key (``qk_rope_head_dim``, gathered over the sequence), and the
    decompressed heads: Q and K ``heads x (nope + rope)``, V and the output ``heads x v_head_dim``.
    ``sliding_window`` (this layer attends within a window; 0: to the whole sequence): explicit
    attention (``recompute="none"``) stores s x min(window, s) scores per head instead of s x s;
    a FlashAttention-style kernel (``"selective"``) stores none either way.

    ``norm_saved``: h-sized tensors each norm keeps (1 for fused LayerNorm/RMSNorm as counted by
    the paper; 2 for PyTorch's composite ``nn.RMSNorm``, which also keeps its normalised output).
    ``cp`` splits the sequence; each rank's queries still attend to all ``seq`` keys.
    """
    s, b, h, a = seq / cp, micro_batch_size, hidden, heads
    sb = s * b
    sbh = sb * h
    sp = _where(sequence_parallel, tp, 1)     # SP also shards the "outside TP" tensors (Sec. 4.2.2)
    drop = _where(dropout, 1, 0)
    d = hidden // heads if head_dim is None else head_dim
    mla = kv_lora_rank > 0
    gqa = kv_lora_rank == 0
    qk = qk_nope_head_dim + qk_rope_head_dim
    # Q, K (for QK^T), V, and the projection input (the attention output), per token
    heads_width = (gqa * (heads * d + 2 * kv_heads * d + heads * d)
                   + mla * (2 * heads * qk + 2 * heads * v_head_dim))
    latents = mla * ((1 + norm_saved) * (q_lora_rank + kv_lora_rank) / sp + qk_rope_head_dim)
    # Sec. 4.1, attention block: QKV input (norm output), the heads above, MLA's latents; with
    # dropout also the residual dropout mask.
    attention = (act_bytes * sbh / sp
                 + act_bytes * sb * heads_width / tp
                 + act_bytes * sb * latents
                 + drop * mask_bytes * sbh / sp)
    # softmax output, its dropout mask, and the dropout output (= softmax output without dropout)
    keys = seq + (sliding_window > 0) * (np.minimum(sliding_window, seq) - seq)
    scores = a * s * keys * b * (act_bytes + drop * (mask_bytes + act_bytes)) / tp
    # MLP: input; GELU keeps its input and fc2 input (2 f-sized tensors), unfused SwiGLU keeps gate,
    # silu(gate), up and their product (4); plus the residual dropout mask. MoE: top_k routed
    # copies (x C with a capacity factor), each with its f-sized tensors and its own h-sized input.
    moe = experts > 0
    width = _where(moe, ffn if moe_ffn is None else moe_ffn, ffn)
    f_tensors = _where(swiglu, 4, 2)
    routed = _where(moe, top_k * _where(capacity_factor > 0, capacity_factor, 1), 1)
    shared = _where(moe, shared_experts, 0)
    mlp = (act_bytes * sbh / sp
           + routed * (act_bytes * sb * width * f_tensors / tp + _where(moe, etp * act_bytes * sbh / sp, 0))
           + shared * act_bytes * sb * width * f_tensors / tp
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


def mean_layer_bytes(*, layers: Any, moe_layers: Any = None, sliding_layers: Any = 0,
                     experts: Any = 0, sliding_window: Any = 0, per_layer: Any = None, **shape: Any) -> Any:
    """:func:`layer_bytes` averaged over a model's layers: ``layers - moe_layers`` dense and
    ``moe_layers`` MoE layers (default: all, for an MoE model), ``sliding_layers`` of them within
    the ``sliding_window`` (the kinds are independent: GPT-OSS alternates windows in MoE layers).
    ``shape`` holds :func:`layer_bytes`'s other arguments (the keys of
    :meth:`~dtlib.analytic.config.TransformerConfig.numbers` are accepted and the rest ignored).
    A pipeline stage holding ``n`` layers keeps about ``n`` times this; exact with one stage.
    ``per_layer``: the function averaged (default :func:`layer_bytes`; e.g. a
    :func:`stored_layer_bytes` with its options bound)."""
    per_layer = layer_bytes if per_layer is None else per_layer
    moe_layers = (experts > 0) * layers if moe_layers is None else moe_layers
    total = 0
    for moe, sliding in ((False, False), (False, True), (True, False), (True, True)):
        share = ((moe_layers if moe else layers - moe_layers) / layers
                 * (sliding_layers if sliding else layers - sliding_layers) / layers)
        one = per_layer(experts=experts if moe else 0, sliding_window=sliding_window if sliding else 0,
                        **shape)
        total = total + share * one
    return total


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


def op_selective_bytes(seq: Any, micro_batch_size: Any, hidden: Any, heads: Any, kv_heads: Any, ffn: Any,
                       tp: Any = 1, cp: Any = 1, sequence_parallel: Any = False, swiglu: Any = False,
                       act_bytes: Any = 2, experts: Any = 0, top_k: Any = 0) -> Any:
    """Bytes one layer keeps under torchtitan's per-op selective checkpointing
    (``activation_checkpoint.mode = "selective"``, ``selective_ac_option = "op"``).

    torchtitan's policy (``torchtitan/distributed/activation_checkpoint.py``, ``_custom_policy``)
    saves the outputs of the ops in its save list (``aten.mm``, the SDPA flash/efficient/cuDNN
    kernels, ``reduce_scatter_tensor``) "except every second mm", counting mms per layer: of a
    Llama block's wq, wk, wv, wo, w1, w3, w2 it keeps wq, wv, w1 and w2 (1st, 3rd, 5th, 7th; a GELU
    MLP's fc1 is the 5th, its fc2 the 6th, recomputed). Everything else is recomputed from the
    layer input, which the checkpoint keeps. Kept: the input (``s b h / t`` with SP), Q and V
    (column-parallel, ``/ t``), the attention output and its fp32 log-sum-exp (``4 b s a / t``
    bytes), w1's output (``s b f / t``), w2's row-parallel output before its reduce-scatter (full
    ``s b h`` on each TP rank) and, with SP, both reduce-scatter outputs (``s b h / t`` each).
    MoE layers keep w1 per routed copy (``top_k``). ``cp`` splits the sequence.
    """
    s, b, h = seq / cp, micro_batch_size, hidden
    sbh = s * b * h
    sp = _where(sequence_parallel, tp, 1)
    kv = kv_heads / heads
    routed = _where(experts > 0, top_k, 1)
    layer_input = act_bytes * sbh / sp
    attention = act_bytes * sbh * (1 + kv + 1) / tp + 4 * b * s * heads / tp   # Q, V, output; LSE
    w1 = routed * act_bytes * s * b * ffn / tp
    w2 = _where(swiglu, routed * act_bytes * sbh, 0)       # GELU's fc2 is the 6th mm: recomputed
    scattered = _where(sequence_parallel, 2 * act_bytes * sbh / tp, 0) * (tp > 1)
    return layer_input + attention + w1 + w2 + scattered


def check_recompute_modules(modules: Any, recompute: str = "none") -> tuple[str, ...]:
    """``modules`` as a tuple of :data:`RECOMPUTE_MODULES` names, else ValueError naming
    ``recompute_modules`` and the valid names. Megatron-Core applies them with
    ``recompute_granularity="selective"`` only, so they describe the layers ``recompute`` leaves
    stored (``none`` / ``selective``), not ``full`` or torchtitan's ``op`` policy."""
    if not isinstance(modules, (tuple, list)) or not all(isinstance(m, str) for m in modules):
        raise ValueError(f"recompute_modules must be a tuple of names from {', '.join(RECOMPUTE_MODULES)}, "
                         f"got {modules!r}")
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown:
        raise ValueError(f"recompute_modules: unknown {', '.join(map(repr, unknown))}; valid: "
                         f"{', '.join(RECOMPUTE_MODULES)}")
    if modules and recompute not in ("none", "selective"):
        raise ValueError(f"recompute_modules={','.join(modules)} is Megatron-Core's selective recompute; "
                         f"it needs recompute 'none' or 'selective', got {recompute!r}")
    return tuple(dict.fromkeys(modules))


def recompute_module_bytes(module: str, *, recompute: str = "none", flash_attention: Any = True,
                           fused_swiglu: Any = False, fp8_inputs: Any = False, **shape: Any) -> Any:
    """Bytes one layer no longer keeps per micro-batch when Megatron-Core recomputes ``module``
    (``--recompute-granularity selective --recompute-modules ...``; Megatron-Core 0.16), counted
    with :func:`layer_bytes`'s tensors (``shape``: its arguments) under the Transformer Engine layer
    spec (``models/gpt/gpt_layer_specs.py``: the input norm is fused into the QKV GEMM except for
    MLA, the pre-MLP norm into FC1 except in MoE layers).

    * ``core_attn`` (``attention.py``, ``_checkpointed_attention_forward``): the s x s scores and
      dropout masks of explicit attention; nothing with a FlashAttention-style kernel or when
      ``recompute`` is already ``selective`` (Korthikanti et al. 2022, Sec. 5).
    * ``layernorm`` (``transformer_layer.py``: ``CheckpointWithoutOutput`` on ``input_layernorm``
      and ``pre_mlp_layernorm``, output discarded): the output of each norm that is a module of its
      own, i.e. the pre-MLP norm of an MoE layer (router and shared-expert input, ``s b h``) and
      MLA's input norm (the down-projections' input, 1 byte with ``fp8_inputs`` as counted there).
      Fused norms (``TELayerNormColumnParallelLinear``) are ``IdentityOp`` and not recomputed.
    * ``mla_up_proj`` (``multi_latent_attention.py``: ``qkv_up_checkpoint``): the decompressed
      Q, K (``heads x (nope + rope)``) and V (``heads x v_head_dim``), ``/ tp``; the latents and
      the attention output stay.
    * ``moe_act`` (``moe/experts.py``, ``TEGroupedMLP``: the activation's output discarded): FC2's
      input of every routed copy (``s b moe_ffn / tp``, 1 byte with ``fp8_inputs``), and with an
      unfused SwiGLU also silu(gate); FC1's output stays (the activation's input).
    * ``mlp`` (dense layers only; ``tensor_parallel.checkpoint`` of the MLP, whose input is the
      fused norm's input, kept anyway): the norm output and the FFN-wide tensors.
    * ``moe`` (``moe/moe_layer.py``, the whole MoE block checkpointed from its input, the pre-MLP
      norm's output): the routed copies and their FFN tensors and the shared experts'.
    * ``shared_experts`` (``moe/shared_experts.py``): the shared experts' FFN-wide tensors.
    """
    s = shape["seq"] / shape.get("cp", 1)
    b, h, tp = shape["micro_batch_size"], shape["hidden"], shape.get("tp", 1)
    act = shape.get("act_bytes", 2)
    sb = s * b
    sbh = sb * h
    sp = _where(shape.get("sequence_parallel", False), tp, 1)
    low = _cached_input(fp8_inputs, act)       # a GEMM input as Transformer Engine caches it
    experts, heads = shape.get("experts", 0), shape["heads"]
    moe = experts > 0
    mla = shape.get("kv_lora_rank", 0) > 0
    swiglu = np.asarray(shape.get("swiglu", False), bool)
    unfused = swiglu & ~np.asarray(fused_swiglu, bool)
    width = _where(moe, shape["ffn"] if shape.get("moe_ffn") is None else shape["moe_ffn"], shape["ffn"])
    ffn_tensor = sb * width / tp               # one FFN-wide tensor, in elements
    if module == "core_attn":
        scores = layer_bytes(recompute="none", **shape) - layer_bytes(recompute="selective", **shape)
        return _where(np.asarray(flash_attention, bool) | (recompute == "selective"), 0 * scores, scores)
    if module == "layernorm":
        return moe * act * sbh / sp + mla * low * sbh / sp
    if module == "mla_up_proj":
        qk = shape.get("qk_nope_head_dim", 0) + shape.get("qk_rope_head_dim", 0)
        return mla * act * sb * heads * (2 * qk + shape.get("v_head_dim", 0)) / tp
    if module == "moe_act":
        cf = shape.get("capacity_factor", 0)
        routed = shape.get("top_k", 0) * _where(cf > 0, cf, 1)
        return moe * routed * ffn_tensor * (low + unfused * act)
    no_mlp = dict(shape, top_k=0, shared_experts=0)
    options = dict(flash_attention=flash_attention, fused_swiglu=fused_swiglu, fp8_inputs=fp8_inputs)
    if module == "mlp":   # the layer without its FFN-wide tensors, less the MLP input it then keeps
        kept = _kept(recompute, **options, **shape) - _kept(recompute, **options, **dict(shape, ffn=0))
        return _where(moe, 0 * kept, kept + low * sbh / sp)
    if module == "moe":   # the layer without routed copies and shared experts: only the block input
        return moe * (_kept(recompute, **options, **shape) - _kept(recompute, **options, **no_mlp))
    if module == "shared_experts":
        return moe * (_kept(recompute, **options, **shape)
                      - _kept(recompute, **options, **dict(shape, shared_experts=0)))
    raise ValueError(f"recompute_modules: unknown {module!r}; valid: {', '.join(RECOMPUTE_MODULES)}")


def stored_layer_bytes(recompute: str, *, flash_attention: Any = True, fused_swiglu: Any = False,
                       fp8_inputs: Any = False, recompute_modules: tuple[str, ...] = (), **shape: Any) -> Any:
    """Bytes one layer keeps per micro-batch when it is not fully recomputed, for ``recompute``
    ``none`` / ``selective`` / ``op`` (``shape``: :func:`layer_bytes`'s arguments).

    ``flash_attention``: a FlashAttention-style kernel never stores the s x s scores, which is
    selective recompute's footprint (Dao et al. 2022; Korthikanti et al. 2022, Sec. 5).
    ``fused_swiglu``: Megatron-Core's ``SwiGLUFunction`` (``fusions/fused_bias_swiglu.py``, on by
    default in Megatron-LM: ``--no-bias-swiglu-fusion`` turns it off) saves only its input, the
    FC1 output, so an FC2 input and FC1 output (3 FFN-wide tensors) are kept instead of eager
    PyTorch's gate, silu(gate), up and their product (4). ``fp8_inputs``: Transformer Engine's FP8
    linears save their input quantized (``module/linear.py``, ``_Linear.forward``: "Cached input
    tensor", only the column-wise FP8 data kept for the weight-gradient GEMM), so the inputs of
    the QKV, projection, FC1 and FC2 GEMMs take 1 byte per element instead of ``act_bytes``; a number
    instead of True is the bytes per element of the cached copy (NVFP4: the same ``_Linear`` caches the
    column-wise NVFP4 data, 9/16 byte, :data:`dtlib.analytic.precision.NVFP4_BYTES`).
    Shared experts (``SharedExpertMLP``, the same fused SwiGLU and TE linears) count as routed
    copies do for both, except their FC1 input, which is the norm output counted once.
    ``recompute_modules``: Megatron-Core's selective-recompute submodules, whose tensors the layer
    no longer keeps (:func:`recompute_module_bytes`).
    """
    options = dict(flash_attention=flash_attention, fused_swiglu=fused_swiglu, fp8_inputs=fp8_inputs)
    dropped = sum(recompute_module_bytes(m, recompute=recompute, **options, **shape)
                  for m in check_recompute_modules(recompute_modules, recompute))
    return _kept(recompute, **options, **shape) - dropped


def _kept(recompute: str, *, flash_attention: Any, fused_swiglu: Any, fp8_inputs: Any, **shape: Any) -> Any:
    """:func:`stored_layer_bytes` without selective-recompute modules."""
    if recompute == "op":
        keys = ("seq", "micro_batch_size", "hidden", "heads", "kv_heads", "ffn", "tp", "cp",
                "sequence_parallel", "swiglu", "act_bytes", "experts", "top_k")
        return op_selective_bytes(**{k: shape[k] for k in keys if k in shape})
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'op' here, got {recompute!r}")
    stores_scores = recompute == "none" and not flash_attention
    kept = layer_bytes(recompute="none" if stores_scores else "selective", **shape)
    s = shape["seq"] / shape.get("cp", 1)
    b, h, ffn, tp = shape["micro_batch_size"], shape["hidden"], shape["ffn"], shape.get("tp", 1)
    act = shape.get("act_bytes", 2)
    sp = _where(shape.get("sequence_parallel", False), tp, 1)
    moe = shape.get("experts", 0) > 0
    routed = _where(moe, shape.get("top_k", 0), 1)
    moe_ffn = shape.get("moe_ffn")
    ffn = _where(moe, ffn if moe_ffn is None else moe_ffn, ffn)  # an expert's width (zoo's layer_bytes)
    mlps = routed + _where(moe, shape.get("shared_experts", 0), 0)  # shared experts: SwiGLU and FC2 alike
    ffn_tensor = mlps * act * s * b * ffn / tp
    kept = kept - _where(fused_swiglu & np.asarray(shape.get("swiglu", False), bool), ffn_tensor, 0)
    gemm_inputs = s * b * h / sp + s * b * h / tp + routed * s * b * h / sp + mlps * s * b * ffn / tp
    return kept - _where(fp8_inputs, (act - _cached_input(fp8_inputs, act)) * gemm_inputs, 0)


def activation_breakdown(*, seq: Any, micro_batch_size: Any, hidden: Any, heads: Any, kv_heads: Any,
                         ffn: Any, vocab: Any, stored: list[dict[str, Any]], tp: Any = 1, cp: Any = 1,
                         sequence_parallel: Any = False, recompute: str = "none", swiglu: Any = False,
                         dropout: Any = False, flash_attention: Any = True, fused_swiglu: Any = False,
                         fp8_inputs: Any = False, act_bytes: Any = 2, mask_bytes: Any = 1,
                         logits_bytes: Any = 4, norm_saved: Any = 1, offloaded: Any = 0,
                         experts: Any = 0, top_k: Any = 0,
                         recompute_modules: tuple[str, ...] = (), **model: Any) -> list[dict[str, Any]]:
    """Activation bytes on pipeline ranks, by component, one dict per entry of ``stored``.

    ``stored`` (:func:`dtlib.analytic.stages.stored_on_rank`): per rank, the
    layer x micro-batch pairs fully recomputed (``full``: only the layer input kept, Korthikanti
    Sec. 4.3) and the others (``rest``: :func:`stored_layer_bytes` for ``recompute``), the share
    of them in MoE layers (``moe_share``), and the micro-batches in flight of the chunk holding the
    embedding (``embedding``, 0 off the first rank) and the loss (``output``, 0 off the last).
    ``layers``: their sum; ``embedding`` and ``output`` once per micro-batch of that chunk;
    ``recompute_buffer``: a fully or per-op recomputed layer is rebuilt during its backward, a
    transient the paper leaves out but the GPU must hold (what the layer would keep without
    recomputation, less what it keeps anyway). ``offloaded``: the share of each chunk's layers whose
    kept activations live in CPU memory (``cpu``, not in ``total``); ``offload_buffer``: one of
    those layers' activations back on the GPU for its backward. ``model``: the other keys of
    :meth:`~dtlib.analytic.config.TransformerConfig.numbers` (``layers``, ``sliding_layers``,
    ``moe_ffn``, MLA dims, ...): per-layer bytes are the rank's mix of dense and MoE layers, each
    averaged over the model's sliding / global layers (:func:`mean_layer_bytes`). ``recompute_modules``
    (:func:`recompute_module_bytes`) thin the layers that are not fully recomputed; a recomputed
    module is rebuilt inside its own backward, a transient of one module that is left out.
    """
    common = dict(seq=seq, micro_batch_size=micro_batch_size, hidden=hidden, tp=tp, cp=cp,
                  sequence_parallel=sequence_parallel)
    shape = dict(common, heads=heads, kv_heads=kv_heads, ffn=ffn, swiglu=swiglu, dropout=dropout,
                 act_bytes=act_bytes, mask_bytes=mask_bytes, norm_saved=norm_saved, experts=experts,
                 top_k=top_k)
    options = dict(flash_attention=flash_attention, fused_swiglu=fused_swiglu, fp8_inputs=fp8_inputs)
    shape.update(model)
    kinds = {k: shape.pop(k) for k in ("layers", "moe_layers", "sliding_layers", "sliding_window") if k in shape}
    kinds.setdefault("layers", 1)

    sliding = kinds.get("sliding_layers", 0) / kinds["layers"]
    windowed = np.any(np.asarray(kinds.get("sliding_window", 0)) > 0) and np.any(sliding)
    moe_model = np.any(np.asarray(experts) > 0)

    def mean(function, **fixed):
        """(dense, MoE) layer bytes, each averaged over sliding / global layers (as
        :func:`mean_layer_bytes`, each kind evaluated only where the model has it)."""
        def kind(moe: bool):
            one = lambda window: function(**fixed, **dict(shape, experts=experts if moe else 0, sliding_window=window))
            return (1 - sliding) * one(0) + sliding * one(kinds["sliding_window"]) if windowed else one(0)
        dense = kind(False)
        return dense, (kind(True) if moe_model else dense)

    by_kind = {"full": mean(layer_bytes, recompute="full"),
               "kept": mean(stored_layer_bytes, recompute="none" if recompute == "full" else recompute,
                            recompute_modules=recompute_modules, **options),
               "whole": mean(stored_layer_bytes, recompute="none", **options)}
    emb = embedding_bytes(dropout=dropout, mask_bytes=mask_bytes, **common)
    out = output_bytes(vocab=vocab, act_bytes=act_bytes, logits_bytes=logits_bytes,
                       norm_saved=norm_saved, **common)
    result = []
    for counts in stored:
        share = counts["moe_share"]
        full_layer, kept, whole = ((1 - share) * dense + share * moe for dense, moe in by_kind.values())
        rebuilt = np.where(counts["full"] > 0, whole - full_layer, 0) if recompute != "op" else whole - kept
        layers = counts["full"] * full_layer + counts["rest"] * kept
        reloaded = np.where(counts["rest"] > 0, kept, full_layer)
        rank = {"layers": (1 - offloaded) * layers, "cpu": offloaded * layers,
                "offload_buffer": np.where(offloaded > 0, reloaded, 0) + 0 * full_layer,
                "embedding": emb * counts["embedding"], "output": out * counts["output"],
                "recompute_buffer": rebuilt + 0 * full_layer}
        rank["total"] = sum(rank[k] for k in ("layers", "embedding", "output", "recompute_buffer", "offload_buffer"))
        result.append(rank)
    return result
