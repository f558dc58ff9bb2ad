"""A planned layout written as each framework's real launch configuration.

:func:`emit` turns the planner's :class:`~dtlib.analytic.layout.Parallelism` (with the model, the
global batch and the precision) into Megatron-LM's ``pretrain_gpt.py`` flags, a DeepSpeed JSON, a
torchtitan TOML or a JAX mesh with a ``PartitionSpec`` per weight role. Where a framework cannot
express the layout, the result carries one line per reason in ``unsupported`` and no config: a
config that silently runs another layout is worse than none. ``notes`` say what the config leaves
to the user's code, or what the framework does differently but equivalently. Pure Python: the
framework's own config classes check these configs in :mod:`dtlib.frameworks.configs`.

Sources, read for the names below (re-check them when a framework moves):

* Megatron-LM ``megatron/training/arguments.py`` at tag ``core_v0.16.1`` (commit 55ac7082, the
  release of the installed megatron-core): every flag emitted here was parsed by that file's own
  ``add_megatron_arguments`` parser (many are generated from ``TransformerConfig``'s fields by
  ``ArgumentGroupFactory``), and that file's ``validate_args`` accepted the flags of an FSDP, a
  TP x PP interleaved + SP, a TP x CP + offload, a GPT-3 3D and an expert-parallel MoE layout
  (bf16 and fp8); the rules quoted are its assertions.
* DeepSpeed 0.19 ``deepspeed/runtime/config.py`` and ``constants.py`` (the installed version).
* torchtitan ``torchtitan/config/job_config.py`` at tag ``v0.2.2`` (commit 73a0e697, Feb 2026),
  the last release configured by TOML: main (commit b5bcd76, Aug 2026) replaced TOML files with
  Python ``Trainer.Config`` functions (#2386) and froze the ``--section.key`` flags, whose names are
  these keys. :mod:`dtlib.plan.torchtitan_schema` encodes the keys and types read there.
* JAX: the mesh axes and weight roles are those :func:`dtlib.frameworks.jax_gspmd.run_jax` takes.

About 590 lines: four emitters that share one layout check and one refusal path, each with the
list of what its framework cannot express next to the config it writes (read side by side); the
Megatron emitter also writes the MoE, MLA and sliding-window flags and the memory options
(block recompute, balanced pipeline) that the others refuse by name. Split by framework, each
file would repeat the check and the refusal path that keep the four consistent.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism, check_layout
from dtlib.plan.torchtitan_schema import TORCHTITAN_SCHEMA, check_torchtitan

__all__ = ["FRAMEWORKS", "FILENAMES", "PRECISIONS", "Emitted", "emit", "unsupported", "megatron_flags",
           "deepspeed_config", "torchtitan_toml", "torchtitan_document", "jax_mesh", "check_torchtitan",
           "TORCHTITAN_SCHEMA", "JAX_AXES", "JAX_ROLES", "emit_all", "emitted_lines", "check_emit_options"]

FRAMEWORKS = ("megatron", "deepspeed", "torchtitan", "jax")
FILENAMES = {"megatron": "megatron_flags.txt", "deepspeed": "ds_config.json", "torchtitan": "torchtitan.toml",
             "jax": "jax_mesh.json"}
PRECISIONS = ("bf16", "fp16", "fp8")
JAX_AXES = ("data", "fsdp", "model")
JAX_ROLES = ("embed", "attn.qkv", "attn.out", "mlp.up", "mlp.down", "norm", "head")
# the optimizer block of the DeepSpeed JSON: AdamW as GPT-3 and Llama trained (Brown et al. 2020,
# App. B: beta2 0.95, weight decay 0.1; Touvron et al. 2023, Sec. 2.2); lr is the user's choice.
ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
# written out, not left to defaults: DeepSpeed 0.19 clips at 1.0 when the key is absent
# (constants.GRADIENT_CLIPPING_DEFAULT), Megatron-LM's --clip-grad and torchtitan's max_norm also
# default to 1.0, GPT-3 and Llama clip at 1.0. Stated, so that a reader sees it and can set 0.0.
GRADIENT_CLIPPING = 1.0


@dataclass(frozen=True)
class Emitted:
    """One framework's config for one layout: ``text`` (the file's content) and ``data`` (flags,
    dict), or, when ``unsupported`` is not empty, neither (one line per reason)."""
    framework: str
    text: str
    data: Any
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def filename(self) -> str:
        return FILENAMES[self.framework]

    def to_dict(self) -> dict[str, Any]:
        return {"framework": self.framework, "file": self.filename, "text": self.text, "data": self.data,
                "unsupported": self.unsupported, "notes": self.notes}


def _check(layout: Parallelism, model: TransformerConfig, global_batch: int, precision: str) -> None:
    """The inputs are a valid layout of ``model`` whose batch multiplies out to ``global_batch``."""
    if not isinstance(layout, Parallelism):
        raise ValueError(f"layout must be a dtlib.analytic.layout.Parallelism, got {layout!r}")
    if not isinstance(model, TransformerConfig):
        raise ValueError(f"model must be a dtlib.analytic.config.TransformerConfig, got {model!r}")
    validate.integer("global_batch", global_batch)
    validate.one_of("precision", precision, PRECISIONS)
    check_layout(layout.numbers(**model.numbers()), layout.schedule, layout.offload,
                 layout.account_for_embedding_and_loss)
    if layout.global_batch != global_batch:
        raise ValueError(f"global_batch={global_batch} but the layout's dp x micro_batch_size x num_microbatches "
                         f"= {layout.dp}x{layout.micro_batch_size}x{layout.num_microbatches} = {layout.global_batch}")


def unsupported(framework: str, layout: Parallelism, model: TransformerConfig, global_batch: int,
                precision: str = "bf16") -> list[str]:
    """Why ``framework`` cannot express ``layout`` (one line each; empty when it can)."""
    validate.one_of("framework", framework, FRAMEWORKS)
    _check(layout, model, global_batch, precision)
    return _memory_options_unsupported(framework, layout) + _UNSUPPORTED[framework](layout, model, precision)


def _memory_options_unsupported(framework: str, p: Parallelism) -> list[str]:
    """The layout options of docs/stacks.md ("memory that admits what ran") a framework's config
    is not emitted with: Megatron-LM takes partial recompute of the other layers with none
    (``--recompute-method block``) and the balanced split; nothing else is emitted yet."""
    megatron = framework == "megatron"
    out = []
    if p.recompute == "op":
        out.append("recompute op (torchtitan's per-op checkpointing) is not emitted")
    if p.recompute_layers and not (megatron and p.recompute == "none"):
        out.append(f"recompute_layers={p.recompute_layers} with recompute={p.recompute!r} is not emitted for "
                   f"{framework}" + (" (Megatron-LM's block method leaves the other layers unrecomputed: "
                                     "use recompute='none')" if megatron else ""))
    if p.account_for_embedding_and_loss and not megatron:
        out.append(f"account_for_embedding_and_loss is not emitted for {framework}")
    if p.activation_offload_layers:
        out.append(f"activation_offload_layers is not emitted for {framework}")
    if p.recompute_modules and not (megatron and not p.recompute_layers):
        out.append(f"recompute_modules is not emitted for {framework}" + (
            " with recompute_layers (Megatron-LM takes one --recompute-granularity)" if megatron else ""))
    return out


def _refuse(framework: str, layout: Parallelism, model: TransformerConfig, global_batch: int, precision: str) -> None:
    reasons = unsupported(framework, layout, model, global_batch, precision)
    if reasons:
        raise ValueError(f"{framework} cannot express this layout: " + "; ".join(reasons))


# ---- Megatron-LM ---------------------------------------------------------------------------------------
def _megatron_unsupported(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
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
    _refuse("megatron", layout, model, global_batch, precision)
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


def _megatron_notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
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


# ---- DeepSpeed ------------------------------------------------------------------------------------------
def _deepspeed_unsupported(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = []
    if p.cp > 1:
        out.append(f"cp={p.cp}: DeepSpeed has no ring context parallelism (DeepSpeed-Ulysses splits the "
                   f"sequence with all-to-all over heads: another algorithm)")
    if p.schedule != "1f1b" and p.pp > 1:
        out.append(f"schedule {p.schedule}: DeepSpeed's PipelineEngine runs its 1F1B TrainSchedule only")
    if p.pp > 1 and p.zero >= 2:
        out.append(f"ZeRO-{p.zero} with pp={p.pp}: DeepSpeed refuses it (pipe/engine.py: \"ZeRO-2 and ZeRO-3 "
                   f"are incompatible with pipeline parallelism\")")
    if precision == "fp8":
        out.append("precision fp8: DeepSpeed's config has bf16 and fp16 only; FP8 matmuls come from "
                   "Transformer Engine layers in the model's code")
    if p.shard_size is not None:
        out.append(f"shard_size {p.shard_size}: hybrid sharding (DeepSpeed MiCS) is not emitted")
    return out

def deepspeed_config(layout: Parallelism, model: TransformerConfig, global_batch: int, precision: str = "bf16",
                     *, gradient_clipping: float = GRADIENT_CLIPPING) -> dict[str, Any]:
    """The DeepSpeed JSON: batch sizes (DeepSpeed checks train_batch_size = micro x accumulation x
    its data-parallel size), ZeRO stage and offload, precision, clipping and an AdamW block."""
    _refuse("deepspeed", layout, model, global_batch, precision)
    validate.number("gradient_clipping", gradient_clipping, minimum=0, exclusive=False)
    p = layout
    zero: dict[str, Any] = {"stage": p.zero}
    if p.zero >= 1:  # overlap the reduce with backward, and keep gradients in one buffer (DeepSpeed docs)
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if p.offload in ("optimizer", "params"):  # ZeRO-Offload (Ren et al. 2021): optimizer and its gradients
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if p.offload == "params":  # ZeRO-Infinity: the parameter shards too (stage 3)
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config: dict[str, Any] = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch_size,
        "gradient_accumulation_steps": p.num_microbatches,
        "zero_optimization": zero,
        "gradient_clipping": float(gradient_clipping),
        "optimizer": {"type": "AdamW", "params": dict(ADAMW)},
    }
    if precision in ("bf16", "fp16"):
        config[precision] = {"enabled": True}
    if p.recompute == "full":  # DeepSpeed's checkpointing settings; the model calls deepspeed.checkpointing.checkpoint
        config["activation_checkpointing"] = {"partition_activations": p.tp > 1, "contiguous_memory_optimization": False}
    return config


def _deepspeed_notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = [f"gradient_clipping {GRADIENT_CLIPPING} written out: DeepSpeed 0.19 clips at 1.0 when the key is "
             f"absent; set 0.0 to train without clipping"]
    if p.tp * p.pp > 1:
        notes.append(f"DeepSpeed alone runs DP x ZeRO: its data-parallel size is world / (tp x pp), so tp={p.tp}, "
                     f"pp={p.pp} need Megatron-DeepSpeed (its flags carry them; this JSON is its --deepspeed_config)")
    if p.ep > 1:
        notes.append(f"ep={p.ep}: DeepSpeed-MoE takes ep_size in the model's deepspeed.moe.layer.MoE(...), not the JSON")
    if p.sequence_parallel:
        notes.append("sequence parallelism is Megatron-DeepSpeed's --sequence-parallel, not a JSON key")
    if p.recompute != "none":
        notes.append(f"recompute {p.recompute}: the model's code decides what to recompute "
                     f"(deepspeed.checkpointing.checkpoint per block for full)")
    return notes


# ---- torchtitan ----------------------------------------------------------------------------------------
def _variants(m: TransformerConfig) -> list[str]:
    """The fields of ``m`` beyond a Llama/GPT block with every MLP alike (docs/models.md)."""
    return [name for name, used in (
        ("moe_ffn", m.moe_ffn not in (None, m.ffn)), ("moe_shared_experts", m.moe_shared_experts),
        ("moe_dense_layers", m.moe_dense_layers), ("moe_layer_freq", m.moe_layer_freq != 1),
        ("kv_lora_rank (MLA)", m.kv_lora_rank), ("head_dim", m.head_dim != m.hidden // m.heads),
        ("sliding_window", m.sliding_window)) if used]


def _torchtitan_unsupported(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = []
    if _variants(m):
        out.append(f"{', '.join(_variants(m))}: dtlib emits torchtitan's llama3 model, which has none "
                   f"(torchtitan's deepseek_v3 and qwen3 models are not emitted)")
    if p.zero == 1:
        out.append("ZeRO-1: torchtitan shards with FSDP2 only, i.e. ZeRO-2 (reshard_after_forward never) or "
                   "ZeRO-3; no key shards the optimizer state alone")
    if p.zero == 0 and p.dp > 1 and p.tp * p.pp * p.cp > 1:
        out.append(f"ZeRO-0 (DDP) over dp={p.dp} with tp/pp/cp > 1: torchtitan's DDP runs only as the sole "
                   f"parallelism (parallelize.py: \"DDP has not supported > 1D parallelism\")")
    if p.zero == 0 and p.cp > 1:
        out.append(f"ZeRO-0 with cp={p.cp}: torchtitan shards the parameters over the context-parallel ranks "
                   f"with FSDP2 whenever cp > 1 (ParallelDims.fsdp_enabled)")
    if p.offload == "optimizer":
        out.append("offload optimizer: torchtitan's training.enable_cpu_offload moves parameters, gradients "
                   "and optimizer state together (FSDP2 CPUOffloadPolicy); optimizer alone has no key")
    if precision == "fp16":
        out.append("precision fp16: torchtitan's mixed_precision_param is bfloat16 or float32")
    if m.seq % (2 * p.tp * p.cp):
        out.append(f"seq {m.seq}: torchtitan needs seq_len divisible by 2 x tp x cp = {2 * p.tp * p.cp} "
                   f"(ParallelDims.seq_len_divisor)")
    if p.pp > 1 and m.layers % (p.pp * p.virtual_stages):
        out.append(f"{m.layers} layers over {p.pp * p.virtual_stages} pipeline stages: not an even "
                   f"pipeline_parallel_layers_per_stage")
    if p.shard_size is not None and p.shard_size % p.cp:
        out.append(f"shard_size {p.shard_size}: torchtitan's HSDP shards over dp_shard x cp, cp={p.cp} must divide it")
    return out

# torchtitan's registered Llama 3 flavors (torchtitan/models/llama3/__init__.py) for dtlib's presets
_TORCHTITAN_FLAVORS = {"llama3-8b": "8B", "llama3-70b": "70B", "llama3-405b": "405B"}


def torchtitan_document(layout: Parallelism, model: TransformerConfig, global_batch: int,
                        precision: str = "bf16") -> dict[str, dict[str, Any]]:
    """The torchtitan TOML as sections of keys (what :func:`torchtitan_toml` writes)."""
    _refuse("torchtitan", layout, model, global_batch, precision)
    p, m = layout, model
    # FSDP2 shards over dp_shard x cp; ZeRO-3 reshards after forward (torchtitan's default for
    # non-last blocks), ZeRO-2 keeps the gathered parameters until backward: PyTorch's
    # SHARD_GRAD_OP (dtlib.analytic.layout.FSDP_STRATEGIES).
    if p.zero == 0:
        replicate, shard = p.dp, 1
    elif p.shard_size is None:
        replicate, shard = 1, p.dp
    else:  # HSDP: shard within shard_size ranks (dp_shard x cp of them), replicate across
        replicate, shard = p.dp * p.cp // p.shard_size, p.shard_size // p.cp
    par: dict[str, Any] = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
                           "tensor_parallel_degree": p.tp, "pipeline_parallel_degree": p.pp,
                           "context_parallel_degree": p.cp}
    if p.zero == 2:
        par["fsdp_reshard_after_forward"] = "never"
    if p.ep > 1:
        par["expert_parallel_degree"] = p.ep
    if p.pp > 1:  # micro-batches are the pipeline's: local batch = micro x m, no accumulation
        par.update(pipeline_parallel_schedule={"1f1b": "1F1B", "gpipe": "GPipe",
                                               "interleaved": "Interleaved1F1B"}[p.schedule],
                   pipeline_parallel_layers_per_stage=m.layers // (p.pp * p.virtual_stages),
                   pipeline_parallel_microbatch_size=p.micro_batch_size)
        local = p.micro_batch_size * p.num_microbatches
    else:  # gradient accumulation: global_batch / (local x dp) steps
        local = p.micro_batch_size
    training: dict[str, Any] = {"local_batch_size": local, "global_batch_size": global_batch, "seq_len": m.seq,
                                "max_norm": GRADIENT_CLIPPING, "mixed_precision_param": "bfloat16"}
    if p.offload == "params":
        training["enable_cpu_offload"] = True
    # Megatron's selective recompute keeps the matmuls and recomputes the rest: torchtitan's "op" policy
    ac = {"mode": p.recompute} | ({"selective_ac_option": "op"} if p.recompute == "selective" else {})
    doc = {"model": {"name": "llama3", "flavor": _TORCHTITAN_FLAVORS.get(m.name, m.name)},
           "training": training, "parallelism": par, "activation_checkpoint": ac}
    if precision == "fp8":  # the LM head stays in bf16, as the planner's fp8 assumes
        doc["model"]["converters"] = ["float8"]
        doc["quantize.linear.float8"] = {"filter_fqns": ["output"]}
    return doc


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # ints, floats and strings are spelled the same in TOML


def torchtitan_toml(layout: Parallelism, model: TransformerConfig, global_batch: int, precision: str = "bf16") -> str:
    """The torchtitan TOML (``--job.config_file``), checked against :data:`TORCHTITAN_SCHEMA`."""
    doc = torchtitan_document(layout, model, global_batch, precision)
    check_torchtitan(doc)
    return "\n".join(f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items())
                     for section, table in doc.items())


def _torchtitan_notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = ["schema: torchtitan v0.2.2 job_config.py (the last TOML release); on main the same keys are "
             "--section.key flags"]
    if m.name not in _TORCHTITAN_FLAVORS:
        notes.append(f"flavor {m.name!r}: register a llama3 flavor with {m.layers} layers, hidden {m.hidden}, "
                     f"{m.heads} heads ({m.kv_heads} KV), ffn {m.ffn}, vocab {m.vocab} (torchtitan ships 8B/70B/405B)")
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always shards the norms' activations (SequenceParallel in "
                     "apply_tp): sequence_parallel becomes on (same numbers, less activation memory)")
    return notes


# ---- JAX -------------------------------------------------------------------------------------------------
def _jax_unsupported(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = [f"{name}={size}: not expressed by a GSPMD mesh of weights here (pipelining and ring attention "
           f"are program structure, not a PartitionSpec)" for name, size in (("pp", p.pp), ("cp", p.cp)) if size > 1]
    if p.ep > 1:
        out.append(f"ep={p.ep}: the weight roles are a dense transformer's; experts are not laid out here")
    if _variants(m):
        out.append(f"{', '.join(_variants(m))}: the weight roles are a Llama/GPT block's")
    if p.offload != "none":
        out.append(f"offload {p.offload}: a mesh places arrays on devices only")
    sizes = dict(zip(JAX_AXES, _jax_sizes(p)))
    specs = _jax_specs(*sizes.values())
    for role, shape in _jax_shapes(m).items():
        for dim, axes in zip(shape, specs[role]):
            parts = 1
            for a in [axes] if isinstance(axes, str) else axes or []:
                parts *= sizes[a]
            if dim % parts:
                out.append(f"{role} dimension {dim} is not divisible by its {parts} shards ({axes}); pad it "
                           f"(Megatron-LM pads the vocabulary to a multiple of 128 x tp)")
    return out

def _jax_sizes(p: Parallelism) -> tuple[int, int, int]:
    """(data, fsdp, model): replicas without ZeRO go to ``data``, sharded ones to ``fsdp`` (hybrid:
    shard_size of them), tensor parallelism to ``model``."""
    if p.zero == 0:
        return p.dp, 1, p.tp
    shard = p.dp if p.shard_size is None else p.shard_size
    return p.dp // shard, shard, p.tp


def _jax_shapes(m: TransformerConfig) -> dict[str, tuple[int, ...]]:
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim  # 3 x hidden without GQA
    return {"embed": (m.vocab, m.hidden), "attn.qkv": (m.hidden, qkv), "attn.out": (m.hidden, m.hidden),
            "mlp.up": (m.hidden, m.ffn), "mlp.down": (m.ffn, m.hidden), "norm": (m.hidden,),
            "head": (m.hidden, m.vocab)}


def _jax_specs(data: int, fsdp: int, model: int) -> dict[str, list[Any]]:
    """Megatron's split on ``model`` (column-parallel: output dim; row-parallel and the vocabulary-
    parallel embedding: input dim, Shoeybi et al. 2019, Sec. 3) and FSDP's on the other dim."""
    f = "fsdp" if fsdp > 1 else None
    t = "model" if model > 1 else None
    column, row = [f, t], [t, f]
    return {"embed": row, "attn.qkv": column, "attn.out": row, "mlp.up": column, "mlp.down": row,
            "norm": [f], "head": column}


