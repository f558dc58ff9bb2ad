"""Megatron-LM ``pretrain_gpt.py`` flags of a planned layout.

Source: Megatron-LM ``megatron/training/arguments.py`` at tag ``core_v0.16.1`` (commit 55ac7082, the
release of the installed megatron-core): every flag emitted here was parsed by that file's own
``add_megatron_arguments`` parser (many are generated from ``TransformerConfig``'s fields by
``ArgumentGroupFactory``), and its ``validate_args`` accepted them; the rules quoted are its assertions.
"""
from __future__ import annotations

from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.precision import get_precision
from dtlib.analytic.layout import Parallelism, split_problem
from dtlib.analytic.stages import megatron_layout_string
from dtlib.plan.emit.common import refuse
from dtlib.plan.emit.timed import TimedPlan, as_plan, dp_overlap, precision_bytes, run_options
from dtlib.plan.steptime import StepOptions, resolve

# the planner's FP8 recipes (dtlib.analytic.stacks.FP8_RECIPES) as Megatron-LM's --fp8-recipe
# choices: tensorwise is Transformer Engine's Float8CurrentScaling (torchao's tensorwise is the
# same current per-tensor scaling); torchao's rowwise has none
_FP8_RECIPES = {"delayed": "delayed", "current": "tensorwise", "tensorwise": "tensorwise", "mxfp8": "mxfp8",
                "blockwise": "blockwise"}


