"""The software stack as an input: what each training framework overlaps, fuses and stores.

The physics (GEMM shapes, collectives, HBM traffic) is shared by every stack
(:mod:`dtlib.plan.gemm`, :mod:`dtlib.plan.steptime`, :mod:`dtlib.analytic.memory`); a
:class:`Stack` sets only the conventions that differ between frameworks, each as the framework
runs it in its published performance recipes, with the setting's name and where it is set
(``docs/stacks.md`` explains each choice):

============== ========== ========== ========== ========== ============ ========== =========
stack          TP overlap DP overlap CP overlap attention  elementwise  SwiGLU     FP8 saves
============== ========== ========== ========== ========== ============ ========== =========
``megatron``   1          1          0          cuDNN/FA3  fused        fused      FP8 inputs
``torchtitan`` 0          1          0          SDPA FA2   eager        eager      BF16
``deepspeed``  0          0 (ZeRO-3: 1) 0       SDPA FA2   eager        eager      BF16
``fsdp``       0          1          0          FA2        eager        eager      BF16
============== ========== ========== ========== ========== ============ ========== =========

:data:`DEFAULT_STACK` (``megatron``) is what ``StepOptions()`` and ``dtlib plan`` use when no stack
is given: the stack behind most published large-scale runs (NVIDIA's tables, Llama 3's 4D
parallelism is Megatron-style) and the one the planner's two efficiencies were fitted with
(:mod:`dtlib.plan.calibration`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dtlib.analytic import validate
from dtlib.analytic.hardware import Accelerator

# FlashAttention-2 on an H100 (PyTorch SDPA's flash backend) against the Hopper kernels that
# dtlib.plan.calibration.ATTENTION_EFFICIENCY describes (FlashAttention-3 / cuDNN, as Transformer
# Engine runs them): Shah et al. 2024, 'FlashAttention-3', abstract: FA2 "achieves only 35%
# utilization on H100", FA3 "up to 75%" in BF16. Not fitted: a ratio of two published utilizations.
FA2_ON_HOPPER = 0.35 / 0.75

__all__ = ["Stack", "STACKS", "DEFAULT_STACK", "ATTENTION_KERNELS", "FP8_RECIPES", "get_stack"]

# "fa3": FlashAttention-3 / cuDNN fused attention on Hopper and later (what ATTENTION_EFFICIENCY
# describes); "fa2": FlashAttention-2 (PyTorch SDPA's flash backend, the flash-attn 2 package)
ATTENTION_KERNELS = ("fa3", "fa2")
# FP8 scaling recipes: Transformer Engine's delayed and current (per-tensor) scaling, MXFP8 blocks and
# DeepSeek-V3's 1 x 128 / 128 x 128 blocks (TE recipe.DelayedScaling / Float8CurrentScaling /
# MXFP8BlockScaling / Float8BlockScaling); torchao's tensorwise and
# rowwise dynamic scaling (torchtitan float8.recipe_name)
FP8_RECIPES = ("delayed", "current", "mxfp8", "blockwise", "tensorwise", "rowwise")
# MoE token dispatchers, by whether the router probabilities cross the EP group in an all-to-all of their
# own: "alltoall", Megatron-Core's MoEAlltoAllTokenDispatcher (token_dispatch sends permuted_probs after
# the tokens); "flex", they do not (Megatron's flex dispatcher: DeepEP / HybridEP carry them in the dispatch
# kernel; torchtitan and DeepSpeed-MoE weight the outputs on the token's own rank) (dtlib.plan.moe)
MOE_DISPATCHERS = ("alltoall", "flex")


@dataclass(frozen=True)
class Stack:
    """One framework's conventions (``sources``: the setting behind each field, and where).

    ``tp_overlap`` / ``dp_overlap`` / ``cp_overlap``: fraction of that communication hidden
    behind compute (:class:`dtlib.plan.steptime.StepOptions`); ``dp_overlap_zero3``: the same for
    ZeRO-3 (DeepSpeed's ``overlap_comm`` defaults differ by stage); ``attention_kernel``: one of
    :data:`ATTENTION_KERNELS`; ``fused_elementwise``: norms, activations and residual adds run
    as fused kernels; ``fused_swiglu``: the SwiGLU activation saves only its input
    (:func:`dtlib.analytic.activations.stored_layer_bytes`); ``fp8_saves_inputs``: with FP8
    matmuls the GEMM inputs kept for backward are the FP8 copies; ``fp8_recipe``: the scaling
    recipe when FP8 is on (:data:`FP8_RECIPES`; the cast traffic is the same physics,
    :mod:`dtlib.plan.gemm`, but the kernels launched per local expert differ,
    :data:`dtlib.plan.moe.EXPERT_LAUNCHES`); ``expert_loop``: the local experts' GEMMs run as one
    kernel launch (or more) per expert, not as one grouped kernel, so each expert adds its launches'
    cost (:func:`dtlib.plan.moe.grouped_gemm_overhead`); ``moe_dispatcher``: one of
    :data:`MOE_DISPATCHERS` (:func:`dtlib.plan.moe.ep_comm_time`); ``precision``: bytes per parameter
    (:data:`dtlib.analytic.precision.CONVENTIONS`); ``tp_overlap_input_grads``: the TP overlap also
    hides the backward's input-gradient reduce-scatters (one per attention and MLP block), not only
    the collectives fused with the one GEMM beside them."""
    name: str
    description: str
    tp_overlap: float
    dp_overlap: float
    dp_overlap_zero3: float
    cp_overlap: float
    attention_kernel: str
    fused_elementwise: bool
    fused_swiglu: bool
    fp8_saves_inputs: bool
    fp8_recipe: str | None
    expert_loop: bool
    precision: str
    moe_dispatcher: str
    tp_overlap_input_grads: bool
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("tp_overlap", "dp_overlap", "dp_overlap_zero3", "cp_overlap"):
            validate.number(name, getattr(self, name), minimum=0, exclusive=False, maximum=1)
        validate.one_of("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        if self.fp8_recipe is not None:
            validate.one_of("fp8_recipe", self.fp8_recipe, FP8_RECIPES)
        validate.one_of("moe_dispatcher", self.moe_dispatcher, MOE_DISPATCHERS)

    def attention_scale(self, gpu: Accelerator) -> float:
        """The attention kernel's throughput relative to the FlashAttention-3/cuDNN kernels that
        :data:`~dtlib.plan.calibration.ATTENTION_EFFICIENCY` describes: FlashAttention-2 reaches
        :data:`FA2_ON_HOPPER` of them on GPUs with FP8 tensor cores (Hopper
        and later: FA3 needs their asynchronous tensor cores and TMA, Shah et al. 2024, Sec. 3);
        on older GPUs FA2 is the fast kernel, so 1."""
        hopper_or_later = gpu.peaks.get("fp8") is not None
        return FA2_ON_HOPPER if self.attention_kernel == "fa2" and hopper_or_later else 1.0


_MCORE = "megatron-core 0.16 "
_TITAN = "torchtitan torchtitan/config/job_config.py "
STACKS: dict[str, Stack] = {s.name: s for s in [
    Stack("megatron", "Megatron-Core + Transformer Engine as NVIDIA's recipes run it "
                      "(Megatron-Bridge / NeMo performance configs)",
          tp_overlap=1.0, dp_overlap=1.0, dp_overlap_zero3=1.0, cp_overlap=0.0, attention_kernel="fa3",
          fused_elementwise=True, fused_swiglu=True, fp8_saves_inputs=True, fp8_recipe="delayed",
          expert_loop=True, precision="bf16-mixed", moe_dispatcher="alltoall", tp_overlap_input_grads=True,
          sources={
              "tp_overlap_input_grads": "True: Megatron-Core fuses Q, K and V into one linear_qkv and the MLP's "
                                        "gate and up into one linear_fc1, so each block's input gradient is one "
                                        "dgrad GEMM, and Transformer Engine's userbuffers overlap its "
                                        "reduce-scatter with the wgrad GEMM (" + _MCORE + "TransformerConfig "
                                        "tp_comm_bulk_wgrad = True)",
              "moe_dispatcher": "alltoall: moe_token_dispatcher_type='alltoall' in Megatron-Bridge's MoE providers "
                                "(models/gpt_oss/gpt_oss_provider.py at 166d498; the --emit megatron config's "
                                "--moe-token-dispatcher-type alltoall); its token_dispatch all-to-alls the "
                                "permuted_probs after the tokens (" + _MCORE + "moe/token_dispatcher.py); "
                                "--moe-dispatcher flex for the flex dispatcher (DeepEP / HybridEP)",
              "tp_overlap": "1: CommOverlapConfig(tp_comm_overlap=True) in Megatron-Bridge's performance "
                            "recipes (Megatron-Core ModelParallelConfig.tp_comm_overlap, default False: "
                            "TE userbuffers overlap the TP all-gather/reduce-scatter with the GEMMs; "
                            "--tp-overlap 0 for a run without it)",
              "dp_overlap": "cfg.ddp.overlap_grad_reduce = True, cfg.ddp.overlap_param_gather = True in the "
                            "same recipes (Megatron-LM --overlap-grad-reduce / --overlap-param-gather, "
                            "default False)",
              "cp_overlap": "TE DotProductAttention with context parallelism, cp_comm_type 'p2p' (Megatron "
                            "default), sends the next K/V block while the current block's attention runs; "
                            "it hides only while a block's attention outlasts its transfer (short shards "
                            "do not), which one fraction cannot say, so the term stays exposed: 0, as the "
                            "planner was fitted (docs/stacks.md)",
              "attention_kernel": _MCORE + "TransformerConfig.attention_backend = AttnBackend.auto: TE picks "
                                  "cuDNN fused attention / FlashAttention-3 on Hopper",
              "fused_elementwise": "Megatron-LM --masked-softmax-fusion, --bias-dropout-fusion, "
                                   "--bias-swiglu-fusion, --apply-rope-fusion on by default (each has a "
                                   "--no-... flag); TE LayerNormLinear fuses the norm into the GEMM",
              "fused_swiglu": _MCORE + "fusions/fused_bias_swiglu.py SwiGLUFunction: "
                              "ctx.save_for_backward(input_for_backward) (its input only); Megatron-LM "
                              "'--no-bias-swiglu-fusion', action='store_false' (on by default)",
              "fp8_saves_inputs": "Transformer Engine transformer_engine/pytorch/module/linear.py _Linear.forward: "
                                  "'Cached input tensor ... saved_inputmat = inputmat' (the quantized input, "
                                  "column-wise FP8 data only)",
              "fp8_recipe": _MCORE + "TransformerConfig.fp8_recipe default 'delayed' (delayed scaling); "
                            "'tensorwise' = current scaling",
              "expert_loop": "Transformer Engine 2.9 GroupedLinear -> transformer_engine/common/gemm/cublaslt_gemm.cu "
                             "multi_stream_cublas_gemm: 'for (int i = 0; i < num_gemms; i++) { ... "
                             "nvte_cublas_gemm_v2(...) }' on 4 streams; its CUTLASS grouped GEMM only on Hopper "
                             "with NVTE_USE_CUTLASS_GROUPED_GEMM (default off)",
              "precision": "BF16 weights, BF16 gradient buffer, fp32 master weights and Adam states: 2 + 2 + 12 "
                           "bytes/param (the gradient buffer in the reduce dtype, grad_reduce below); Megatron-LM's "
                           "own training script differs: arguments.py with --bf16 sets "
                           "'accumulate_allreduce_grads_in_fp32 = True' unless --grad-reduce-in-bf16 "
                           "(megatron-bf16, 2 + 4 + 12)",
              "grad_reduce": "bf16: Megatron-Core DistributedDataParallelConfig.grad_reduce_in_fp32 = False "
                             "(megatron/core/distributed/distributed_data_parallel_config.py at NVIDIA/Megatron-LM "
                             "001199898c4badd01eaf0785c212d8ed7ce83042), as Megatron-Bridge 25.11's performance "
                             "scripts run it (the stack's other settings are those scripts' too; docs/validation.md); "
                             "Megatron-Bridge's library pretrain recipes (src/megatron/bridge/recipes/llama/llama3.py "
                             "at 0d5f5558c16fc7b3eec45698768522e74f1a87a2: cfg.ddp.grad_reduce_in_fp32 = True) and "
                             "NeMo 2.x's MegatronMixedPrecision reduce in fp32: --grad-reduce-dtype fp32",
          }),
    Stack("torchtitan", "torchtitan: FSDP2, PyTorch SDPA, optional torch.compile and Float8 (torchao)",
          tp_overlap=0.0, dp_overlap=1.0, dp_overlap_zero3=1.0, cp_overlap=0.0, attention_kernel="fa2",
          fused_elementwise=False, fused_swiglu=False, fp8_saves_inputs=False, fp8_recipe="tensorwise",
          expert_loop=False, precision="fsdp-mixed", moe_dispatcher="flex", tp_overlap_input_grads=False,
          sources={
              "tp_overlap_input_grads": "False: async TP (torch._inductor micro_pipeline_tp_pass) fuses a "
                                        "reduce-scatter only with the single matmul that produces its input "
                                        "(fuse_matmul_reduce_scatter / _find_producer_matmul in "
                                        "torch/_inductor/fx_passes/micro_pipeline_tp.py); torchtitan's Llama "
                                        "has separate wq, wk, wv and w1, w3 Linears, so autograd sums their "
                                        "input gradients before the reduce-scatter and those two per layer "
                                        "stay exposed; the forward's and the output gradients' all-gathers "
                                        "and reduce-scatters are fused",
              "moe_dispatcher": "flex: torchtitan models/moe/moe.py MoE.forward weights the routed outputs by "
                                "top_scores on the token's own rank (before the dispatch with "
                                "score_before_experts, else after the combine): no probabilities all-to-all",
              "tp_overlap": _TITAN + "parallelism.enable_async_tensor_parallel = False (async TP needs "
                            "torch.compile)",
              "dp_overlap": "FSDP2 fully_shard issues each block's all-gather and reduce-scatter on "
                            "their own streams, the next block's all-gather ahead of its compute (implicit "
                            "prefetching; FSDP1's backward/forward prefetch: Zhao et al. 2023 'PyTorch "
                            "FSDP', Sec. 3.3)",
              "cp_overlap": _TITAN + "parallelism.context_parallel_rotate_method = 'allgather': K/V "
                            "shards all-gathered before the sub-SDPAs, not overlapped",
              "attention_kernel": "torchtitan Llama attention calls F.scaled_dot_product_attention; on "
                                  "Hopper SDPA's flash backend is FlashAttention-2",
              "fused_elementwise": _TITAN + "training.compile = False: eager kernels, one per operator",
              "fused_swiglu": "FeedForward.forward: w2(F.silu(w1(x)) * w3(x)) in eager mode keeps "
                              "w1(x), silu, w3(x) and the product",
              "fp8_saves_inputs": "torchao float8/float8_linear.py matmul_with_hp_or_float8_args.forward: "
                                  "ctx.save_for_backward(input_hp, weight_hp_t) (the BF16 input)",
              "fp8_recipe": _TITAN + "float8.recipe_name = None -> torchao's default Float8LinearConfig "
                            "(tensorwise dynamic scaling); 'rowwise' is the other recipe",
              "expert_loop": "torchtitan models/moe/moe.py GroupedExperts: use_grouped_mm = True -> "
                             "torch._grouped_mm, one kernel for all local experts",
              "grad_reduce": "fp32: " + _TITAN + "training.mixed_precision_reduce = 'float32'",
              "precision": _TITAN + "training.mixed_precision_param = 'bfloat16', "
                           "mixed_precision_reduce = 'float32': FSDP2 keeps fp32 sharded parameters "
                           "and gradients, Adam states fp32: 4 + 4 + 8 bytes/param, BF16 compute copies",
          }),
    Stack("deepspeed", "DeepSpeed ZeRO with a Hugging Face / Megatron-DeepSpeed model",
          tp_overlap=0.0, dp_overlap=0.0, dp_overlap_zero3=1.0, cp_overlap=0.0, attention_kernel="fa2",
          fused_elementwise=False, fused_swiglu=False, fp8_saves_inputs=False, fp8_recipe=None,
          expert_loop=True, precision="zero", moe_dispatcher="flex", tp_overlap_input_grads=True,
          sources={
              "tp_overlap_input_grads": "True: no TP overlap here (tp_overlap 0), so nothing it leaves out",
              "moe_dispatcher": "flex: deepspeed/moe/sharded_moe.py MOELayer.forward applies combine_weights on "
                                "the token's own rank after the second all-to-all: no probabilities all-to-all",
              "tp_overlap": "DeepSpeed has no TP communication overlap (AutoTP all-reduces after the "
                            "row-parallel linear)",
              "dp_overlap": "DeepSpeed config docs, zero_optimization.overlap_comm 'Attempts to overlap "
                            "the reduction of the gradients with backward computation'; DeepSpeedZeroConfig "
                            "overlap_comm: Optional[bool] = None, resolved to True for stage 3 and False "
                            "otherwise (validator overlap_comm_valid)",
              "cp_overlap": "DeepSpeed-Ulysses all-to-alls are not overlapped with attention",
              "attention_kernel": "the model's own: Hugging Face models default to "
                                  "attn_implementation='sdpa' (FlashAttention-2 on Hopper)",
              "fused_elementwise": "no fusion unless the model provides it (eager PyTorch)",
              "fused_swiglu": "eager Hugging Face LlamaMLP: down_proj(act_fn(gate_proj(x)) * up_proj(x))",
              "fp8_saves_inputs": "no FP8 path of its own: GEMM inputs stay BF16",
              "fp8_recipe": "none of its own (FP8 only through a model built on Transformer Engine)",
              "expert_loop": "deepspeed/moe/experts.py Experts.forward: 'for chunk, expert in zip(chunks, "
                             "self.deepspeed_experts)': each local expert's MLP in turn",
              "grad_reduce": "the model's 16-bit dtype: DeepSpeed config communication_data_type, default "
                             "None = the gradients' dtype",
              "precision": "ZeRO paper (Rajbhandari et al. 2020) Sec. 3.1: 2 + 2 + 12 bytes/param; DeepSpeed's "
                           "estimate_zero2_model_states_mem_needs counts the same",
          }),
    Stack("fsdp", "PyTorch FSDP1 as llm-foundry (MosaicML) runs it",
          tp_overlap=0.0, dp_overlap=1.0, dp_overlap_zero3=1.0, cp_overlap=0.0, attention_kernel="fa2",
          fused_elementwise=False, fused_swiglu=False, fp8_saves_inputs=False, fp8_recipe=None,
          expert_loop=False, precision="fsdp-mixed", moe_dispatcher="flex", tp_overlap_input_grads=True,
          sources={
              "tp_overlap_input_grads": "True: no TP overlap here (tp_overlap 0), so nothing it leaves out",
              "moe_dispatcher": "flex: MegaBlocks dMoE (llm-foundry's MoE FFN) scales the expert outputs by the "
                                "router weights on the token's rank (its scatter): no probabilities all-to-all",
              "tp_overlap": "no tensor parallelism in llm-foundry's FSDP recipes",
              "dp_overlap": "llm-foundry yamls fsdp_config: sharding_strategy: FULL_SHARD, "
                            "limit_all_gathers: true, no backward_prefetch given, so FSDP's default "
                            "BackwardPrefetch.BACKWARD_PRE (the next all-gather issued before the current "
                            "gradient computation); all-gathers and reduce-scatters on their own streams",
              "cp_overlap": "no context parallelism",
              "attention_kernel": "llm-foundry MPT yamls attn_config: attn_impl: flash (the flash-attn 2 "
                                  "package)",
              "fused_elementwise": "no torch.compile in llm-foundry's yamls: eager kernels",
              "fused_swiglu": "eager MLP (MPT's ffn_type mptmlp is GELU; a SwiGLU model keeps 4 FFN-wide "
                              "tensors)",
              "fp8_saves_inputs": "no FP8 in these recipes: GEMM inputs stay BF16",
              "fp8_recipe": "none in llm-foundry's FSDP yamls (precision: amp_bf16)",
              "expert_loop": "llm-foundry's MoE FFN is MegaBlocks dMoE: grouped_gemm's gmm, one CUTLASS grouped "
                             "kernel for all local experts",
              "grad_reduce": "fp32, as fsdp-mixed counts the gradient shards; llm-foundry's mixed_precision PURE "
                             "reduces in bf16 (--grad-reduce-dtype bf16)",
              "precision": "llm-foundry fsdp_config mixed_precision: PURE / DEFAULT: FSDP keeps the fp32 "
                           "flat parameter shards (the master weights) and fp32 gradient shards, Adam "
                           "states fp32: 4 + 4 + 8 bytes/param",
          }),
]}
DEFAULT_STACK = "megatron"


def get_stack(stack: "Stack | str | None" = None) -> Stack:
    """A :class:`Stack`, or its name in :data:`STACKS` (None: :data:`DEFAULT_STACK`)."""
    if isinstance(stack, Stack):
        return stack
    name = DEFAULT_STACK if stack is None else stack
    if name not in STACKS:
        raise ValueError(f"unknown stack {name!r}; valid: {', '.join(STACKS)}")
    return STACKS[name]