def jax_mesh(layout: Parallelism, model: TransformerConfig, global_batch: int, precision: str = "bf16") -> dict[str, Any]:
    """``{"mesh": {axis: size}, "specs": {role: spec}, "batch": spec, "shapes": {role: shape}}``:
    each spec one entry per dimension (None, an axis name, or a list of axis names), what
    :func:`dtlib.frameworks.jax_gspmd.run_jax` takes."""
    _refuse("jax", layout, model, global_batch, precision)
    data, fsdp, tp = _jax_sizes(layout)
    batch_axes = [a for a, n in (("data", data), ("fsdp", fsdp)) if n > 1]
    batch = [batch_axes[0] if len(batch_axes) == 1 else batch_axes or None, None]
    return {"mesh": dict(zip(JAX_AXES, (data, fsdp, tp))), "specs": _jax_specs(data, fsdp, tp),
            "batch": batch, "shapes": {k: list(v) for k, v in _jax_shapes(model).items()},
            "micro_batch_size": layout.micro_batch_size, "num_microbatches": layout.num_microbatches,
            "dtype": {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}[precision]}


def _jax_notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = ["mesh axes as jax.make_mesh(..., axis_types=(AxisType.Auto,) * 3): XLA inserts the collectives"]
    if p.zero in (1, 2):
        notes.append(f"ZeRO-{p.zero} has no exact GSPMD equivalent: the fsdp axis shards parameters too (ZeRO-3)")
    if p.sequence_parallel:
        notes.append("sequence parallelism is a sharding constraint on activations, not on weights: not in these specs")
    if precision == "fp8":
        notes.append("fp8: matmul precision is the program's (e.g. jax.nn.scaled_matmul); the weights stay bfloat16")
    if p.num_microbatches > 1:
        notes.append(f"{p.num_microbatches} micro-batches are a loop (gradient accumulation) in the training step")
    return notes


