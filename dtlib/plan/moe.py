"""Mixture-of-experts layers in the step time: the expert grid, the token load, the EP all-to-all.

**The expert grid** follows Megatron-Core's MoE parallel folding
(``parallel_state.initialize_model_parallel``, Megatron-Core 0.16): the dense part of a pipeline
stage is laid out ``tp-cp-dp`` and the expert part of the *same* ranks ``etp-ep-edp``, with
``edp = tp x cp x dp / (etp x ep)`` (``expert_data_parallel_size = world_size //
(expert_tensor_parallel_size x expert_model_parallel_size x pipeline_model_parallel_size)``, which
must divide evenly), tensor-expert ranks adjacent. An EP group is therefore ``ep`` ranks at stride
``etp``, spanning ``etp x ep`` consecutive ranks; nodes hold ``gpus_per_node`` consecutive ranks
(``g``, the NVLink domain: 8 on HGX, 72 on a GB200 NVL72 rack). Groups start at multiples of the
span and nodes at multiples of ``g``, so the worst-placed group has ``gcd(etp x ep, g) / etp`` of
its members on one node: all of them when the span divides ``g`` (the group lives in NVLink),
``g / etp`` when ``g`` divides the span, and fewer when neither divides the other (a group of 16
starting at rank 64 straddles two 72-GPU racks, 8 + 8).

**The token load.** Each rank dispatches its sequence-parallel shard of ``b s / (cp tp)`` tokens
(Megatron-Core runs MoE with TP only sequence-parallel: ``MoELayer.forward`` refuses otherwise),
``top_k`` copies of each. With a capacity factor ``C`` every expert's buffer holds ``C`` x the mean
(tokens over it dropped, the rest padded: GShard, Lepikhin et al. 2021, Sec. 2.2; Switch
Transformer, Fedus et al. 2022, Sec. 2.2; Megatron ``--moe-expert-capacity-factor`` with
``--moe-pad-expert-input-to-capacity``); dropless routing (``C`` = None) sends what the router
chose, and the busiest expert gets ``moe_imbalance`` x the mean (1 = balanced, the goal of an
auxiliary balance loss or DeepSeek-V3's aux-loss-free bias, DeepSeek-AI 2024, Sec. 2.1.2). The
busiest rank sets the pace, so the load multiplies both the all-to-all and the expert GEMMs; it is
an upper bound when a rank holds several experts (their loads average).

**The all-to-all** (Megatron-Core ``MoEAlltoAllTokenDispatcher``: dispatch before the experts, combine
after, each once forward and once backward; full recompute repeats the forward two) sends ``(n-1)/n``
of a rank's buffer to its ``n = ep`` peers, inside one node over NVLink. Across nodes the bytes to
peers on the same node go over NVLink and the rest through the GPU's share of the node's NICs at the
same time; the NIC share bounds it (DeepSeek-V3 technical report, Sec. 3.2.2: cross-node all-to-all
limited by the InfiniBand bandwidth per GPU, the NVLink part concurrent). Its latency is not the
pairwise exchange's ``(n-1) alpha`` (Thakur, Rabenseifner & Gropp 2005;
:func:`dtlib.analytic.comm.collective_time` teaches that form) but ``ceil((n-1) / 8)`` latencies of
the link crossed: NCCL runs an all-to-all as one group of sends and receives, one "round" per peer,
and puts the rounds to a peer node's ranks into one work batch of up to :data:`P2P_PER_BATCH` p2p
operations that a channel runs at once (``NCCL_MAX_DEV_WORK_P2P_PER_BATCH`` and
``ncclP2pChannelBaseForRound``, NCCL 2.22 on; ``src/include/device.h`` and ``channel.h`` at 2.26.2,
f44ac759). The batches of other peer nodes go to other channels, which also run at once, so this is an
upper bound on the latency NCCL pays (how many channels a job gets is NCCL's runtime choice; on an NVL72
rack a batch holds one tray's 4 ranks, its trays' batches on separate channels).
With ``etp > 1`` the dispatched tokens are then all-gathered over the ETP group and the expert outputs
reduce-scattered back (``gather_from_sequence_parallel_region`` /
``reduce_scatter_to_sequence_parallel_region`` in the dispatcher).

**Beside the tokens**, the alltoall dispatcher (Megatron-Core 0.16 ``token_dispatcher.py``) sends the
router probabilities in an all-to-all of their own after each dispatch (and their gradient back); the
flex dispatcher's DeepEP / HybridEP kernels carry them with the tokens, and torchtitan or DeepSpeed-MoE
never send them (``dispatcher`` "flex"). And dropless routing starts every MoE layer's forward with two
latency-bound steps, whatever the dispatcher: the per-expert token counts are exchanged over the
``etp x ep`` group and read by the host, which blocks on them because the all-to-all's split sizes (or
the output buffers) must be host numbers. Megatron's alltoall dispatcher all-gathers them with NCCL
(``dispatch_preprocess``, over ``tp_ep_group``) and blocks in ``_maybe_dtoh_and_synchronize`` at
``before_ep_alltoall``; HybridEP and DeepEP exchange them in their own preprocessing kernel and sync on
``num_permuted_tokens`` (Megatron's ``fused_a2a.py``: without it "causes a D2H synchronization");
torchtitan all-to-alls them and calls ``.tolist()``. Each is timed as NCCL's ring all-gather latency over
the group (:func:`dtlib.analytic.comm.nccl_latency`). The block drains the GPU's queue, so the kernel
launched after it pays the launch floor on an idle GPU (:mod:`dtlib.plan.launches`); the host's own
wake-up is not counted (no measurement of it found). With padded buffers (a capacity factor) the sizes
are static: neither step.

Pure numpy; every argument may be an array (one entry per layout of the search).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.comm import collective_time, nccl_latency
from dtlib.analytic.hardware import Link
from dtlib.analytic.measured import MeasuredLink
from dtlib.analytic.stacks import MOE_DISPATCHERS

__all__ = ["moe_numbers", "expert_grid", "expert_load", "check_imbalance", "expert_rows",
           "all_to_all_time", "ep_comm_time", "P2P_PER_BATCH", "PROBS_BYTES", "COUNT_BYTES", "PERMUTE_PASSES",
           "SORT_PASSES", "STORED_PASSES",
           "permutation_bytes", "GEMM_CALL_SECONDS_PER_EXPERT", "EXPERT_LAUNCHES", "grouped_gemm_overhead"]

# p2p operations (one peer's send or receive) NCCL runs concurrently in one work batch of a channel:
# NCCL_MAX_DEV_WORK_P2P_PER_BATCH, src/include/device.h (NVIDIA/nccl f44ac759, 2.26.2; unchanged 2.22-2.28)
P2P_PER_BATCH = 8

# Full passes (one read or one write) over the routed copies (tokens x top_k x h) that Megatron-Core's
# MoEAlltoAllTokenDispatcher makes per MoE layer and micro-batch, forward + backward (token_dispatcher.py,
# moe_utils.permute / unpermute / sort_chunks_by_idxs, Megatron-Core 0.16). Forward: "Permutation 1"
# (permute gathers each token's top_k copies: read + write, 2) and unpermute after the combine
# all-to-all (reads the routed outputs, weights them by the router probabilities and sums each token's
# copies: 1). Backward: unpermute's gradient writes the copies' gradients (1) and reads the routed
# outputs again for the probabilities' gradient (1); permute's gradient reads the copies' gradients and
# sums them per token (1). The tokens' own h (written by unpermute, its gradient read, the summed input
# gradient written: 3 passes of tokens x h) is counted apart.
PERMUTE_PASSES = 6
# "Permutation 2" (sort_chunks_by_idxs: the tokens received from the EP peers regrouped by local
# expert, read + write) after the dispatch all-to-all and its inverse before the combine one, forward
# and backward: 8 passes, made only when a rank holds more than one expert (num_local_experts > 1).
SORT_PASSES = 8
# of those, the passes the elementwise term already counts: the experts' stored input (one h-sized
# routed copy per token and expert, dtlib.analytic.activations.layer_bytes) is written forward, read and
# its gradient written backward (Korthikanti et al. 2022, Sec. 4.1's 3 passes per stored tensor)
STORED_PASSES = 3

# Router probabilities sent beside the dispatched tokens, bytes per routed copy: the alltoall dispatcher's
# token_dispatch all-to-alls them in a call of their own after the tokens' (Megatron-Core 0.16
# token_dispatcher.py, MoEAlltoAllTokenDispatcher.token_dispatch: all_to_all(..., permuted_probs, ...)), in the
# router's dtype: FP32 with moe_router_dtype="fp32" (Megatron-Bridge's Qwen3 MoE providers), BF16 when unset
# (2 bytes: a 1/(h x 2) share of the tokens' bytes either way; the call's latency is what counts)
PROBS_BYTES = 4
# Bytes per expert of the token counts the dispatcher all-gathers over the etp x ep group before each
# forward all-to-all (dispatch_preprocess: routing_map.sum(dim=0).long(), gathered with
# gather_from_sequence_parallel_region over tp_ep_group): int64
COUNT_BYTES = 8

# Seconds each expert adds to each kernel Transformer Engine launches for it (GroupedLinear ->
# nvte_multi_tensor_gemm: one cuBLASLt GEMM per expert, issued round-robin on several CUDA streams,
# each call setting up its own scale swizzle and descriptors), beyond the kernels' own time: NVIDIA
# measured 8 experts of 128 tokens (N = K = 2048) on SM100 at 0.272 ms through that path and 0.069 ms
# as one single-launch CUTLASS grouped kernel doing the same arithmetic (TransformerEngine PR #3134,
# "Single-launch CUTLASS grouped GEMM for per-tensor NVFP4", 2026-06-17, TN fprop table, rows
# "dispatch" / multi-stream and "pure" / cutlass): (0.272 - 0.069) / 8 = 25 us per expert and call
# (kernel against kernel, "pure" 0.267 - 0.069, the same 25 us). The quantize kernels of the same
# per-expert loop are taken to cost what a GEMM call costs (an assumption: no measurement of them
# alone was found; docs/moe-steptime.md).
GEMM_CALL_SECONDS_PER_EXPERT = (0.272e-3 - 0.069e-3) / 8
# Kernels launched per local expert, per MoE layer and micro-batch, (forward, backward), by the matmul
# precision / FP8 recipe (Transformer Engine 2.9 module/grouped_linear.py, csrc/extensions/cast.cpp):
# FC1 and FC2 forward, each one's dgrad and wgrad backward; FP8 adds the quantization of each GEMM's
# input forward (FC1 and FC2) and of each output gradient backward (FC2 and FC1): current scaling
# three kernels per tensor (nvte_compute_amax, nvte_compute_scale_from_amax, nvte_quantize_v2),
# MXFP8 and blockwise one (block scales computed in the cast), delayed scaling none per expert (cast.cpp: "only have
# fused kernel for FP8 delayed scaling", one multi-tensor cast for all experts); torchao's dynamic
# tensorwise / rowwise recipes are current scaling; NVFP4 two per tensor, the global amax (its per-tensor FP32
# scale) then one cast writing the blocks' scales (an assumption: TE's NVFP4 quantizer not read kernel by
# kernel). Weight casts (once per step, cached over micro-batches) are not counted.
EXPERT_LAUNCHES = {"bf16": (2, 4), "delayed": (2, 4), "current": (2 + 2 * 3, 4 + 2 * 3),
                   "tensorwise": (2 + 2 * 3, 4 + 2 * 3), "rowwise": (2 + 2 * 3, 4 + 2 * 3),
                   "mxfp8": (2 + 2, 4 + 2), "blockwise": (2 + 2, 4 + 2), "nvfp4": (2 + 2 * 2, 4 + 2 * 2)}


def moe_numbers(n: dict[str, Any]) -> dict[str, Any]:
    """The MoE numbers of ``n`` (:meth:`dtlib.analytic.config.TransformerConfig.numbers` plus the
    layout): ``experts``, ``top_k``, ``moe`` (experts > 0), the expert width ``moe_ffn``,
    ``shared_experts``, ``capacity_factor`` (0: dropless), ``etp`` (1 when the layout has none, as
    :class:`~dtlib.analytic.layout.Parallelism`) and ``moe_share``, the fraction of the layers that
    are MoE layers (0 for a dense model)."""
    experts = np.asarray(n["experts"])
    return {"experts": experts, "top_k": np.asarray(n["top_k"]), "moe": experts > 0,
            "moe_ffn": np.asarray(n["moe_ffn"]), "shared_experts": np.asarray(n["shared_experts"]),
            "capacity_factor": np.asarray(n["capacity_factor"], float), "etp": np.asarray(n.get("etp", 1)),
            "moe_share": np.asarray(n["moe_layers"]) / np.asarray(n["layers"])}


def expert_grid(tp: Any, cp: Any, dp: Any, ep: Any, etp: Any, gpus_per_node: int) -> dict[str, Any]:
    """Megatron-Core's expert grid (module docstring): ``edp``, the expert-data-parallel size;
    ``ep_local``, the EP ranks of the worst-placed group on one node; ``edp_local``, the EDP ranks
    on one node (the group's stride is ``etp x ep``)."""
    tp, cp, dp, ep, etp = (np.asarray(x) for x in (tp, cp, dp, ep, etp))
    span = etp * ep
    edp = tp * cp * dp // span
    ep_local = np.maximum(np.gcd(span, gpus_per_node) // etp, 1)
    edp_local = np.clip(gpus_per_node // span, 1, np.maximum(edp, 1))
    return {"edp": edp, "ep_local": np.minimum(ep_local, ep), "edp_local": edp_local}


def expert_load(moe: dict[str, Any], imbalance: float) -> Any:
    """Rows of the busiest expert over the balanced mean: the capacity factor when set (padded
    buffers), else ``imbalance`` (dropless)."""
    capacity = moe["capacity_factor"]
    return np.where(capacity > 0, capacity, imbalance)


def check_imbalance(moe: dict[str, Any], imbalance: float) -> None:
    """``imbalance`` can be at most ``experts / top_k``: the busiest expert gets every token once."""
    most = np.where(moe["moe"], moe["experts"] / np.maximum(moe["top_k"], 1), np.inf)
    if np.any(imbalance > most):
        bound = float(np.min(most))
        raise validate.InvalidArgument(
            "moe_imbalance", f"between 1 and experts / top_k = {bound:g} (the busiest expert gets "
            "each token at most once)", imbalance)


def expert_rows(tokens: Any, tp: Any, moe: dict[str, Any], load: Any) -> Any:
    """Rows of the expert GEMMs on the busiest rank per micro-batch and MoE layer, over all of its
    local experts: ``tokens`` (``b s / cp``) sequence-sharded over ``tp``, ``top_k`` copies,
    all-gathered over ``etp``, times the ``load``."""
    return tokens / tp * moe["top_k"] * moe["etp"] * load


def all_to_all_time(nbytes: Any, ranks: Any, local: Any, intra: Link, inter: Link) -> Any:
    """Seconds of an all-to-all of ``nbytes`` per rank over ``ranks`` of which ``local`` share the
    sender's node (module docstring): ``(ranks - 1) / ranks`` of the buffer on ``intra`` when all do,
    else the slower of the NVLink part and the NIC part; plus ``ceil((ranks - 1) / P2P_PER_BATCH)``
    latencies of the link the slowest part crosses (NCCL's batched p2p rounds). A calibrated NVLink
    (:class:`~dtlib.analytic.measured.MeasuredLink`) gives its measured all-to-all inside a node."""
    nbytes, ranks, local = (np.asarray(x, float) for x in (nbytes, ranks, local))
    batches = np.ceil((ranks - 1) / P2P_PER_BATCH)
    if isinstance(intra, MeasuredLink):
        inside = collective_time("all_to_all", nbytes, ranks.astype(int), intra)
    else:
        inside = batches * intra.latency + (ranks - 1) / ranks * nbytes / intra.group_bandwidth(ranks)
    on_node = (local - 1) / ranks * nbytes / intra.group_bandwidth(local)
    off_node = (ranks - local) / ranks * nbytes / inter.bandwidth
    across = batches * inter.latency + np.maximum(on_node, off_node)
    return np.where(ranks > 1, np.where(local >= ranks, inside, across), 0.0)


def ep_comm_time(*, b: Any, s: Any, h: Any, tp: Any, cp: Any, dp: Any, ep: Any, moe: dict[str, Any],
                 load: Any, act_bytes: float, calls: Any, forwards: Any, gpus_per_node: int, intra: Link,
                 inter: Link, kernel_launch_s: float, dispatcher: str) -> dict[str, Any]:
    """EP communication of one rank per step, before overlap: ``calls`` all-to-alls (4 per MoE
    layer and micro-batch, 6 with full recompute) of the dispatched tokens' bytes
    (``bytes_per_call``), plus as many ETP all-gathers / reduce-scatters of ``etp`` x that when
    ``etp > 1``; with the ``alltoall`` ``dispatcher`` (:data:`dtlib.analytic.stacks.MOE_DISPATCHERS`) the
    router probabilities' all-to-all beside each dispatch (``calls / 2``: the dispatch forward, its
    gradient backward, the forward again with full recompute); and, with either, in each
    of the ``forwards`` forward passes of an MoE layer (1 per layer and micro-batch, 2 with full
    recompute), the dispatcher's metadata all-gather and host synchronisation (module docstring,
    :data:`COUNT_BYTES`). Returns ``all_to_all``, ``etp``, ``probs`` and ``metadata`` (seconds) and
    ``bytes_per_call``."""
    validate.one_of("moe_dispatcher", dispatcher, MOE_DISPATCHERS)
    etp = moe["etp"]
    grid = expert_grid(tp, cp, dp, ep, etp, gpus_per_node)
    tokens = b * s / (cp * tp)
    nbytes = moe["moe"] * tokens * moe["top_k"] * h * act_bytes * load
    a2a = calls * all_to_all_time(nbytes, ep, grid["ep_local"], intra, inter)
    copies = moe["moe"] * tokens * moe["top_k"] * load
    probs = (dispatcher == "alltoall") * calls / 2 * all_to_all_time(copies * PROBS_BYTES, ep, grid["ep_local"],
                                                                     intra, inter)
    gathered = nbytes * etp
    within = (etp <= gpus_per_node) & (gpus_per_node % etp == 0)
    etp_time = np.where(within, collective_time("all_gather", gathered, etp, intra),
                        collective_time("all_gather", gathered, etp, inter))
    # dropless only: with padded buffers (a capacity factor) the sizes are known on the host; one EP rank
    # exchanges nothing (its host still copies the counts for GroupedLinear: one launch floor, not counted)
    dropless = moe["moe"] * (moe["capacity_factor"] <= 0) * (etp * ep > 1)
    # a few KB (experts x COUNT_BYTES per rank): NCCL's ring latency over the group's nodes is its time
    nodes = np.ceil(ep / np.maximum(grid["ep_local"], 1))
    gather = nccl_latency("all_gather", "ring", etp * ep, nodes, intra, inter)
    metadata = forwards * dropless * (gather + kernel_launch_s)
    return {"all_to_all": a2a, "etp": calls * etp_time, "probs": probs, "metadata": metadata,
            "bytes_per_call": nbytes}


def permutation_bytes(*, tokens: Any, h: Any, moe: dict[str, Any], load: Any, local_experts: Any,
                      act_bytes: float) -> Any:
    """HBM bytes the token permutation kernels move per MoE layer and micro-batch on the busiest rank,
    forward and backward, beyond the stored expert input the elementwise term counts.

    ``tokens`` (``b s / (cp tp)``) are the rank's sequence-parallel shard. Megatron-Core's
    alltoall dispatcher permutes the rank's own ``tokens x top_k`` routed copies of ``h`` (x the
    capacity factor when set: padded buffers) before the dispatch all-to-all and unpermutes them
    after the combine (:data:`PERMUTE_PASSES`, less the :data:`STORED_PASSES` the elementwise term
    counts; plus 3 passes over the ``tokens x h`` of the layer's output, its gradient and the
    input gradient), and with more than one local expert sorts the rows it *received*
    by expert and back (:data:`SORT_PASSES`): ``tokens x top_k x load`` on the busiest rank
    (``load``: :func:`expert_load`), ``etp`` x that after the ETP all-gather.
    Memory-bound kernels: their time is these bytes / the HBM bandwidth (the roofline, Williams et
    al. 2009). ``moe_permute_fusion`` fuses each permutation's index computation with its copy,
    which is what is counted (one read and one write per pass pair); DeepEP / HybridEP (the flex
    dispatcher) fuse permutation 1 into the dispatch kernel: not modelled (an upper bound there)."""
    own = tokens * moe["top_k"] * np.where(moe["capacity_factor"] > 0, moe["capacity_factor"], 1) * h * act_bytes
    received = tokens * moe["top_k"] * load * moe["etp"] * h * act_bytes
    sorts = (local_experts > 1) * SORT_PASSES * received
    return moe["moe"] * ((PERMUTE_PASSES - STORED_PASSES) * own + sorts + 3 * tokens * h * act_bytes)


def grouped_gemm_overhead(local_experts: Any, moe: dict[str, Any], recipe: str = "bf16",
                          expert_loop: bool = True) -> tuple[Any, Any]:
    """Seconds one MoE layer's expert GEMMs take per micro-batch on top of their arithmetic, forward
    and backward, on a rank holding ``local_experts`` experts: with ``expert_loop`` (the stack runs a
    kernel per expert, :class:`dtlib.analytic.stacks.Stack`) the :data:`EXPERT_LAUNCHES` of ``recipe``
    (``bf16`` or an FP8 recipe), each paying :data:`GEMM_CALL_SECONDS_PER_EXPERT` per expert; 0 in
    dense layers and for one grouped kernel (``torch._grouped_mm``, MegaBlocks' gmm).

    :func:`dtlib.plan.gemm.transformer_compute` adds it to the grouped GEMM's quantized math / HBM
    time (the time of one kernel doing all experts' tiles): at equal FLOPs, more local experts are
    slower. Dropless routing keeps the host from queueing these calls ahead of the GPU: the alltoall
    dispatcher copies ``tokens_per_expert`` to the CPU every MoE layer
    (``_maybe_dtoh_and_synchronize``) and ``GroupedLinear`` takes the per-expert row counts as a host
    list, which is also why CUDA graphs cannot capture the experts (the Megatron-Bridge 25.11
    recipes graph only the router and the dispatcher's preprocessing, ``cuda_graph_scope``)."""
    if recipe not in EXPERT_LAUNCHES:
        raise validate.InvalidArgument("fp8_recipe", f"one of {', '.join(EXPERT_LAUNCHES)}", recipe)
    forward, backward = EXPERT_LAUNCHES[recipe]
    per_launch = moe["moe"] * local_experts * GEMM_CALL_SECONDS_PER_EXPERT * expert_loop
    return forward * per_launch, backward * per_launch
