"""Compute time from the shapes of the matrix multiplications, not from one fraction of peak.

A GEMM ``C[M, N] = A[M, K] B[K, N]`` runs as tiles of ``C``, one thread block per tile, on the
GPU's streaming multiprocessors (SMs). Its time is the larger of (NVIDIA, "Matrix Multiplication
Background User's Guide", Deep Learning Performance documentation, sections "Math and Memory
Bounds", "Tile Quantization" and "Wave Quantization"):

* the math time: ``waves`` x the time one SM needs for one tile, where
  ``tiles = ceil(M / tile_m) x ceil(N / tile_n)`` (tile quantization: a partial tile costs a whole
  one) and ``waves = ceil(tiles / SMs)`` (wave quantization: a last partial wave costs a whole
  one); one SM does ``peak / SMs`` FLOP/s; divided by the kernel efficiency (the one fitted number
  for GEMMs, :mod:`dtlib.plan.calibration`);
* the memory time: ``(M K + K N + M N)`` elements read and written at the HBM bandwidth
  (the roofline, Williams et al. 2009).

cuBLAS picks a tile per shape; the model takes the fastest of :data:`TILES` (the guide's
256x128 and 128x256 for large GEMMs, 128x128 for small ones).

The transformer's GEMMs per layer are those of Megatron-LM tensor parallelism on one tensor rank
(Shoeybi et al. 2019, Sec. 3: QKV and FC1 split by columns, the attention projection and FC2 by
rows); with context parallelism a rank holds ``s / cp`` tokens of each sequence. Backward runs two
GEMMs per forward GEMM, ``dX = dY W^T`` (M x K, contracting N) and ``dW = X^T dY`` (K x N,
contracting M). Attention with FlashAttention is timed from its FLOPs (the causal mask skips the
upper half of the tiles; backward does 2.5x the forward's matmul work, Dao 2023, "FlashAttention-2",
Sec. 3.1-3.2) at the attention kernel efficiency; with packed sequences (``packed_doc_length``) the
variable-length kernel attends within each document only (:func:`dtlib.analytic.flops.keys_per_query`);
without FlashAttention (Megatron-LM of 2021-22) ``Q K^T`` and ``A V`` are batched GEMMs per head, timed
as above, over the whole sequence whatever the mask.

FP8 GEMMs need their operands cast from BF16 first (Transformer Engine / torchao with current or
dynamic scaling): the cast reads the tensor once for its absolute maximum, reads it again and
writes FP8, and writes a transposed FP8 copy for the backward GEMMs (Hopper's FP8 tensor cores
take only K-major operands; Transformer Engine FP8 documentation, "FP8 on Hopper"): about
:data:`FP8_CAST_BYTES` = 2 + 2 + 1 + 1 bytes per element of each activation, weight and output
gradient, memory-bound at the HBM bandwidth.

NVFP4 (NVIDIA's recipe, NVIDIA 2025, "Pretraining Large Language Models with NVFP4", arXiv:2509.25149,
Sec. 4, Fig. 5; Transformer Engine's ``NVFP4BlockScaling``): the fprop, dgrad and wgrad GEMMs of every
linear layer read NVFP4 operands (:data:`dtlib.analytic.precision.NVFP4_BYTES` per element) at the FP4
peak (:func:`dtlib.analytic.hardware.matmul_peak`); attention's batched GEMMs, the embedding and the
output layer stay BF16, and so do the ``bf16_layers`` transformer layers Megatron keeps in BF16
(``--first-last-layers-bf16``; default none, as Megatron-LM and Megatron-Bridge's performance recipes).
Each operand is quantized like an FP8 one, with the global amax first (the per-tensor FP32 scale),
then one pass writing the row-wise and the column-wise (transposed, for the backward GEMMs) NVFP4
copies: :data:`NVFP4_CAST_BYTES` = 2 + 2 + 2 x 9/16 bytes per element. The random Hadamard transform
of the wgrad inputs (16 x 16, Sec. 4.2) is fused into the column-wise cast (TE's Hadamard-cast
kernel) and its 32 FLOPs per element are not counted; stochastic rounding of the gradients (Sec. 4.4)
is a hardware rounding mode of the conversion, no extra pass.

A power limit lowers the clock: dynamic power is ``C V^2 f`` and in the DVFS range the voltage
follows the frequency, so power goes as ``f^3`` and the clock as ``(limit / TDP)^(1/3)``
(:func:`clock_scale`; the exponent is an option). A datasheet that quotes its peaks at a clock the
part does not hold under a matmul (GB200: its maximum clock) is timed at the clock it holds
(:data:`dtlib.analytic.hardware.GB200_SUSTAINED_CLOCK`). Memory bandwidth does not depend on the SM clock.

Pure numpy: every argument may be an array (one entry per layout of the search).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.finetune import target_on, target_shapes
from dtlib.analytic.flops import attention_flops_per_token
from dtlib.analytic.hardware import Accelerator, matmul_peak
from dtlib.analytic.measured import MeasuredAccelerator
from dtlib.analytic.precision import NVFP4_BYTES, OPERAND_BYTES
from dtlib.plan.moe import expert_load, expert_rows, grouped_gemm_overhead, moe_numbers

__all__ = ["TILES", "FLASH_BACKWARD", "FP8_CAST_BYTES", "NVFP4_CAST_BYTES", "CAST_BYTES", "gemm_time", "clock_scale",
           "transformer_compute"]

# (tile_m, tile_n) of C: the guide's "Tile Quantization" section lists 256x128 / 128x256 as the most
# efficient cuBLAS tiles and 128x128 among the smaller ones chosen for small matrices.
TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128))

# FlashAttention-2 backward / forward matmul work: 5 matmuls against 2 (Dao 2023, Sec. 3.2;
# the paper's FLOP count for the backward is 2.5x the forward's)
FLASH_BACKWARD = 2.5

# bytes moved per element cast to FP8: amax read (2), cast read (2) + write (1), transposed copy (1)
FP8_CAST_BYTES = 6.0
# per element cast to NVFP4 (module docstring): amax read (2), cast read (2), row-wise and column-wise writes
NVFP4_CAST_BYTES = 2 + 2 + 2 * NVFP4_BYTES
# what each matmul precision casts per element (bf16 casts nothing)
CAST_BYTES = {"bf16": 0.0, "fp8": FP8_CAST_BYTES, "nvfp4": NVFP4_CAST_BYTES}


def clock_scale(gpu: Accelerator, power_limit_w: float | None = None, exponent: float = 3.0) -> float:
    """Fraction of the clock its peaks are quoted at that a GPU sustains under ``power_limit_w``
    (None: its TDP): its :attr:`~dtlib.analytic.hardware.Accelerator.sustained_clock` (1 but for
    GB200) x ``min(1, (limit / TDP) ** (1 / exponent))`` (power ~ f V^2 with V ~ f: exponent 3)."""
    validate.number("exponent", exponent, minimum=1, exclusive=False)
    if power_limit_w is None:
        return gpu.sustained_clock
    validate.number("power_limit_w", power_limit_w)
    if gpu.tdp_w is None:
        raise validate.InvalidArgument("power_limit_w", f"None for {gpu.name}, whose TDP the catalogue "
                                       "does not have", power_limit_w)
    ratio = power_limit_w / gpu.tdp_w
    return gpu.sustained_clock * float(min(1.0, ratio ** (1.0 / exponent)))


def gemm_time(m: Any, n: Any, k: Any, gpu: Accelerator, *, dtype: str = "bf16", batch: Any = 1,
              efficiency: float = 1.0, clock: float = 1.0, bytes_per_element: float = 2.0,
              tiles: tuple[tuple[int, int], ...] = TILES) -> Any:
    """Seconds of ``batch`` GEMMs of ``M x K`` by ``K x N`` on ``gpu`` (see the module docstring):
    the larger of the quantized math time (fastest tile of ``tiles``) / ``efficiency`` and the HBM
    time of the operands. A GPU without an SM count in the catalogue gets the plain roofline; a
    calibrated device (:class:`~dtlib.analytic.measured.MeasuredAccelerator`) its measured times,
    which already hold the kernels' efficiency, clock and memory traffic."""
    validate.array("efficiency", efficiency, maximum=1)  # a fraction, or one per GEMM
    validate.number("clock", clock, maximum=1)
    for name, x in (("m", m), ("n", n), ("k", k), ("batch", batch)):
        validate.array(name, x, minimum=0, exclusive=False)
    if isinstance(gpu, MeasuredAccelerator):
        return gpu.gemm_seconds(m, n, k, batch)
    m, n, k, batch = (np.asarray(x, dtype=float) for x in (m, n, k, batch))
    peak = matmul_peak(gpu, dtype) * clock * efficiency
    if gpu.sms is None:  # no SM count: no quantization, FLOPs / peak
        math = 2 * m * n * k * batch / peak
    else:
        per_sm = peak / gpu.sms
        math = np.full(np.broadcast(m, n, k, batch).shape, np.inf)
        for tile_m, tile_n in tiles:
            count = batch * np.ceil(m / tile_m) * np.ceil(n / tile_n)  # tile quantization
            waves = np.ceil(count / gpu.sms)                              # wave quantization
            math = np.minimum(math, waves * 2 * tile_m * tile_n * k / per_sm)
    traffic = batch * (m * k + k * n + m * n) * bytes_per_element
    memory = traffic / gpu.memory_bandwidth
    return np.maximum(math, memory)