def _json(data: dict[str, Any]) -> str:
    """JSON with one top-level key per line: short enough to read, still one valid document."""
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n"


def _flag_lines(flags: list[str]) -> str:
    """One flag (and its value) per line, continued with backslashes, as a launch script has them."""
    lines: list[str] = []
    for word in flags:
        if word.startswith("--") or not lines:
            lines.append(word)
        else:
            lines[-1] += f" {word}"
    return " \\\n".join(lines) + "\n"


# ---- one entry point -------------------------------------------------------------------------------------
_UNSUPPORTED = {"megatron": _megatron_unsupported, "deepspeed": _deepspeed_unsupported,
                "torchtitan": _torchtitan_unsupported, "jax": _jax_unsupported}
_NOTES = {"megatron": _megatron_notes, "deepspeed": _deepspeed_notes, "torchtitan": _torchtitan_notes,
          "jax": _jax_notes}


def emit(framework: str, layout: Parallelism, model: TransformerConfig, global_batch: int,
         precision: str = "bf16") -> Emitted:
    """``framework``'s config of ``layout`` (see the module docstring), or why it cannot be written."""
    reasons = unsupported(framework, layout, model, global_batch, precision)
    if reasons:
        return Emitted(framework, "", None, reasons, [])
    notes = _NOTES[framework](layout, model, precision)
    if framework == "megatron":
        data = megatron_flags(layout, model, global_batch, precision)
        return Emitted(framework, _flag_lines(data), data, [], notes)
    if framework == "deepspeed":
        data = deepspeed_config(layout, model, global_batch, precision)
        return Emitted(framework, _json(data), data, [], notes)
    if framework == "torchtitan":
        data = torchtitan_document(layout, model, global_batch, precision)
        return Emitted(framework, torchtitan_toml(layout, model, global_batch, precision), data, [], notes)
    data = jax_mesh(layout, model, global_batch, precision)
    return Emitted(framework, _json(data), data, [], notes)


