"""Time of one training step of a layout on a cluster, as a breakdown that sums to the step time.

Every term is a function of numpy arrays (one entry per layout), so the search
(:mod:`dtlib.plan.search`) times thousands of layouts in one call; :func:`step_time` is the same
code on one layout. The terms and their sources are in :data:`TERMS`. Rank placement follows
Megatron-LM's default order ``tp-cp-ep-dp-pp`` (``parallel_state.initialize_model_parallel``,
tensor ranks adjacent): a group lies inside one node while the product of the sizes up to it is at
most ``gpus_per_node``, otherwise its collectives cross the inter-node fabric, at the NIC
bandwidth per GPU divided by the fabric's oversubscription. Expert parallelism has its own grid on
the same ranks, ``etp-ep-edp`` (Megatron-Core's MoE parallel folding, :mod:`dtlib.plan.moe`).
A "node" is an NVLink domain: 8 GPUs on a DGX/HGX board, 72 on a GB200/GB300 NVL72 rack, where
whole groups are assumed packed into each domain (as SLURM's block scheduling places a job's 64-GPU segments).

The pipelined terms are the slowest pipeline rank's (:mod:`dtlib.plan.stages`: its own layers, MoE
layers and, on the last rank, the LM head; with ``efficiency`` given, Narayanan et al. 2021 eq. 3's
flat compute over all GPUs, the other terms on the rank with the most layers). Compute is timed from the GEMM shapes after TP/CP splitting
(:mod:`dtlib.plan.gemm`); the two kernel efficiencies it needs are global fitted numbers
(:mod:`dtlib.plan.calibration`).

About 630 lines, over the usual 400: every term is computed in one vectorised pass over the search's
grid of layouts and they share its intermediate arrays (the slowest stage, bytes per parameter, the
links); the terms' own physics lives in :mod:`~dtlib.plan.gemm`, :mod:`~dtlib.plan.launches`,
:mod:`~dtlib.plan.moe`, :mod:`~dtlib.plan.vocab_parallel`, :mod:`~dtlib.plan.zero3`,
:mod:`~dtlib.analytic.comm`, leaving here the options and their sum.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.activations import mean_layer_bytes
from dtlib.analytic.comm import bubble_fraction, collective_time, cp_kv_bytes, nccl_latency, nccl_time
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.finetune import FineTuning, adapter_params, check_targets, resolve_finetune
from dtlib.analytic.flops import (ATTENTION, PACKED_FLOPS, attention_flops_per_token, check_packed,
                                  layers_matmul_params, recompute_flops_per_token, step_flops)
from dtlib.analytic.hardware import MATMUL_DTYPES, Cluster, Link, matmul_peak
from dtlib.analytic.layout import Parallelism, chunks_per_rank
from dtlib.analytic.memory import memory_options, stage_parameters
from dtlib.analytic.pipeline_layout import layout_numbers
from dtlib.analytic.precision import GRAD_REDUCE_DTYPES, Precision, get_precision, with_grad_reduce
from dtlib.analytic.presets import Training, activation_convention
from dtlib.analytic.vectorised import layout_arrays
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY
from dtlib.plan.eager import PASSES, eager_forward_bytes
from dtlib.plan.gemm import clock_scale, transformer_compute
from dtlib.plan.launches import launch_time
from dtlib.plan.recompute import recompute_module_work
from dtlib.plan.terms import TERMS
from dtlib.plan.vocab_parallel import CROSS_ENTROPY_ALL_REDUCES, vocab_parallel_collectives
from dtlib.plan.zero3 import unit_copy_bytes
from dtlib.plan.stages import slowest_stage
from dtlib.plan.moe import (check_imbalance, ep_comm_time, expert_grid, expert_load, moe_numbers,
                            permutation_bytes)
from dtlib.analytic.stacks import DEFAULT_STACK, FP8_RECIPES, MOE_DISPATCHERS, get_stack

__all__ = ["TERMS", "DTYPES", "StepOptions", "StepTime", "step_time_arrays", "step_time", "resolve",
           "memory_kwargs", "with_finetune", "with_packing"]

DTYPES = tuple(MATMUL_DTYPES)  # bf16, fp8, nvfp4


@dataclass(frozen=True)
class StepOptions:
    """The conventions of the step-time model; every one is an option.

    ``stack``: the software stack (:data:`dtlib.analytic.stacks.STACKS`, default
    :data:`~dtlib.analytic.stacks.DEFAULT_STACK`); every field left None takes that stack's value, an
    explicit value overrides it: ``dp_overlap`` / ``tp_overlap`` / ``cp_overlap`` (fraction of
    that communication hidden behind compute), ``fused_elementwise`` (memory-bound operators
    fused, as Megatron/TE or torch.compile run them, or eager one kernel each: their traffic from
    :mod:`dtlib.plan.eager`), ``precision`` (bytes per parameter: memory, gradient and optimizer
    traffic), ``fp8_recipe`` (:data:`dtlib.analytic.stacks.FP8_RECIPES`: the kernels launched per
    local expert with FP8, :data:`dtlib.plan.moe.EXPERT_LAUNCHES`; a stack without a recipe of its
    own is taken as current scaling), ``moe_dispatcher`` (:data:`dtlib.analytic.stacks.MOE_DISPATCHERS`:
    whether the router probabilities cross the EP group in an all-to-all of their own, Megatron-Core's
    alltoall dispatcher, or not, its flex dispatcher and the other stacks; :func:`dtlib.plan.moe.ep_comm_time`),
    ``grad_reduce_dtype`` (:data:`~dtlib.analytic.precision.GRAD_REDUCE_DTYPES`:
    the dtype the data-parallel gradients are kept and reduced in, which sets ``precision``'s gradient
    bytes; None: the precision's own, the stack's by default) and ``attention_efficiency`` (None: the fitted :data:`~dtlib.plan.calibration.ATTENTION_EFFICIENCY`
    x the stack's attention kernel relative to FlashAttention-3, :meth:`~dtlib.analytic.stacks.Stack.attention_scale`).

    ``dtype``: compute precision of the linear layers' matmuls (``bf16``, ``fp8`` or ``nvfp4``: NVIDIA's
    NVFP4 recipe at the FP4 peak, :mod:`dtlib.plan.gemm`); ``bf16_layers``: transformer layers kept in BF16
    with fp8 or nvfp4 (Megatron-LM ``--first-last-layers-bf16`` with ``--num-layers-at-start-in-bf16`` +
    ``--num-layers-at-end-in-bf16``; default 0, Megatron's and Megatron-Bridge's performance recipes'; the
    NVFP4 paper keeps about 15%, Sec. 4.1); ``gemm_efficiency``: the
    GEMM kernel efficiency (None: fitted); ``power_limit_w``: the GPUs' power cap (None: their
    TDP; :func:`dtlib.plan.gemm.clock_scale`); ``efficiency``: if set, compute is the flat hardware
    FLOPs / (peak x efficiency) instead of the shape-aware model; ``oversubscription``: the
    fabric's over the leaf. ``convention`` / ``flash_attention``: how activations are counted
    (:func:`dtlib.analytic.presets.activation_convention`: default ``today``, FlashAttention-style
    attention that never writes the s x s scores to HBM; ``korthikanti-2022`` or
    ``flash_attention=False``: explicit attention, as 2021-22 Megatron-LM's fused softmax).
    ``ep_overlap``: fraction of the EP all-to-all hidden behind the MoE layers' compute, and never
    more than that compute (DeepSeek-V3's DualPipe, Megatron's ``--overlap-moe-expert-parallel-comm``;
    default 0: exposed, Megatron's default);
    ``moe_imbalance``: the busiest expert's tokens over the mean (>= 1; 1: balanced routing),
    scaling the expert GEMMs and the all-to-all of dropless MoE (:mod:`dtlib.plan.moe`);
    ``forward_kernels``: the kernels one layer launches forward, where counted on the model itself
    (``dtlib calibrate`` counts ``dtlib train``'s TinyGPT's; None: :data:`dtlib.plan.launches.FORWARD_KERNELS`);
    ``packed_flops`` (:data:`dtlib.analytic.flops.PACKED_FLOPS`): with packed sequences (the workload's
    ``packed_doc_length``), whether the model FLOPs and MFU count attention within the documents or over
    the whole sequence (default, as Megatron-LM and torchtitan log it; the time counts the documents').
    ``cross_entropy_all_reduces``: the vocabulary-parallel loss's all-reduces under TP (3: Megatron-Core's
    ``vocab_parallel_cross_entropy``, the default; 2: its ``--cross-entropy-loss-fusion`` and
    :func:`dtlib.parallel.tensor.vocab_parallel_cross_entropy`; :mod:`dtlib.plan.vocab_parallel`).

    How gradients are handled, where eager PyTorch differs from Megatron-Core (the defaults):
    ``grad_accumulation_fusion`` (default True: the weight-gradient GEMMs accumulate into the
    gradient buffer, Megatron-LM ``--gradient-accumulation-fusion``; False: every micro-batch after
    the first adds its gradients to ``.grad`` in a pass of its own, autograd's ``AccumulateGrad``:
    two read, one written); ``grad_bucket_copy`` (default False: reduced in place in the contiguous
    gradient buffer, Megatron-Core's ``DistributedDataParallel``; True: copied into a flat bucket,
    divided and copied back, PyTorch DDP's default ``gradient_as_bucket_view=False`` and ``dtlib
    train``'s ``all_reduce_coalesced``: six passes over the gradients); ``zero3_reduce_per_microbatch``
    (default False: ZeRO-3 reduce-scatters the accumulated gradients once per step; True: after every
    micro-batch's backward, PyTorch FSDP without ``no_sync`` and ``dtlib.parallel.FSDP``; the gradients of
    later micro-batches are then added into the owned shards, not the whole gradients); ``zero3_unit_copies``
    (default False: ZeRO-3 gathers into the buffer the parameters view and reduce-scatters from the one the
    gradients accumulate in, Megatron-Core's FSDP; True: ``dtlib.parallel.FSDP``'s copies, each gather's output
    copied out param-major, two passes over the weights, and before each reduce-scatter the gradients
    concatenated from the parameters' views, copied rank-major and divided, six passes: :mod:`dtlib.plan.zero3`);
    ``zero3_kernels``: the operators ``dtlib.parallel.FSDP`` adds to each layer per micro-batch under ZeRO-3
    (its bookkeeping around the collectives, counted by ``dtlib calibrate`` on ``dtlib train``'s TinyGPT), each
    at the device's kernel cost in the ``launch`` term (None: none, as a GPU implementation's few per layer).
    The passes run at the device's :attr:`~dtlib.analytic.hardware.Accelerator.optimizer_bandwidth`, the rate of
    plain passes over parameter-sized tensors.
    """
    stack: str = DEFAULT_STACK
    dtype: str = "bf16"
    efficiency: float | None = None
    precision: "Precision | str | None" = None
    attention: str = "full"
    packed_flops: str = "sequence"
    dp_overlap: float | None = None
    tp_overlap: float | None = None
    cp_overlap: float | None = None
    oversubscription: float = 1.0
    flash_attention: bool | None = None
    convention: str | None = None
    gemm_efficiency: float | None = None
    attention_efficiency: float | None = None
    power_limit_w: float | None = None
    fused_elementwise: bool | None = None
    fp8_recipe: str | None = None
    moe_dispatcher: str | None = None
    ep_overlap: float = 0.0
    moe_imbalance: float = 1.0
    bf16_layers: int = 0
    grad_reduce_dtype: str | None = None
    forward_kernels: int | None = None
    grad_accumulation_fusion: bool = True
    grad_bucket_copy: bool = False
    zero3_reduce_per_microbatch: bool = False
    zero3_unit_copies: bool = False
    zero3_kernels: int | None = None
    cross_entropy_all_reduces: int = 3

    def __post_init__(self) -> None:
        get_stack(self.stack)
        for name in ("forward_kernels", "zero3_kernels"):
            if getattr(self, name) is not None:
                validate.integer(name, getattr(self, name))
        for name in ("grad_accumulation_fusion", "grad_bucket_copy", "zero3_reduce_per_microbatch",
                     "zero3_unit_copies"):
            validate.boolean(name, getattr(self, name))
        validate.one_of("dtype", self.dtype, DTYPES)
        validate.one_of("cross_entropy_all_reduces", self.cross_entropy_all_reduces, CROSS_ENTROPY_ALL_REDUCES)
        validate.integer("bf16_layers", self.bf16_layers, minimum=0)
        validate.one_of("attention", self.attention, ATTENTION)
        validate.one_of("packed_flops", self.packed_flops, PACKED_FLOPS)
        for name in ("efficiency", "gemm_efficiency", "attention_efficiency"):
            if getattr(self, name) is not None:  # a fraction of peak (kernel ones: or an array of them,
                validate.array(name, getattr(self, name), maximum=1)  # one per layout: validation's grid)
        if self.power_limit_w is not None:
            validate.number("power_limit_w", self.power_limit_w)
        if self.fused_elementwise is not None:
            validate.boolean("fused_elementwise", self.fused_elementwise)
        for name in ("dp_overlap", "tp_overlap", "cp_overlap"):
            if getattr(self, name) is not None:
                validate.number(name, getattr(self, name), minimum=0, exclusive=False, maximum=1)
        validate.number("oversubscription", self.oversubscription, minimum=1, exclusive=False)
        validate.number("ep_overlap", self.ep_overlap, minimum=0, exclusive=False, maximum=1)
        validate.number("moe_imbalance", self.moe_imbalance, minimum=1, exclusive=False)
        if self.precision is not None:
            get_precision(self.precision)
        if self.grad_reduce_dtype is not None:
            validate.one_of("grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        if self.fp8_recipe is not None:
            validate.one_of("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        if self.moe_dispatcher is not None:
            validate.one_of("moe_dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)
        activation_convention(self.convention, self.flash_attention)


def resolve(options: StepOptions, dropout: bool | None = None) -> tuple[StepOptions, bool]:
    """``options`` with the fields left None filled in from its stack and activation convention
    (``dp_overlap`` stays None when the stack's depends on the ZeRO stage, and
    ``attention_efficiency`` when it depends on the GPU: :func:`step_time_arrays` fills them), and
    ``dropout`` (None: the convention's)."""
    stack = get_stack(options.stack)
    counted, _ = activation_convention(options.convention, options.flash_attention, dropout)
    same_dp = stack.dp_overlap == stack.dp_overlap_zero3
    filled = {"precision": stack.precision, "fp8_recipe": stack.fp8_recipe, "moe_dispatcher": stack.moe_dispatcher,
              "tp_overlap": stack.tp_overlap, "cp_overlap": stack.cp_overlap,
              "fused_elementwise": stack.fused_elementwise, "flash_attention": counted.flash_attention,
              "dp_overlap": stack.dp_overlap if same_dp else None}
    options = replace(options, **{k: v for k, v in filled.items() if getattr(options, k) is None})
    if options.grad_reduce_dtype is not None:  # the gradient buffer's dtype is the reduce dtype (Megatron-Core DDP)
        options = replace(options, precision=with_grad_reduce(options.precision, options.grad_reduce_dtype))
    return options, counted.dropout


def memory_kwargs(options: StepOptions, dropout: bool) -> dict[str, bool]:
    """The activation conventions :func:`dtlib.analytic.memory.per_gpu_bytes` needs for resolved
    ``options``: what ``dtlib plan`` counts is what ``dtlib memory`` counts."""
    counted = Training(flash_attention=bool(options.flash_attention), dropout=dropout, source="")
    return memory_options(counted, get_stack(options.stack), options.dtype)


def with_finetune(n: dict[str, Any], finetune: FineTuning | None, model: TransformerConfig) -> dict[str, Any]:
    """The layouts ``n`` with ``finetune``'s numbers (:meth:`~dtlib.analytic.finetune.FineTuning.numbers`)
    as arrays of their length, its targets checked against ``model``."""
    finetune = resolve_finetune(finetune)
    check_targets(finetune, model.numbers())
    rows = np.shape(n["dp"])
    return dict(n, **{k: np.full(rows, v) for k, v in finetune.numbers().items()})


def with_packing(n: dict[str, Any], packed_doc_length: int | None) -> dict[str, Any]:
    """The layouts ``n`` with sequences packed from documents of ``packed_doc_length`` tokens (1..seq;
    None: not packed), attention within each document (:func:`dtlib.analytic.flops.keys_per_query`)."""
    if packed_doc_length is None:
        return n
    return dict(n, packed_doc_length=np.full(np.shape(n["dp"]), check_packed(packed_doc_length, n["seq"])))


def _inter_link(cluster: Cluster, oversubscription: float) -> Link:
    """One GPU's share of the node's NICs, divided by the fabric's oversubscription."""
    inter = cluster.inter
    return replace(inter, bandwidth=cluster.inter_bandwidth_per_gpu / oversubscription,
                   source=inter.source + f"; shared by the node's GPUs; / oversubscription {oversubscription:g}")


def _on(inside: Any, op: str, nbytes: Any, ranks: Any, intra: Link, inter: Link) -> Any:
    """Ring time of ``op`` on the intra-node link where ``inside``, else across nodes."""
    return np.where(inside, collective_time(op, nbytes, ranks, intra), collective_time(op, nbytes, ranks, inter))


def _buckets(params: Any, ranks: Any, zero: Any, layers: Any) -> Any:
    """Calls of each DP collective per step: ZeRO 0-2 reduce gradients in buckets of
    max(40M, 1M x dp) parameters (Megatron-Core ``DistributedDataParallel``'s default
    ``bucket_size``, so that each ring call stays bandwidth-bound); ZeRO-3 gathers and reduces one
    transformer layer at a time (PyTorch FSDP2 / torchtitan ``fully_shard`` per block)."""
    bucket = np.maximum(40e6, 1e6 * ranks)
    return np.where(zero == 3, np.maximum(layers, 1), np.maximum(np.ceil(params / bucket), 1))


def _hierarchical(op: str, nbytes: Any, ranks: Any, local: Any, intra: Link, inter: Link, calls: Any = 1) -> Any:
    """Two-level collective over ``ranks`` of which ``local`` share a node, in ``calls`` buckets:
    intra-node reduce-scatter, inter-node ``op`` of S/local, intra-node all-gather, each call
    paying NCCL's latency, NCCL's faster of ring and tree (:func:`dtlib.analytic.comm.nccl_time`)."""
    return nccl_time(op, nbytes, ranks, local, intra, inter, calls)["best"]


def step_time_arrays(n: dict[str, Any], cluster: Cluster, *, recompute: str = "none",
                     schedule: str = "1f1b", options: StepOptions = StepOptions(),
                     dropout: bool = False, recompute_layers: int | None = None,
                     recompute_modules: tuple[str, ...] = (),
                     account_for_embedding_and_loss: bool = False) -> dict[str, Any]:
    """The breakdown for every layout in ``n`` (numbers as :func:`dtlib.analytic.vectorised.layout_arrays`
    returns them); ``dropout``: the model keeps dropout masks (as the memory model); ``options``
    are filled from their stack (:func:`resolve`). Returns each term of :data:`TERMS` (seconds),
    ``step_time`` (their sum), ``model_flops``, ``hardware_flops`` and ``tokens`` per step,
    ``gpus``, ``params_per_gpu``.

    ``recompute_layers`` (:class:`~dtlib.analytic.layout.Parallelism`): that share of each
    chunk's layers costs what full recompute costs and the rest what ``recompute`` costs, term by
    term (the layers are alike, so each term is that mix; only the exposed DP time, a maximum, is
    mixed after the fact). ``recompute="op"`` (torchtitan's per-op checkpointing) repeats the
    forward of the weight GEMMs it does not save (every second one: wk, wo and w3 of a Llama
    block, :func:`dtlib.analytic.activations.op_selective_bytes`) and their share of the
    elementwise traffic and TP communication, but not attention (its output is saved). ``recompute_modules``
    (Megatron-Core's per-module recompute) repeat their modules' forward
    (:func:`dtlib.plan.recompute.recompute_module_work`) in every layer ``recompute_layers`` leaves stored."""
    options, _ = resolve(options)
    if np.any(options.bf16_layers > np.asarray(n["layers"])):
        raise validate.InvalidArgument("bf16_layers", f"at most the model's {int(np.min(n['layers']))} layers",
                                       options.bf16_layers)
    balanced = account_for_embedding_and_loss
    if recompute == "op":
        h, kv_dim, f = n["hidden"], n["kv_heads"] * (n["hidden"] // n["heads"]), n["ffn"]
        recomputed = h * kv_dim + h * h + h * f   # wk, wo, and w3 (SwiGLU) or fc2 (GELU)
        share = recomputed * n["layers"] / layers_matmul_params(**n)  # of a mean layer's weights
        return _mixed(_terms(n, cluster, "none", schedule, options, dropout, balanced),
                      _terms(n, cluster, "full", schedule, options, dropout, balanced), share, 0 * share)
    plain = _terms(n, cluster, recompute, schedule, options, dropout, balanced)
    out, kept = plain, 1.0
    if recompute_layers:
        per_chunk = n["layers"] / (n["pp"] * chunks_per_rank(schedule, n["virtual_stages"]))
        share = np.minimum(recompute_layers, per_chunk) / per_chunk
        out = _mixed(plain, _terms(n, cluster, "full", schedule, options, dropout, balanced), share, share)
        kept = 1 - share
    if recompute_modules:  # in the layers recompute_layers leaves stored
        out = _with_modules(out, plain, n, cluster, schedule, options, dropout, recompute_modules, kept, balanced)
    return out


def _with_modules(base: dict[str, Any], plain: dict[str, Any], n: dict[str, Any], cluster: Cluster, schedule: str,
                  options: StepOptions, dropout: bool, modules: tuple[str, ...], kept: Any,
                  balanced: bool = False) -> dict[str, Any]:
    """``base`` plus the forward work ``modules`` repeat in backward in the ``kept`` share of the
    layers (those not fully recomputed): FLOPs at the weight GEMMs' peak and efficiency, bytes at the
    HBM bandwidth, per layer of the stage and micro-batch, in the pipelined work the bubble scales;
    ``plain``: the terms without any recompute of layers, against which ``core_attn`` is timed."""
    prec = get_precision(options.precision)
    work = recompute_module_work(modules, n, prec.activation, dropout, bool(options.flash_attention))
    gpu = cluster.gpu
    per_step = kept * plain["stage_layers"] * n["num_microbatches"]
    efficiency = GEMM_EFFICIENCY if options.gemm_efficiency is None else options.gemm_efficiency
    peak = matmul_peak(gpu, options.dtype) * clock_scale(gpu, options.power_limit_w)
    flops_time = work["flops"] / (peak * efficiency)
    extra = per_step * (flops_time + work["bytes"] / gpu.memory_bandwidth)
    # core_attn with explicit attention: the attention core again, as selective recompute repeats it
    attention = 0 * extra
    if np.any(work["attention"]):
        selective = _terms(n, cluster, "selective", schedule, options, dropout, balanced)
        attention = kept * work["attention"] * (selective["compute_attention"] - plain["compute_attention"])
    pipelined = extra + attention
    out = dict(base)
    out["compute_gemm"] = base["compute_gemm"] + per_step * flops_time
    out["compute_attention"] = base["compute_attention"] + attention
    out["compute"] = out["compute_gemm"] + out["compute_attention"]
    out["elementwise"] = base["elementwise"] + per_step * work["bytes"] / gpu.memory_bandwidth
    out["pp_bubble"] = base["pp_bubble"] + base["bubble_fraction"] * pipelined  # at the layout's own bubble
    ranks_per_stage = n["dp"] * n["tp"] * n["cp"]
    out["hardware_flops"] = base["hardware_flops"] + kept * work["flops"] * n["layers"] * n["num_microbatches"] * ranks_per_stage
    out["step_time"] = sum(out[k] for k in TERMS)
    return out


def _mixed(base: dict[str, Any], full: dict[str, Any], share: Any, attention_share: Any) -> dict[str, Any]:
    """``base`` with ``share`` of the way to ``full`` (the attention compute: ``attention_share``)."""
    out = dict(base)
    for k in ("elementwise", "launch", "pp_bubble", "tp_comm", "cp_comm", "ep_comm", "pp_p2p", "dp_comm", "optimizer",
              "hardware_flops", "dp_comm_unhidden", "compute_gemm", "bubble_fraction"):
        out[k] = base[k] + share * (full[k] - base[k])
    out["compute_attention"] = base["compute_attention"] + attention_share * (
        full["compute_attention"] - base["compute_attention"])
    out["compute"] = out["compute_gemm"] + out["compute_attention"]
    out["step_time"] = sum(out[k] for k in TERMS)
    return out


def _terms(n: dict[str, Any], cluster: Cluster, recompute: str, schedule: str, options: StepOptions,
           dropout: bool, balanced: bool = False) -> dict[str, Any]:
    """:func:`step_time_arrays` for one recompute setting (``none``, ``selective`` or ``full``)."""
    stack = get_stack(options.stack)
    gpu, g = cluster.gpu, cluster.gpus_per_node
    prec = get_precision(options.precision)
    dp, tp, pp, cp, ep = n["dp"], n["tp"], n["pp"], n["cp"], n["ep"]
    v = chunks_per_rank(schedule, n["virtual_stages"])
    b, m, s, h = n["micro_batch_size"], n["num_microbatches"], n["seq"], n["hidden"]
    gpus = dp * tp * pp * cp
    tokens = dp * b * m * s
    full = recompute == "full"

    # ---- compute: hardware FLOPs split by the precision they run in -------------------------
    # the model's numbers as they are (MoE, MLA, sliding-window keys included: dtlib.analytic.flops)
    flops = step_flops(tokens, recompute=recompute, attention=options.attention, packed_flops=options.packed_flops, **n)
    weights = 2 * layers_matmul_params(**n)
    attn = attention_flops_per_token(attention=options.attention, **n)
    # LoRA (dtlib.analytic.finetune): adapter GEMMs, and no weight gradients of the frozen weights
    lora, adapters = np.asarray(n.get("lora_rank", 0)) > 0, 2 * adapter_params(n, active=True)
    extra = recompute_flops_per_token(recompute, weights + adapters + attn, attn)
    weight_hw = tokens * ((3 - lora) * weights + 3 * adapters + extra - (recompute != "none") * attn)
    if options.efficiency is not None:  # the flat convention: one fraction of peak for everything
        peak_bf16, peak_weights = gpu.peak("bf16"), matmul_peak(gpu, options.dtype)
        kept = np.minimum(options.bf16_layers / n["layers"], 1) * (options.dtype != "bf16")  # BF16 layers
        weight_time = weight_hw * ((1 - kept) / peak_weights + kept / peak_bf16)
        compute = (weight_time + (flops["hardware"] - weight_hw) / peak_bf16) / (gpus * options.efficiency)
        parts = {"gemm": compute, "attention": 0 * compute}
        # the per-layer terms below: the rank with the most layers
        stage = slowest_stage(n, {"dense_layer": 1, "moe_layer": 1, "head": 0, "attention_layer": 0}, balanced,
                              schedule)
    else:  # shape-aware: GEMMs from their shapes, attention from FlashAttention (dtlib.plan.gemm),
        # on the slowest pipeline rank (dtlib.plan.stages)
        stage = slowest_stage(n, transformer_compute(
            n, gpu, recompute=recompute, dtype=options.dtype, flash_attention=options.flash_attention,
            gemm_efficiency=GEMM_EFFICIENCY if options.gemm_efficiency is None else options.gemm_efficiency,
            attention_efficiency=(ATTENTION_EFFICIENCY * stack.attention_scale(gpu)
                                  if options.attention_efficiency is None else options.attention_efficiency),
            clock=clock_scale(gpu, options.power_limit_w), moe_imbalance=options.moe_imbalance,
            fp8_recipe=options.fp8_recipe or "current", expert_loop=stack.expert_loop,
            bf16_layers=options.bf16_layers), balanced, schedule)
        parts = {"gemm": stage["gemm"], "attention": stage["attention"]}
        compute = parts["gemm"] + parts["attention"]

    # ---- model-parallel communication, per layer and micro-batch ---------------------------
    intra, inter = cluster.intra, _inter_link(cluster, options.oversubscription)
    layers_here, moe_here = stage["layers"], stage["moe_layers"]
    act = b * (s / cp) * h * prec.activation
    moe = moe_numbers(n)
    # attention's 2 collectives and the MLP's 2, but an MoE layer's routed experts take their
    # tokens through the EP dispatcher instead (ep_comm); shared experts gather over tp as a dense
    # MLP does (Megatron-Core SharedExpertMLP)
    blocks = 2 * layers_here - moe_here * (moe["shared_experts"] == 0)
    tp_calls = (2 + full) * blocks * m
    tp_raw = tp_calls * _on(tp <= g, "all_reduce", act, tp, intra, inter)
    # each block's backward input-gradient reduce-scatter (half of its backward all-reduce): an overlap
    # that fuses a collective only with the one GEMM beside it cannot hide it where the gradient is a
    # sum of GEMMs (torchtitan's separate wq/wk/wv and w1/w3; Stack.tp_overlap_input_grads)
    input_grads = (not stack.tp_overlap_input_grads) * blocks * m * _on(
        tp <= g, "reduce_scatter", act, tp, intra, inter)
    # outside the layers (dtlib.plan.vocab_parallel): the embedding's, the output layer's and the loss's,
    # on the stages that hold them; the output layer's beside its own GEMMs, the others beside none
    outside = vocab_parallel_collectives(b * s / cp, h, prec.activation, n["sequence_parallel"],
                                         stage["embedding"], stage["head"], options.cross_entropy_all_reduces)
    head_raw, unhidden = 0 * tp_raw, 0 * tp_raw
    for part, op, nbytes, calls in outside:
        t = m * calls * _on(tp <= g, op, nbytes, tp, intra, inter)
        head_raw, unhidden = (head_raw + t, unhidden) if part == "output_layer" else (head_raw, unhidden + t)
    tp_raw = tp_raw + head_raw
    # overlap (TE userbuffers, async TP) runs each collective beside a GEMM of the same layer: it
    # hides at most the weight GEMMs' time, as ep_overlap below
    tp_comm = tp_raw - options.tp_overlap * np.minimum(tp_raw - input_grads, parts["gemm"]) + unhidden
    # K and V at their real widths (head_dim, GQA groups, MLA's decompressed heads), as dtlib comm counts them
    cp_comm = (1 - options.cp_overlap) * 2 * layers_here * m * _on(
        tp * cp <= g, "all_gather", cp_kv_bytes(n, prec.activation), cp, intra, inter)
    # ---- EP: all-to-all of the routed tokens per MoE layer (dtlib.plan.moe) -----------------
    check_imbalance(moe, options.moe_imbalance)
    load = expert_load(moe, options.moe_imbalance)
    ep_calls = (4 + 2 * full) * moe_here * m
    ep_parts = ep_comm_time(b=b, s=s, h=h, tp=tp, cp=cp, dp=dp, ep=ep, moe=moe, load=load,
                            act_bytes=prec.activation, calls=ep_calls, forwards=(1 + full) * moe_here * m,
                            gpus_per_node=g, intra=intra, inter=inter, kernel_launch_s=gpu.kernel_launch_s,
                            dispatcher=options.moe_dispatcher)
    # overlap hides an all-to-all behind another micro-batch's compute of the same MoE layers (DeepSeek-V3's
    # DualPipe, Sec. 3.2.1; Megatron's --overlap-moe-expert-parallel-comm): never more than that compute; the
    # dispatcher's metadata step and host synchronisation come before the all-to-all it overlaps: exposed
    ep_raw = ep_parts["all_to_all"] + ep_parts["etp"] + ep_parts["probs"]
    ep_comm = (ep_raw - options.ep_overlap * np.minimum(ep_raw, moe_here / np.maximum(layers_here, 1) * compute)
               + ep_parts["metadata"])
    # ---- memory-bound layers: the activation tensors' HBM traffic ---------------------------
    # averaged over the model's dense / MoE and sliding / global layers (dtlib.analytic.activations)
    per_layer = n | dict(dropout=dropout, act_bytes=prec.activation)
    no_scores = mean_layer_bytes(recompute="selective", **per_layer)
    written = no_scores if options.flash_attention else mean_layer_bytes(recompute="none", **per_layer)
    rewritten = {"none": 0 * written, "selective": written - no_scores, "full": written}[recompute]
    elementwise = (3 * written + rewritten) * layers_here * m / gpu.memory_bandwidth
    if not options.fused_elementwise:  # eager PyTorch: one kernel per operator (dtlib.plan.eager)
        per_token = eager_forward_bytes(h, n["kv_heads"] * (h // n["heads"]), n["ffn"], rmsnorm=n["rmsnorm"],
                                        swiglu=n["swiglu"], rope=n["rope"],
                                        kv_repeat=n["kv_heads"] < n["heads"], tp=tp,
                                        sequence_parallel=n["sequence_parallel"])
        elementwise = (PASSES + full) * per_token * b * (s / cp) * layers_here * m / gpu.memory_bandwidth
    # MoE layers: the dispatcher's token permutations (dtlib.plan.moe.permutation_bytes), their forward
    # half repeated by full recompute
    local_experts = np.where(moe["moe"], n["experts"] / ep, 1)
    permuted = permutation_bytes(tokens=b * s / (cp * tp), h=h, moe=moe, load=load, local_experts=local_experts,
                                 act_bytes=prec.activation)
    elementwise = elementwise + (1 + full / 2) * permuted * moe_here * m / gpu.memory_bandwidth
    # the parameters of the pipeline stage with the most
    stages = stage_parameters(schedule=schedule, **n)
    first, last = (stages[k]["dense"] + stages[k]["expert"] for k in ("first", "last"))
    use_last = last > first
    dense, expert, dense_trained, expert_trained = (
        np.where(use_last, stages["last"][k], stages["first"][k]) for k in ("dense", "expert", "adapter", "expert_adapter"))
    # what is trained: every weight, or (LoRA) the adapters only; ZeRO-3 still gathers the frozen weights
    dense_trained, expert_trained = np.where(lora, dense_trained, dense), np.where(lora, expert_trained, expert)
    zero = n["zero"]
    # expert parameters: reduced over the expert-data-parallel group (Megatron-Core's expert grid)
    grid = expert_grid(tp, cp, dp, ep, moe["etp"], g)
    # ZeRO-3 reducing after every micro-batch: the later ones add into the owned shards of the gradients
    # (dtlib.parallel.FSDP's finish, FSDP2 without no_sync), the others into the whole gradients
    sharded = (zero == 3) & options.zero3_reduce_per_microbatch
    if not options.grad_accumulation_fusion:  # AccumulateGrad: micro-batches 2..m add into .grad
        added = dense_trained / np.where(sharded, dp * cp, 1) + expert_trained / np.where(sharded, grid["edp"], 1)
        accumulated = (m - 1) * 3 * added * prec.grad
        elementwise = elementwise + accumulated / gpu.optimizer_bandwidth

    # ---- kernel launches: a fixed cost per kernel, beside its work (dtlib.plan.launches) --------
    launch = launch_time(layers_here, m, options.fused_elementwise, options.dtype, recompute,
                         gpu.kernel_launch_s, options.forward_kernels)
    if options.zero3_kernels is not None:  # dtlib.parallel.FSDP's operators per layer (unit) and micro-batch
        launch = launch + (zero == 3) * (dp * cp > 1) * options.zero3_kernels * layers_here * m * gpu.kernel_launch_s

    pipelined = compute + elementwise + launch + tp_comm + cp_comm + ep_comm
    # DualPipe's bubble reads the forward's and the weight gradients' shares of the pipelined work: the
    # forward one of 3 passes (4 with full recompute), the weight-gradient GEMMs one of the GEMMs' 3
    # (4), none for LoRA's frozen weights
    forward_share = 1 / (3 + full)
    weight_share = (1 - lora) * parts["gemm"] / (3 + full) / np.maximum(pipelined, 1e-30)
    bubble = bubble_fraction(pp, m, v, schedule, forward_share, weight_share)
    pp_bubble = bubble * pipelined
    boundary = act / tp
    pp_p2p = (pp > 1) * 2 * v * m * _on(gpus <= g, "p2p", boundary, 2, intra, inter)

    # ---- data-parallel gradient reduce, hierarchical, minus what overlaps ------------------
    dp_comm_raw = 0 * compute
    dp_edges = 0 * compute  # the last bucket's reduce and the first gather: nothing left to hide them
    dense_local = np.where(tp <= g, np.minimum(dp * cp, np.maximum(g // tp, 1)), 1)
    for params, trained, ranks, local in ((dense, dense_trained, dp * cp, dense_local),
                                          (expert, expert_trained, grid["edp"], grid["edp_local"])):
        grads, weights_bytes = trained * prec.grad, np.where(zero == 3, params + lora * trained, trained) * prec.param
        calls = _buckets(trained, ranks, zero, np.ceil(layers_here * (1 + (schedule == "dualpipe"))))  # layers held
        reduce = np.where(zero == 0, _hierarchical("all_reduce", grads, ranks, local, intra, inter, calls),
                          _hierarchical("reduce_scatter", grads, ranks, local, intra, inter, calls))
        gather = np.where(zero == 0, 0, _hierarchical("all_gather", weights_bytes, ranks, local, intra, inter, calls))
        # LoRA without adapters in this group: nothing to reduce (ZeRO-3 still gathers the frozen weights)
        reduce, gather = np.where(trained > 0, reduce, 0), np.where((trained > 0) | (zero == 3), gather, 0)
        reduces = np.where(sharded, m, 1)
        t = reduces * reduce + np.where(zero == 3, 2 * m, 1) * gather
        used = (ranks > 1) & (params > 0)  # dense models: no expert part
        dp_comm_raw = dp_comm_raw + np.where(used, t, 0)
        dp_edges = dp_edges + np.where(used, (reduce + gather) / calls, 0)
    per_token_fwd = flops["forward_per_token"]
    frozen = flops["frozen_per_token"]  # LoRA: the frozen weights' skipped weight gradients
    backward_share = (2 * per_token_fwd - frozen + extra) / (3 * per_token_fwd - frozen + extra)
    one_micro = compute / m
    budget = np.where(zero == 3, compute,
                      one_micro * backward_share + (zero >= 1) * one_micro * (1 - backward_share))
    dp_overlap = (np.where(zero == 3, stack.dp_overlap_zero3, stack.dp_overlap) if options.dp_overlap is None
                  else options.dp_overlap)
    dp_comm = np.maximum(dp_comm_raw - dp_overlap * budget, np.minimum(dp_edges, dp_comm_raw))
    # the flat bucket's copies around the reduce (ZeRO-0/1/2; ZeRO-3 reduce-scatters from the gathered buffer)
    gradients_here = (dense_trained + expert_trained) * prec.grad
    copies = options.grad_bucket_copy * (zero < 3) * (dp * cp > 1) * 6 * gradients_here
    # ZeRO-3's copies around each of its 2 gathers per micro-batch and each reduce-scatter (dtlib.plan.zero3)
    weights_here = (dense + expert + lora * (dense_trained + expert_trained)) * prec.param
    copies = copies + options.zero3_unit_copies * (zero == 3) * (dp * cp > 1) * unit_copy_bytes(
        weights_here, gradients_here, 2 * m, np.where(sharded, m, 1))
    dp_comm = dp_comm + copies / gpu.optimizer_bandwidth

    # ---- optimizer step: memory-bound ----------------------------------------------------------
    owned = dense_trained / np.where(zero >= 1, dp * cp, 1) + expert_trained / np.where(zero >= 1, grid["edp"], 1)
    touched = 2 * (prec.master + prec.states) + prec.grad + prec.param * (1 + (prec.master == 0))
    optimizer = owned * touched / gpu.optimizer_bandwidth
    # two scalar all-reduces over every GPU each step, pure latency: the gradient norm for clipping
    # (Megatron-Core optimizer/clip_grads.py get_grad_norm_fp32; torchtitan clip_grad_norm_) and the
    # loss averaged for the step's report; NCCL's faster of ring and tree
    nodes = np.maximum(np.ceil(gpus / g), 1)
    optimizer = optimizer + 2 * np.minimum(nccl_latency("all_reduce", "ring", gpus, nodes, intra, inter),
                                           nccl_latency("all_reduce", "tree", gpus, nodes, intra, inter))

    out = {"compute": compute, "elementwise": elementwise, "launch": launch, "pp_bubble": pp_bubble, "tp_comm": tp_comm,
           "cp_comm": cp_comm, "ep_comm": ep_comm, "pp_p2p": pp_p2p, "dp_comm": dp_comm, "optimizer": optimizer}
    out = {k: np.asarray(val, dtype=float) * np.ones_like(compute, dtype=float) for k, val in out.items()}
    out["step_time"] = sum(out[k] for k in TERMS)
    out.update(bubble_fraction=bubble * np.ones_like(compute, dtype=float), model_flops=np.asarray(flops["model"], float), hardware_flops=np.asarray(flops["hardware"], float),
               tokens=np.asarray(tokens, float), gpus=np.asarray(gpus), params_per_gpu=dense + expert,
               dp_comm_unhidden=dp_comm_raw, compute_gemm=parts["gemm"] * np.ones_like(compute, dtype=float),
               compute_attention=parts["attention"] * np.ones_like(compute, dtype=float),
               stage_rank=stage["rank"] * np.ones_like(compute, dtype=int), stage_layers=layers_here)
    return out


@dataclass
class StepTime:
    """One layout's step: ``breakdown`` (seconds per term of :data:`TERMS`, summing to
    ``step_time``), throughput and utilisation (MFU and HFU against the dense BF16 peak), and
    ``dp_comm_unhidden``, the data-parallel collectives before overlap."""
    layout: Parallelism
    step_time: float
    breakdown: dict[str, float]
    tokens_per_step: float
    model_flops: float
    hardware_flops: float
    gpus: int
    peak: float
    efficiency: float | None
    dp_comm_unhidden: float = 0.0
    sources: dict[str, str] = field(default_factory=lambda: dict(TERMS))

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_time

    @property
    def model_tflops_per_gpu(self) -> float:
        return self.model_flops / (self.step_time * self.gpus) / 1e12

    @property
    def hardware_tflops_per_gpu(self) -> float:
        return self.hardware_flops / (self.step_time * self.gpus) / 1e12

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.gpus * self.peak)


def step_time(model: TransformerConfig, layout: Parallelism, cluster: Cluster, *,
              options: StepOptions = StepOptions(), seq: int | None = None,
              dropout: bool | None = None, finetune: FineTuning | None = None,
              packed_doc_length: int | None = None) -> StepTime:
    """The step-time breakdown of ``layout`` training ``model`` on ``cluster`` (see :data:`TERMS`).

    The layout must use ``cluster``'s GPUs exactly; the global batch is
    ``dp x micro_batch_size x num_microbatches`` sequences of ``seq`` (default: the model's) tokens.
    ``dropout`` and ``options.flash_attention`` default to the activation convention
    (:func:`resolve`; ``today``: FlashAttention-style attention, no dropout). ``finetune``: LoRA
    times the adapters' GEMMs, no weight gradients of the frozen weights and DP traffic of the
    adapters only (:mod:`dtlib.analytic.finetune`). ``packed_doc_length``: each sequence packed from
    documents of that many tokens (1..seq), attention within each (:func:`with_packing`).
    """
    if not isinstance(model, TransformerConfig):
        raise ValueError(f"model must be a TransformerConfig (a shape: the step time needs layers), got {model!r}")
    options, dropout = resolve(options, dropout)
    if layout.gpus != cluster.world_size:
        raise ValueError(f"the layout uses dp x tp x pp x cp = {layout.gpus} GPUs but the cluster has "
                         f"{cluster.world_size}; make them equal")
    layout.check_model(model)
    # an explicit layout string's per-chunk counts (tuples) join after the arrays are broadcast
    arrays = {k: np.asarray([v]) for k, v in layout.numbers().items() if not isinstance(v, tuple)}
    arrays["gpus"] = np.asarray([cluster.world_size])
    if seq is not None:
        arrays["seq"] = np.asarray([seq])
    n, _ = layout_arrays(model, arrays, layout.schedule, layout.offload, on_invalid="raise",
                         balanced=layout.account_for_embedding_and_loss)
    n = dict(with_packing(with_finetune(n, finetune, model), packed_doc_length),
             **layout_numbers(layout.explicit_layout))
    r = step_time_arrays(n, cluster, recompute=layout.recompute, schedule=layout.schedule,
                         options=options, dropout=dropout, recompute_layers=layout.recompute_layers,
                         recompute_modules=layout.recompute_modules,
                         account_for_embedding_and_loss=layout.account_for_embedding_and_loss)
    eff = options.efficiency
    return StepTime(layout=layout, step_time=float(r["step_time"][0]),
                    breakdown={k: float(r[k][0]) for k in TERMS}, tokens_per_step=float(r["tokens"][0]),
                    model_flops=float(r["model_flops"][0]), hardware_flops=float(r["hardware_flops"][0]),
                    gpus=layout.gpus, peak=cluster.gpu.peak("bf16"), efficiency=eff,
                    dp_comm_unhidden=float(r["dp_comm_unhidden"][0]))