def _fwd_bwd(m: Any, n: Any, k: Any, batch: Any, frozen: Any = 0, **kw: Any) -> tuple[Any, Any]:
    """Forward GEMM (M, N, K) and its two backward GEMMs: dX (M x K over N), dW (K x N over M);
    a ``frozen`` weight (LoRA's base, Hu et al. 2021, Sec. 4.2) has no dW."""
    forward = gemm_time(m, n, k, batch=batch, **kw)
    backward = gemm_time(m, k, n, batch=batch, **kw) + (1 - frozen) * gemm_time(k, n, m, batch=batch, **kw)
    return forward, backward


def adapter_gemms(n: dict[str, Any], tokens: Any, expert_rows: Any, local_experts: Any,
                  kw: dict[str, Any]) -> dict[bool, tuple[Any, Any]]:
    """Forward and backward seconds of one layer's LoRA adapters on one GPU, for a dense layer
    (``False``) and an MoE layer (``True``): per targeted matrix (:func:`dtlib.analytic.finetune.target_shapes`)
    X A (``tokens`` x r over its input) and (X A) B (x its output over r), both trained, split as
    the matrix is over tp (routed experts: ``expert_rows`` rows each, ``local_experts`` of them,
    over etp). Thin GEMMs: :func:`gemm_time` finds most of them bound by memory traffic."""
    r = np.maximum(n.get("lora_rank", 0), 1)
    on_layer = (np.asarray(n.get("lora_rank", 0)) > 0) * 1.0
    out = {}
    for moe in (False, True):
        forward = backward = 0.0
        for name, d_in, d_out, split, copies, routed in target_shapes(n, moe):
            group = n.get("etp", 1) if routed else n["tp"]
            d_in = np.maximum(d_in / np.where(split == "row", group, 1), 1)
            d_out = np.maximum(d_out / np.where(split == "column", group, 1), 1)
            rows, batch = (expert_rows, local_experts) if routed else (tokens, 1)
            a, b = _fwd_bwd(rows, r, d_in, batch, **kw), _fwd_bwd(rows, d_out, r, batch, **kw)
            on = on_layer * target_on(n.get("lora_targets", 0), name) * (np.asarray(copies) > 0)
            forward, backward = forward + on * (a[0] + b[0]), backward + on * (a[1] + b[1])
        out[moe] = (forward, backward)
    return out