def check_emit_options(frameworks: list[str] | None, directory: str | None, rehearse: bool) -> None:
    """The command line's ``--emit``/``--emit-dir``/``--rehearse``, checked before anything runs."""
    for flag, given in (("--emit-dir", directory is not None), ("--rehearse", rehearse)):
        if given and not frameworks:
            raise ValueError(f"{flag} needs --emit FRAMEWORK (one of {', '.join(FRAMEWORKS)})")
    if directory is not None and Path(directory).exists() and not Path(directory).is_dir():
        raise ValueError(f"--emit-dir {directory} is a file; give a directory (created if missing)")


def emit_all(frameworks: list[str], layout: Parallelism, model: TransformerConfig, global_batch: int,
             precision: str = "bf16", directory: str | None = None) -> dict[str, dict[str, Any]]:
    """:func:`emit` for each framework (once each, in order) as dicts; with ``directory``, each
    expressible config is also written there under :data:`FILENAMES` (key ``written``)."""
    out = {f: emit(f, layout, model, global_batch, precision).to_dict() for f in dict.fromkeys(frameworks)}
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for e in out.values():
            if e["text"]:
                e["written"] = str(Path(directory) / e["file"])
                Path(e["written"]).write_text(e["text"])
    return out


def emitted_lines(emitted: dict[str, dict[str, Any]]) -> list[str]:
    """The text of :func:`emit_all`'s result: each config (indented) with its notes, or why not."""
    lines = []
    for name, e in emitted.items():
        if e["unsupported"]:
            lines += [f"{name}: cannot express layout #1:"] + [f"  - {r}" for r in e["unsupported"]]
            continue
        where = f", written to {e['written']}" if "written" in e else ""
        lines += ([f"{name} ({e['file']}) of layout #1{where}:"] + [("  " + x).rstrip() for x in e["text"].rstrip().splitlines()]
                  + [f"  note: {n}" for n in e["notes"]])
    return lines
