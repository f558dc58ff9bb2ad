"""Megatron-LM ``pretrain_gpt.py`` flags of a planned layout.

Source: Megatron-LM ``megatron/training/arguments.py`` at tag ``core_v0.16.1`` (commit 55ac7082, the
release of the installed megatron-core): every flag emitted here was parsed by that file's own
``add_megatron_arguments`` parser (many are generated from ``TransformerConfig``'s fields by
``ArgumentGroupFactory``), and its ``validate_args`` accepted them; the rules quoted are its assertions.
"""
from __future__ import annotations

from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.plan.emit.common import refuse, variants


def unsupported_here(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = []
    if p.schedule == "gpipe":
        out.append("schedule gpipe: Megatron-LM runs 1F1B or interleaved 1F1B only (no GPipe flag)")
    slots = m.layers + 2 * p.account_for_embedding_and_loss  # the embedding and the loss take one each
    if p.pp > 1 and slots % (p.pp * p.virtual_stages):
        what = f"{m.layers} layers" + (" + the embedding and the loss" if p.account_for_embedding_and_loss else "")
        out.append(f"{what} over pp={p.pp} x {p.virtual_stages} chunks: Megatron-LM needs num_layers "
                   f"divisible by the pipeline size (validate_args), or an uneven split dtlib does not choose")
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
    return out

def megatron_flags(layout: Parallelism, model: TransformerConfig, global_batch: int,
                   precision: str = "bf16") -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` flags of the layout, the model's shape, the batch and the
    precision (data, tokenizer and learning-rate flags are the user's)."""
    refuse("megatron", unsupported_here, layout, model, global_batch, precision)
    p, m = layout, model
    f = ["--tensor-model-parallel-size", str(p.tp), "--pipeline-model-parallel-size", str(p.pp),
         "--context-parallel-size", str(p.cp)]
    if p.schedule == "interleaved":
        slots = m.layers + 2 * p.account_for_embedding_and_loss
        f += ["--num-layers-per-virtual-pipeline-stage", str(slots // (p.pp * p.virtual_stages))]
    if p.account_for_embedding_and_loss:
        f += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
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
    if p.dp * p.cp > 1:  # the planner hides DP communication behind compute (StepOptions.dp_overlap)
        f += ["--overlap-grad-reduce"] + (["--overlap-param-gather"] if p.zero >= 1 else [])
    f += ["--micro-batch-size", str(p.micro_batch_size), "--global-batch-size", str(global_batch)]
    f += ["--num-layers", str(m.layers), "--hidden-size", str(m.hidden), "--num-attention-heads", str(m.heads),
          "--ffn-hidden-size", str(m.ffn), "--seq-length", str(m.seq), "--max-position-embeddings", str(m.seq),
          "--vocab-size", str(m.vocab)]
    if m.kv_heads != m.heads:
        f += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    f += _megatron_variant_flags(m)
    f += ["--swiglu"] if m.activation == "swiglu" else []
    f += ["--normalization", "RMSNorm"] if m.norm == "rmsnorm" else []
    f += ["--position-embedding-type", "rope"] if m.position == "rope" else []
    f += [] if m.tied_embeddings else ["--untie-embeddings-and-output-weights"]
    f += [] if m.bias else ["--disable-bias-linear"]
    f += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp8": ["--bf16", "--fp8-format", "hybrid"]}[precision]
    return f


def _megatron_variant_flags(m: TransformerConfig) -> list[str]:
    """Megatron-LM flags of the MoE and attention fields (docs/models.md): experts, their width,
    shared experts (``--moe-shared-expert-intermediate-size`` is their summed width), which layers
    are MoE (``--moe-layer-freq`` as a 0/1 list), the capacity factor, MLA's sizes, ``head_dim``
    (``--kv-channels``), the window (``--window-size W,0``: W keys back, none ahead) and its global
    layers (``--window-attn-skip-freq K``: one full-attention layer after K - 1 windowed ones)."""
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
    if p.offload == "optimizer":
        notes.append("--use-precision-aware-optimizer needs Transformer Engine >= 2.1 (Megatron-Core OptimizerConfig)")
    if m.position == "alibi":
        notes.append("position alibi: pretrain_gpt.py has no ALiBi; pick --position-embedding-type yourself")
    return notes
