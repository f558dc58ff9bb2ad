"""The terms of the step time (:func:`dtlib.plan.steptime.step_time`), each with what it counts and the
source of its formula: the text ``dtlib plan`` and lesson 10 print beside the numbers, and
``docs/plan.md`` repeats. Kept apart from the arithmetic so that each reads in one sitting."""
from __future__ import annotations

__all__ = ["TERMS"]

TERMS: dict[str, str] = {
    "compute": "weight GEMMs timed from their shapes on one rank after TP/CP splitting (Shoeybi et al. "
               "2019 Sec. 3): tile and wave quantization on the SMs, roofline against HBM (NVIDIA "
               "Matrix Multiplication Background User's Guide), / the fitted GEMM efficiency; forward, "
               "2 backward GEMMs each, full recompute repeats the forward; attention from "
               "FlashAttention's causal work (backward 2.5x, Dao 2023) at the BF16 peak plus one softmax "
               "exponential per score forward and one backward at the special-function units' rate "
               "(FlashAttention-3 Sec. 3.1; dtlib.analytic.hardware.FLOPS_PER_EXP), / the fitted attention efficiency, or as batched GEMMs without it; fp8: weight GEMMs at the FP8 "
               "peak plus the HBM traffic of casting their operands (amax, cast, transposed copy), "
               "attention and LM head in BF16 (Transformer Engine); a power limit scales the "
               "clock by (limit/TDP)^(1/3) (dtlib.plan.gemm); MoE layers: one grouped GEMM of the local "
               "experts plus, where the stack loops over experts, 25 us per kernel it launches per expert "
               "(GEMMs and, by FP8 recipe, casts: TransformerEngine PR #3134 and 2.9's GroupedLinear; "
               "dtlib.plan.moe.grouped_gemm_overhead); recompute_modules repeat their forward (dtlib.plan.recompute). efficiency= replaces all this by "
               "hardware FLOPs / (GPUs x peak x efficiency) (Narayanan et al. 2021 eq. 3)",
    "elementwise": "memory-bound layers (norms, activations, dropout, residual adds, softmax): the "
                   "tensors Korthikanti et al. 2022 Sec. 4.1 count per layer are written forward, read "
                   "and their gradients written backward (3 passes; recomputed ones written again), "
                   "at the HBM bandwidth (roofline, Williams et al. 2009); with flash_attention the "
                   "s x s scores never reach HBM (Dao et al. 2022); fused_elementwise=False (eager "
                   "PyTorch): every operator's kernel reads and writes HBM (dtlib.plan.eager); MoE layers add the "
                   "dispatcher's token permutations (permute, sort by local expert, their inverses, forward "
                   "and backward: Megatron-Core MoEAlltoAllTokenDispatcher; dtlib.plan.moe.permutation_bytes); "
                   "eager norms and residual adds run whole on every tensor rank without sequence parallelism "
                   "(Korthikanti et al. 2022 Sec. 4.2.2); grad_accumulation_fusion=False: each micro-batch "
                   "after the first adds its gradients to .grad in a pass of its own (autograd's AccumulateGrad)",
    "launch": "the fixed cost of every kernel a layer launches, beside its work: the device's, 3 us on a GPU "
              "(the launch overhead of null kernels, NVIDIA developer forums 2022) or measured by dtlib "
              "calibrate, x the kernels per layer and micro-batch "
              "(11 forward fused, Megatron-Core/Transformer Engine or torch.compile; 33 eager, dtlib.plan.eager's "
              "operators, or forward_kernels counted on the model; backward twice the forward, full recompute "
              "once more, FP8 + 8 casts) "
              "(dtlib.plan.launches): what dominates when a GPU holds a few hundred tokens",
    "pp_bubble": "(p-1)/m of the pipelined work for 1F1B/GPipe, (p-1)/(v m) interleaved (Narayanan et "
                 "al. 2021, Sec. 2.2; dtlib.analytic.comm.bubble_fraction), applied to compute + "
                 "elementwise, kernel launches and TP/CP/EP communication",
    "tp_comm": "per layer and micro-batch, 2 all-reduces of b s h forward and 2 backward (+2 with full "
               "recompute; half of them in MoE layers without shared experts, whose tokens the EP "
               "dispatcher moves) (Shoeybi et al. 2019, Sec. 3; with sequence parallelism the same "
               "volume as all-gather + reduce-scatter, Korthikanti et al. 2022, Sec. 4.2.2), ring "
               "alpha-beta on the intra-node link; exposed unless tp_overlap says otherwise",
    "cp_comm": "ring attention: K and V of the local sequence shard pass around the cp ranks once "
               "forward, their gradients once backward, per layer and micro-batch (Liu et al. 2023, "
               "Ring Attention; Megatron-LM context parallelism), exposed unless cp_overlap",
    "ep_comm": "per MoE layer and micro-batch, the dispatch and combine all-to-alls of the routed tokens "
               "(b s/(cp tp) x top_k x h, x the capacity factor when set, else x moe_imbalance) forward "
               "and backward (+2 with full recompute) (Lepikhin et al. 2021, GShard, Sec. 2; "
               "Megatron-Core MoEAlltoAllTokenDispatcher), on NVLink when the EP group's etp x ep "
               "consecutive ranks fit a node (Megatron-Core's expert grid), else bounded by the NIC "
               "share per GPU (DeepSeek-V3 report, Sec. 3.2.2); with etp > 1 an all-gather and a "
               "reduce-scatter over the ETP group; with Megatron-Core's alltoall dispatcher the router "
               "probabilities' own all-to-all beside each dispatch, and, dropless, the token counts "
               "all-gathered over etp x ep and read by the blocking host before each forward all-to-all "
               "(token_dispatcher.py); exposed but for ep_overlap x the MoE layers' compute, the most "
               "another micro-batch's work can hide (dtlib.plan.moe)",
    "pp_p2p": "each stage boundary sends the micro-batch's activations forward and their gradients "
              "back (x v chunks interleaved), point to point on the link between stages (Narayanan "
              "et al. 2021, Sec. 4.1), each of the t tensor ranks sending 1/t of it (their "
              "scatter/gather optimisation; sequence parallelism shards it the same way)",
    "dp_comm": "gradient reduce over the dp x cp replicas (ZeRO 1/2: reduce-scatter + all-gather, "
               "ZeRO-3: parameters all-gathered forward and backward per micro-batch + one "
               "reduce-scatter, Rajbhandari et al. 2020, Sec. 7), hierarchical: intra-node phase on "
               "NVLink, inter-node phase on the NICs; in buckets of max(40M, 1M x dp) parameters "
               "(Megatron-Core DistributedDataParallel) or one layer at a time for ZeRO-3 (FSDP), each "
               "call paying NCCL's latency (ring: 2(n-1) hops, tree: 2 log2(nodes) network hops; NCCL "
               "src/graph/tuning.cc) and NCCL running the faster of ring and tree per call; the "
               "exposed part is what dp_overlap x (backward of the last micro-batch; + forward of the "
               "first for the ZeRO 1/2 parameter gather; all compute for ZeRO-3) cannot hide, and never "
               "less than the last bucket's reduce and the first one's gather, which have nothing to "
               "overlap (PyTorch DDP buckets, Li et al. 2020, Sec. 3.2; Megatron --overlap-grad-reduce)"
               "; expert gradients over the expert-data-parallel group, tp x cp x dp / (etp x ep) "
               "ranks at stride etp x ep (Megatron-Core's expert grid, dtlib.plan.moe); zero3_reduce_per_microbatch: "
               "a reduce-scatter after every micro-batch's backward (PyTorch FSDP without no_sync); "
               "grad_bucket_copy: six passes over the gradients to copy them into a flat bucket, divide "
               "and copy back (PyTorch DDP's gradient_as_bucket_view=False)",
    "optimizer": "Adam update, memory-bound: each owned parameter reads and writes its master weight "
                 "and states, reads its gradient and writes the working copy, at the HBM bandwidth "
                 "(a calibrated device: its optimizer step's measured bandwidth) "
                 "(roofline, Williams et al. 2009); plus two scalar all-reduces over every GPU, NCCL's latency "
                 "only (the gradient norm for clipping, Megatron-Core get_grad_norm_fp32 / torchtitan "
                 "clip_grad_norm_, and the loss average)",
}