def _mlp(rows: Any, width: Any, h: Any, matrices: Any, batch: Any, kw: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Forward and backward seconds of ``batch`` MLPs of ``rows`` tokens, FFN ``width`` on this
    rank (FC1 and FC2), and the elements an FP8 cast reads (inputs, outputs, weights). ``matrices``
    counts FC2 too: GELU has 2 (FC1 of width ``width``), SwiGLU 3 (gate and up fused in FC1)."""
    fc1_width = (matrices - 1) * width
    fc1 = _fwd_bwd(rows, fc1_width, h, batch, **kw)
    fc2 = _fwd_bwd(rows, h, width, batch, **kw)
    cast = batch * (rows * (h + width) + rows * (fc1_width + h) + matrices * h * width)
    return fc1[0] + fc2[0], fc1[1] + fc2[1], cast


def attention_projections(n: dict[str, Any], tokens: Any, **weights_kw: Any) -> dict[str, Any]:
    """Forward and backward seconds of one layer's attention projections on one GPU, and the
    elements an FP8 cast reads/writes (``inputs``, ``outputs``, ``weights``).

    Q/K/V fused (h -> (heads + 2 kv_heads) x head_dim, column-parallel) and O ((heads x head_dim)/tp
    -> h, row-parallel) (Shoeybi et al. 2019, Sec. 3; ``head_dim`` as HF sets it). Multi-head
    latent attention (DeepSeek-V2, Sec. 2.1.2; Megatron-Core ``MLASelfAttention``): the
    down-projections h -> q_lora_rank and h -> kv_lora_rank + rope are replicated on every TP rank
    (``parallel_mode='duplicated'``), the up-projections q_lora_rank -> heads (nope + rope) and
    kv_lora_rank -> heads (nope + v) are column-parallel, O (heads x v) / tp -> h row-parallel."""
    tp, h, heads, kv_heads = n["tp"], n["hidden"], n["heads"], n["kv_heads"]
    head_dim = n.get("head_dim", h // heads)
    q_rank, kv_rank = n.get("q_lora_rank", 0), n.get("kv_lora_rank", 0)
    nope, rope, v_dim = n.get("qk_nope_head_dim", 0), n.get("qk_rope_head_dim", 0), n.get("v_head_dim", 0)
    mla = kv_rank > 0
    if not np.any(mla):  # GQA/MHA
        qkv = _fwd_bwd(tokens, (heads + 2 * kv_heads) * head_dim / tp, h, 1, **weights_kw)
        proj = _fwd_bwd(tokens, h, heads * head_dim / tp, 1, **weights_kw)
        qkv_width = (heads + 2 * kv_heads) * head_dim
        return {"forward": qkv[0] + proj[0], "backward": qkv[1] + proj[1],
                "inputs": tokens * (h + heads * head_dim / tp), "outputs": tokens * (qkv_width / tp + h),
                "weights": h * (qkv_width + heads * head_dim) / tp}
    compressed_q = q_rank > 0
    q_down = _fwd_bwd(tokens, np.maximum(q_rank, 1), h, compressed_q * 1.0, **weights_kw)
    q_in = np.where(compressed_q, q_rank, h)
    q_up = _fwd_bwd(tokens, heads * (nope + rope) / tp, q_in, 1, **weights_kw)
    kv_down = _fwd_bwd(tokens, kv_rank + rope, h, 1, **weights_kw)
    kv_up = _fwd_bwd(tokens, heads * (nope + v_dim) / tp, kv_rank, 1, **weights_kw)
    proj = _fwd_bwd(tokens, h, heads * v_dim / tp, 1, **weights_kw)
    parts = (q_down, q_up, kv_down, kv_up, proj)
    replicated = compressed_q * h * q_rank + h * (kv_rank + rope)
    split = q_in * heads * (nope + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * h
    return {"forward": sum(p[0] for p in parts), "backward": sum(p[1] for p in parts),
            "inputs": tokens * (h + compressed_q * q_rank + kv_rank + heads * v_dim / tp),
            "outputs": tokens * (compressed_q * q_rank + kv_rank + rope
                                 + heads * (2 * nope + rope + v_dim) / tp + h),
            "weights": replicated + split / tp}


def transformer_compute(n: dict[str, Any], gpu: Accelerator, *, recompute: str, dtype: str,
                        flash_attention: bool, gemm_efficiency: float, attention_efficiency: float,
                        clock: float = 1.0, moe_imbalance: float = 1.0, fp8_recipe: str = "current",
                        expert_loop: bool = True, stage: dict[str, Any] | None = None,
                        bf16_layers: Any = 0) -> dict[str, Any]:
    """Seconds per step on one GPU of the weight GEMMs (``gemm``) and of attention
    (``attention``) for the layouts ``n`` (:func:`dtlib.analytic.vectorised.layout_arrays`).

    Per micro-batch, each GPU runs ``layers / pp`` layers (stages balanced) and ``1 / pp`` of the
    LM head (spread as Narayanan et al. 2021 eq. 3 counts it); full recompute repeats the layers'
    forward, selective recompute the attention core (Korthikanti et al. 2022, Sec. 5). Weight GEMMs
    run in ``dtype`` (fp8 at the FP8 peak, nvfp4 at the FP4 peak: module docstring), except in
    ``bf16_layers`` of the layers (Megatron's ``--first-last-layers-bf16``: their share of every
    layer); attention and the LM head stay in bf16 (Transformer Engine keeps dot-product attention
    and, by default, the output layer in BF16). In an MoE layer
    the MLP is the local experts' grouped GEMM, ``experts / ep`` GEMMs of the rows each receives
    (:func:`dtlib.plan.moe.expert_rows` / local experts: small per-expert M pays tile quantization),
    FFN width ``moe_ffn / etp``, x ``moe_imbalance`` on the busiest rank when dropless, plus the
    per-expert cost of the kernels launched for each expert when the stack loops over them
    (``expert_loop``; their number depends on ``fp8_recipe`` when ``dtype`` is fp8, and on nvfp4:
    :func:`dtlib.plan.moe.grouped_gemm_overhead`); plus the shared experts and the router. A
    fraction ``moe_layers / layers`` of the layers is MoE. ``stage``: one pipeline rank's ``layers``
    and ``moe_layers`` and its share of the LM ``head`` (0 or 1) instead of the balanced share
    (``layers / pp`` of the model's mix, ``1 / pp`` of the head). Also returned, per step: one
    ``dense_layer``'s and one ``moe_layer``'s weight GEMMs, the ``head``'s and one layer's
    ``attention_layer`` (:func:`dtlib.plan.stages.slowest_stage` sums them per rank)."""
    validate.one_of("recompute", recompute, ("none", "selective", "full"))
    validate.array("attention_efficiency", attention_efficiency, maximum=1)  # or one per layout
    tp, pp, cp, ep = n["tp"], n["pp"], n["cp"], n["ep"]
    b, m, s, h = n["micro_batch_size"], n["num_microbatches"], n["seq"], n["hidden"]
    heads, ffn, vocab = n["heads"], n["ffn"], n["vocab"]
    experts = n["experts"]
    tokens = b * s / cp  # rows of every GEMM on a rank (SP gathers the sequence before them)
    bf16_kw = dict(gpu=gpu, dtype="bf16", efficiency=gemm_efficiency, clock=clock)
    moe = moe_numbers(n)
    local_experts = np.where(moe["moe"], experts / ep, 1)
    rows = expert_rows(tokens, tp, moe, expert_load(moe, moe_imbalance)) / local_experts
    # LoRA: the weight GEMMs' weights are frozen (no dW), the adapters' (BF16) are not (adapter_gemms)
    lora = np.any(np.asarray(n.get("lora_rank", 0)) > 0)
    frozen = {"frozen": (np.asarray(n.get("lora_rank", 0)) > 0) * 1.0} if lora else {}
    router = _fwd_bwd(tokens / tp, np.maximum(experts, 1), h, moe["moe"] * 1.0, **bf16_kw, **frozen)
    head = _fwd_bwd(tokens, vocab / tp, h, 1, **bf16_kw, **frozen)
    adapters = (adapter_gemms(n, tokens, rows, local_experts, dict(bf16_kw, bytes_per_element=OPERAND_BYTES["bf16"]))
                if lora else {False: (0, 0), True: (0, 0)})
    full, selective = recompute == "full", recompute == "selective"

    def linear_layers(precision: str) -> dict[str, Any]:
        """Weight GEMMs of one dense and one MoE layer, one micro-batch, in ``precision`` (Shoeybi et
        al. 2019, Sec. 3), with the casts of their inputs, weights and output gradients (see above)."""
        kw = dict(gpu=gpu, dtype=precision, efficiency=gemm_efficiency, clock=clock,
                  bytes_per_element=OPERAND_BYTES[precision], **frozen)
        attn = attention_projections(n, tokens, **kw)
        dense_mlp = _mlp(tokens, ffn / tp, h, n["mlp_matrices"], 1, kw)
        # MoE layers (dtlib.plan.moe): a grouped GEMM of the local experts, the always-active shared
        # experts (a dense MLP split over tp, Megatron-Core SharedExpertMLP) and the router (BF16)
        grouped = _mlp(rows, moe["moe_ffn"] / moe["etp"], h, n["mlp_matrices"], local_experts, kw)
        # plus what a per-expert loop spends per expert and launch (dtlib.plan.moe.grouped_gemm_overhead)
        launches = {"fp8": fp8_recipe, "nvfp4": "nvfp4"}.get(precision, "bf16")
        overhead = grouped_gemm_overhead(local_experts, moe, launches, expert_loop)
        grouped = (grouped[0] + overhead[0], grouped[1] + overhead[1], grouped[2])
        shared = _mlp(tokens, moe["shared_experts"] * moe["moe_ffn"] / tp, h, n["mlp_matrices"],
                      (moe["shared_experts"] > 0) * 1.0, kw)
        cast = CAST_BYTES[precision] / gpu.memory_bandwidth
        out = {}
        for key, share in (("dense", 0), ("moe", 1)):
            forward = (attn["forward"] + (1 - share) * dense_mlp[0] + share * (grouped[0] + shared[0] + router[0])
                       + adapters[bool(share)][0])
            backward = (attn["backward"] + (1 - share) * dense_mlp[1] + share * (grouped[1] + shared[1] + router[1])
                        + adapters[bool(share)][1])
            elements = (attn["inputs"] + attn["outputs"] + attn["weights"] + (1 - share) * dense_mlp[2]
                        + share * (grouped[2] + shared[2]))
            out[key] = (1 + full) * forward + backward + cast * elements
        return out

    # the bf16_layers Megatron keeps in BF16, spread over the stages as a share of every layer (exact at pp 1)
    linear = linear_layers(dtype)
    bf16_share = np.minimum(np.asarray(bf16_layers) / n["layers"], 1) * (dtype != "bf16")
    if np.any(bf16_share > 0):
        kept = linear_layers("bf16")
        linear = {k: (1 - bf16_share) * linear[k] + bf16_share * kept[k] for k in linear}

    # ---- attention core of one layer, one micro-batch ---------------------------------------------
    qk_dim = n.get("head_dim", h // heads)
    v_dim = np.where(n.get("v_head_dim", 0) > 0, n.get("v_head_dim", 0), qk_dim)
    if flash_attention:
        # causal: FlashAttention skips the tiles above the diagonal (half of 4 b s_q s h / tp) and,
        # with a sliding window, the tiles outside the band; packed sequences: the varlen kernel runs
        # each document alone, L in place of s (dtlib.analytic.flops.keys_per_query)
        per_token = attention_flops_per_token(s, h, n["layers"], "causal", heads=heads, head_dim=qk_dim,
                                              v_head_dim=v_dim, sliding_window=n.get("sliding_window", 0),
                                              sliding_layers=n.get("sliding_layers", 0),
                                              packed_doc_length=n.get("packed_doc_length", 0)) / n["layers"]
        work = b * (s / cp) * per_token / tp
        # softmax: one exponential per score forward, one again backward (P recomputed from the saved
        # log-sum-exp, Dao 2023, Sec. 3.1.2), on the special-function units beside the tensor cores
        # (FLOPS_PER_EXP in dtlib.analytic.hardware); counted after the matmuls, not hidden behind them
        exps = work / (2 * (qk_dim + v_dim))
        exp_time = 0 * exps if gpu.exp_rate is None else exps / (gpu.exp_rate * clock)
        matmul = work / (gpu.peak("bf16") * clock)
        attn_fwd = (matmul + exp_time) / attention_efficiency
        attn_bwd = (FLASH_BACKWARD * matmul + exp_time) / attention_efficiency
    else:  # batched GEMMs per head: Q K^T (s x s over d), A V (s x d over s), all of s x s computed
        # (an explicit mask, sliding, causal or a packed sequence's block-diagonal one, does not skip work)
        per_head = b * heads / tp
        scores = _fwd_bwd(s / cp, s, qk_dim, per_head, **bf16_kw)
        context = _fwd_bwd(s / cp, v_dim, s, per_head, **bf16_kw)
        attn_fwd, attn_bwd = scores[0] + context[0], scores[1] + context[1]

    per_layer = {"dense_layer": m * linear["dense"], "moe_layer": m * linear["moe"], "head": m * (head[0] + head[1]),
                 "attention_layer": m * ((1 + full + selective) * attn_fwd + attn_bwd)}
    per_layer = {k: np.asarray(v, float) for k, v in per_layer.items()}
    if stage is None:  # balanced: layers / pp of the model's mix, 1 / pp of the head
        stage = {"layers": n["layers"] / pp, "moe_layers": moe["moe_share"] * n["layers"] / pp, "head": 1 / pp}
    gemm = ((stage["layers"] - stage["moe_layers"]) * per_layer["dense_layer"]
            + stage["moe_layers"] * per_layer["moe_layer"] + stage["head"] * per_layer["head"])
    attention = stage["layers"] * per_layer["attention_layer"]
    return {"gemm": np.asarray(gemm, float), "attention": np.asarray(attention, float), **per_layer}