def unsupported_here(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = []
    if p.schedule == "gpipe":
        out.append("schedule gpipe: Megatron-LM runs 1F1B or interleaved 1F1B only (no GPipe flag)")
    if p.schedule in ("dualpipe", "dualpipev"):
        out.append(f"schedule {p.schedule}: Megatron-LM runs 1F1B or interleaved 1F1B only (DualPipe and DualPipeV "
                   f"are deepseek-ai/DualPipe's; --overlap-moe-expert-parallel-comm overlaps the all-to-all within 1F1B)")
    # the split rule is Megatron-LM's own (dtlib.analytic.layout.split_problem): even, the first/last
    # stage counts, or a layout string; check_layout has refused any other before this point
    problem = split_problem(m.layers, p.pp, p.virtual_stages, p.first_stage_layers or 0, p.last_stage_layers or 0,
                            p.numbers()["pipeline_layout"], p.account_for_embedding_and_loss) if p.pp > 1 else None
    if problem:
        out.append(problem)
    if p.cp > 1 and m.seq % (2 * p.cp):
        out.append(f"seq {m.seq}: Megatron-LM needs seq-length a multiple of 2 x context-parallel-size = {2 * p.cp}")
    if p.offload == "params":
        out.append("offload params: Megatron-LM has no parameter offload flag for training "
                   "(only --optimizer-cpu-offload for the optimizer)")
    if p.offload == "optimizer" and p.zero >= 2:
        out.append(f"offload optimizer with ZeRO-{p.zero}: Megatron-LM offloads through the distributed optimizer "
                   f"(ZeRO-1) only (OptimizerConfig: precision-aware optimizer only with the distributed optimizer)")
    if m.moe_experts and m.bias and p.tp > 1:
        out.append(f"MoE with biases at tp={p.tp}: Megatron-Core supports expert biases only with expert tensor "
                   f"parallel size 1 (TransformerConfig)")
    if p.shard_size is not None:
        out.append(f"shard_size {p.shard_size}: hybrid sharding is not emitted for Megatron-LM")
    return out + _model_unsupported(m)


def _model_unsupported(m: TransformerConfig) -> list[str]:
    """The model fields pretrain_gpt.py's flags cannot build (arguments.py at core_v0.16.1)."""
    out = []
    if m.position == "alibi":
        out.append("position alibi: --position-embedding-type has no ALiBi (learned_absolute, rope, mrope, "
                   "relative, none)")
    if m.embedding_norm:
        out.append("embedding_norm: pretrain_gpt.py's GPTModel has no norm after the embedding")
    if m.moe_experts and m.router_bias != m.bias:  # TopKRouter: a bias exactly when add_bias_linear
        out.append(f"router_bias={m.router_bias} with bias={m.bias}: Megatron-Core's router has a bias exactly "
                   f"when the linear layers do (--add-bias-linear, moe/router.py)")
    if m.rope_scaling == "yarn" and not m.kv_lora_rank:
        out.append("rope_scaling yarn without MLA: --rope-type yarn is MLA's only (core_transformer_config_from_args: "
                   "'Common attention only support rope_type=\"rope\"')")
    if m.position == "rope" and m.rope_theta != int(m.rope_theta):
        out.append(f"rope_theta {m.rope_theta:g}: --rotary-base takes an integer")
    if m.qk_norm and m.kv_lora_rank:
        out.append("qk_norm with MLA: Megatron's --qk-layernorm is MLA's latent-norm switch there")
    return out


def realize(plan: TimedPlan, o: StepOptions) -> dict[str, tuple[Any, str]]:
    """The timed options Megatron-LM's flags cannot run as they are (see :func:`megatron_flags`)."""
    p, out = plan.layout, {}
    if o.tp_overlap and p.tp > 1 and not p.sequence_parallel:
        out["tp_overlap"] = (0.0, "--tp-comm-overlap needs --sequence-parallel (validate_args), which this "
                                  "layout does not use: re-timed with TP communication exposed")
    if o.ep_overlap and p.ep > 1:
        why = ("pp > 1 needs virtual pipeline stages" if p.pp > 1 and p.schedule != "interleaved" else
               "no full recompute" if p.recompute == "full" or p.recompute_layers else None)
        if why:
            out["ep_overlap"] = (0.0, f"--overlap-moe-expert-parallel-comm needs {why} (Megatron-Core "
                                      f"TransformerConfig): re-timed with the all-to-all exposed")
    if plan.precision == "fp8" and (o.fp8_recipe or "current") not in _FP8_RECIPES:
        out["fp8_recipe"] = ("current", f"{o.fp8_recipe}: Megatron-LM's --fp8-recipe has no such recipe; "
                                        f"emitted tensorwise (current scaling) and re-timed")
    if plan.precision in ("fp8", "nvfp4") and o.bf16_layers:  # Megatron-Core TransformerConfig's checks
        per_stage = plan.model.layers // p.pp
        recipe = out["fp8_recipe"][0] if "fp8_recipe" in out else o.fp8_recipe or "current"
        if plan.precision == "fp8" and recipe == "delayed":
            out["bf16_layers"] = (0, "Megatron-Core refuses --first-last-layers-bf16 with delayed scaling: "
                                     "re-timed with every layer in fp8")
        elif o.bf16_layers > 2 * per_stage:
            out["bf16_layers"] = (2 * per_stage, f"Megatron-Core keeps at most layers / pp = {per_stage} layers "
                                                 f"at each end in BF16: re-timed with {2 * per_stage}")
    # --bf16 (and fp8) keeps fp32 main gradients (arguments.py: accumulate_allreduce_grads_in_fp32
    # = True) unless --grad-reduce-in-bf16 (bf16-mixed); --fp16 adds an fp32 gradient copy:
    # dtlib's megatron-bf16 / bf16-mixed / megatron-fp16 conventions
    runs = "megatron-fp16" if plan.precision == "fp16" else "bf16-mixed" if _bf16_grads(o) else "megatron-bf16"
    if precision_bytes(o.precision) != precision_bytes(runs):
        out["precision"] = (runs, f"Megatron-LM's --{'fp16' if plan.precision == 'fp16' else 'bf16'} keeps "
                                  f"{runs}'s bytes per parameter: re-timed with them")
    return out


def megatron_flags(plan: TimedPlan | Parallelism, model: TransformerConfig | None = None,
                   global_batch: int | None = None, precision: str = "bf16") -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` flags of the timed plan (or of a bare layout, on the
    megatron stack): the layout, the model, the batch, the precision and every option the step
    time used (data, tokenizer and learning-rate flags are the user's)."""
    plan = as_plan(plan, model, global_batch, precision, "megatron")
    refuse("megatron", unsupported_here, plan.layout, plan.model, plan.global_batch, plan.precision)
    o, _ = run_options("megatron", plan, realize)
    p, m, precision, global_batch = plan.layout, plan.model, plan.precision, plan.global_batch
    f = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp),
         "--context-parallel-size", str(p.cp)]
    f += _pipeline_split_flags(p, m)
    if p.ep > 1:
        f += ["--expert-model-parallel-size", str(p.ep)]
    if m.moe_experts:  # always: Megatron-LM's default (None) is etp = tp, dtlib's is 1
        f += ["--expert-tensor-parallel-size", str(p.etp)]
    if p.sequence_parallel:
        f += ["--sequence-parallel"]
    if p.recompute == "full":  # every layer recomputed, one at a time: the planner's "full"
        f += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif p.recompute == "selective" or (p.recompute_modules and not p.recompute_layers):
        # Megatron-Core's default modules are core_attn: dtlib's "selective"
        modules = tuple(dict.fromkeys((("core_attn",) if p.recompute == "selective" else ()) + p.recompute_modules))
        f += ["--recompute-granularity", "selective"]
        f += ["--recompute-modules", *modules] if p.recompute_modules else []
    elif p.recompute_layers:  # the first N layers of each chunk recomputed, the others not
        f += ["--recompute-granularity", "full", "--recompute-method", "block",
              "--recompute-num-layers", str(p.recompute_layers)]
    # ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's optim_grads and
    # optim_grads_params strategies (megatron/core/distributed/fsdp/src/README.md)
    if p.zero == 1:
        f += ["--use-distributed-optimizer"]
    elif p.zero >= 2:
        strategy = "optim_grads" if p.zero == 2 else "optim_grads_params"
        f += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy, "--ckpt-format", "fsdp_dtensor"]
    if p.offload == "optimizer":  # validate_args: offload needs the precision-aware optimizer
        f += ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
    if p.dp * p.cp > 1 and dp_overlap(o, p):  # DP communication hidden behind compute, as timed
        f += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if p.zero >= 1 else [])
    f += _megatron_run_flags(plan, o)
    f += ["--micro-batch-size", str(p.micro_batch_size), "--global-batch-size", str(global_batch)]
    f += ["--num-layers", str(m.layers), "--hidden-size", str(m.hidden), "--num-attention-heads", str(m.heads),
          "--ffn-hidden-size", str(m.ffn), "--seq-length", str(m.seq), "--max-position-embeddings", str(m.seq),
          "--vocab-size", str(m.vocab)]
    if m.kv_heads != m.heads:
        f += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    f += _megatron_variant_flags(m) + _model_flags(plan)
    f += ["--swiglu"] if m.activation == "swiglu" else []
    f += ["--normalization", "RMSNorm"] if m.norm == "rmsnorm" else []
    f += ["--position-embedding-type", "rope"] if m.position == "rope" else []
    f += [] if m.tied_embeddings else ["--untie-embeddings-and-output-weights"]
    f += [] if m.bias else ["--disable-bias-linear"]
    f += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp8": ["--bf16", "--fp8-format", "hybrid",
                                                         "--fp8-recipe", _FP8_RECIPES[o.fp8_recipe or "current"]],
          # Transformer Engine's NVFP4BlockScaling (megatron/core/fp4_utils.py); fp4 honours the BF16 layers too
          "nvfp4": ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]}[precision]
    if precision in ("fp8", "nvfp4") and o.bf16_layers:  # the plan times their share of every layer: the end first, where
        # the NVFP4 paper keeps them (NVIDIA 2025, Sec. 4.1), at most layers / pp each (realize)
        end = min(o.bf16_layers, plan.model.layers // plan.layout.pp)
        f += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(o.bf16_layers - end),
              "--num-layers-at-end-in-bf16", str(end)]
    f += ["--grad-reduce-in-bf16"] if precision != "fp16" and _bf16_grads(o) else []
    return f


def _bf16_grads(o: StepOptions) -> bool:
    """The plan keeps and reduces 2-byte gradients (Megatron-LM ``--grad-reduce-in-bf16``)."""
    return get_precision(resolve(o)[0].precision).grad == 2


def _megatron_run_flags(plan: TimedPlan, o: StepOptions) -> list[str]:
    """The flags of the step-time options (``o``, as :func:`realize` leaves them): TP and EP
    overlap, CP's p2p ring, the MoE dispatcher the planner times (all-to-all or flex, Transformer Engine's
    grouped experts, fused permutation; Megatron's defaults are allgather, a loop of experts and
    unfused), the elementwise fusions (on by default) and the attention kernel."""
    p, m, f = plan.layout, plan.model, []
    if o.tp_overlap and p.tp > 1:
        f += ["--tp-comm-overlap"]
    if o.cp_overlap and p.cp > 1:  # TE's p2p ring sends the next K/V block during attention
        f += ["--cp-comm-type", "p2p"]
    if m.moe_experts:
        # the flex dispatcher with HybridEP, as Megatron-Bridge 25.11's GB200/GB300 recipes run it
        f += (["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep"]
              if o.moe_dispatcher == "flex" else ["--moe-token-dispatcher-type", "alltoall"]) + ["--moe-grouped-gemm"]
        f += ["--moe-permute-fusion"] if o.fused_elementwise else []
        f += ["--overlap-moe-expert-parallel-comm"] if o.ep_overlap and p.ep > 1 else []
    if not o.fused_elementwise:
        f += ["--no-masked-softmax-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
              "--no-bias-swiglu-fusion" if m.activation == "swiglu" else "--no-bias-gelu-fusion"]
    if not o.flash_attention:  # the s x s scores written and read back, as the plan counts them
        f += ["--attention-backend", "unfused"]
    return f


def _model_flags(plan: TimedPlan) -> list[str]:
    """The flags of the fields that change the model but not its shape, written even where they
    equal Megatron-LM's defaults (rotary base 10000, epsilon 1e-5, dropout 0.1, vocabulary padded
    to a multiple of 128 x tp), so the file reads whole: RoPE base and scaling, norm epsilon,
    QK-norm (with MLA the two latent RMSNorms: Megatron-Core's MLA builds q_layernorm and
    kv_layernorm only with qk_layernorm), router scoring, attention sinks (``--softmax-type
    learnable``), the SwiGLU clamp, and dropout: 0 unless the plan counts its masks, then 0.1."""
    m = plan.model
    f = ["--norm-epsilon", f"{m.norm_eps:g}", "--make-vocab-size-divisible-by", "128"]
    if m.position == "rope":
        f += ["--rotary-base", f"{m.rope_theta:.0f}"]
    if m.kv_lora_rank:  # MLA's rope type defaults to yarn: written either way
        f += ["--rope-type", m.rope_scaling if m.rope_scaling == "yarn" else "rope"]
        f += ["--rotary-scaling-factor", f"{m.rope_scaling_factor:g}"] if m.rope_scaling == "yarn" else []
    f += ["--qk-layernorm"] if m.qk_norm or m.kv_lora_rank else []
    if m.moe_experts:
        f += ["--moe-router-score-function", m.router_score]
        f += ["--moe-router-enable-expert-bias"] if m.router_expert_bias else []
        f += ["--moe-router-topk-scaling-factor", f"{m.routed_scaling:g}"] if m.routed_scaling != 1 else []
    f += ["--softmax-type", "learnable"] if m.attention_sinks else []
    f += ["--activation-func-clamp-value", f"{m.activation_clamp:g}"] if m.activation_clamp else []
    dropout = "0.1" if resolve(plan.options, plan.dropout)[1] else "0"
    return f + ["--hidden-dropout", dropout, "--attention-dropout", dropout]


def _pipeline_split_flags(p: Parallelism, m: TransformerConfig) -> list[str]:
    """The pipeline split as Megatron-LM 0.16.1 takes it (arguments.py, TransformerConfig
    ``__post_init__``): a layout string alone (it places the embedding and the loss itself); the
    first/last stage counts with interleaving given as chunks per rank
    (``--num-virtual-stages-per-pipeline-rank``: layers per chunk differ between ranks); or the even
    split, interleaving as layers per chunk, with the account-for flags when the embedding and the
    loss take a slot each."""
    if p.pp == 1:
        return []
    if p.pipeline_layout:
        return ["--pipeline-model-parallel-layout", megatron_layout_string(m, p)]
    if p.first_stage_layers or p.last_stage_layers:
        f = ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)] if p.first_stage_layers else []
        f += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)] if p.last_stage_layers else []
        return f + (["--num-virtual-stages-per-pipeline-rank", str(p.virtual_stages)] if p.virtual_stages > 1 else [])
    f = []
    if p.schedule == "interleaved":
        slots = m.layers + 2 * p.account_for_embedding_and_loss
        f += ["--num-layers-per-virtual-pipeline-stage", str(slots // (p.pp * p.virtual_stages))]
    if p.account_for_embedding_and_loss:
        f += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    return f


def _megatron_variant_flags(m: TransformerConfig) -> list[str]:
    """Megatron-LM flags of the MoE and attention fields (docs/models.md): experts, their width,
    shared experts (``--moe-shared-expert-intermediate-size`` is their summed width), which layers
    are MoE (``--moe-layer-freq`` as a 0/1 list), the capacity factor, MLA's sizes, ``head_dim``
    (``--kv-channels``), the window (``--window-size W,0``: W keys back, none ahead) and its global
    layers (``--window-attn-skip-freq K``: one full-attention layer after K - 1 windowed ones), the
    multi-token-prediction modules (``--mtp-num-layers``)."""
    f = []
    if m.moe_experts:
        f += ["--num-experts", str(m.moe_experts), "--moe-router-topk", str(m.moe_top_k)]
        f += ["--moe-ffn-hidden-size", str(m.moe_ffn)] if m.moe_ffn != m.ffn else []
        if m.moe_shared_experts:
            f += ["--moe-shared-expert-intermediate-size", str(m.moe_shared_experts * m.moe_ffn)]
        if m.moe_layer_freq != 1:
            pattern = [int(i >= m.moe_dense_layers and (i - m.moe_dense_layers) % m.moe_layer_freq == 0)
                       for i in range(m.layers)]
            f += ["--moe-layer-freq", "[" + ",".join(map(str, pattern)) + "]"]
        elif m.moe_dense_layers:  # Megatron evaluates the list expression (moe_freq_type)
            f += ["--moe-layer-freq", f"([0]*{m.moe_dense_layers}+[1]*{m.layers - m.moe_dense_layers})"]
        if m.moe_capacity_factor is not None:
            f += ["--moe-expert-capacity-factor", f"{m.moe_capacity_factor:g}"]
    if m.kv_lora_rank:
        f += ["--multi-latent-attention", "--kv-lora-rank", str(m.kv_lora_rank), "--qk-head-dim",
              str(m.qk_nope_head_dim), "--qk-pos-emb-head-dim", str(m.qk_rope_head_dim), "--v-head-dim",
              str(m.v_head_dim)]
        f += ["--q-lora-rank", str(m.q_lora_rank)] if m.q_lora_rank else []
    elif m.head_dim != m.hidden // m.heads:
        f += ["--kv-channels", str(m.head_dim)]
    if m.sliding_window:
        f += ["--window-size", f"{m.sliding_window},0"]
        f += ["--window-attn-skip-freq", str(m.global_attention_every)] if m.global_attention_every else []
    f += ["--mtp-num-layers", str(m.mtp_layers)] if m.mtp_layers else []  # DeepSeek-V3 Sec. 2.2
    return f


def notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = [f"Megatron-LM derives data-parallel size = world / (tp x pp x cp) = {p.dp}: launch "
             f"{p.gpus} ranks (torchrun --nproc-per-node ... pretrain_gpt.py FLAGS)",
             "--vocab-size is what --tokenizer-type NullTokenizer reads; with a real tokenizer Megatron-LM takes "
             "its size (padded to a multiple of 128 x tp) and the flag can go"]
    if p.tp * p.cp > 1 and p.zero < 2:
        notes.append("tp or cp > 1: validate_args requires CUDA_DEVICE_MAX_CONNECTIONS=1 before Blackwell GPUs")
    if p.zero >= 2:
        notes.append(f"ZeRO-{p.zero} runs as Megatron-FSDP, which validate_args allows only with --ckpt-format "
                     f"fsdp_dtensor and CUDA_DEVICE_MAX_CONNECTIONS != 1")
    if precision == "fp8":
        notes.append("--fp8-format needs Transformer Engine (--transformer-impl transformer_engine, the default)")
    if precision == "nvfp4":
        notes.append("--fp4-format needs Transformer Engine >= 2.7 (validate_args) and a Blackwell GPU")
    if p.offload == "optimizer":
        notes.append("--use-precision-aware-optimizer needs Transformer Engine >= 2.1 (Megatron-Core OptimizerConfig)")
    if m.kv_lora_rank and m.rope_scaling == "yarn":
        notes.append("YaRN's other settings are Megatron's defaults (--mscale 1, --mscale-all-dim 0, beta 32/1, "
                     "original length 4096); HF DeepSeek-V3's rope_scaling has mscale_all_dim 1: add it if you "
                     "load those weights")
    padded = -(-m.vocab // (128 * p.tp)) * 128 * p.tp
    if padded != m.vocab:
        notes.append(f"Megatron-LM pads the vocabulary {m.vocab} to {padded} (a multiple of 128 x tp): "
                     f"{(padded - m.vocab) * m.hidden * (1 if m.tied_embeddings else 2):,} more parameters than "
                     f"the plan counts")
    return notes
