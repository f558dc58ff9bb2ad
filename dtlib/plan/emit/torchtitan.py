"""The torchtitan TOML of a planned layout.

Source: torchtitan ``torchtitan/config/job_config.py`` at tag ``v0.2.2`` (commit 73a0e697, Feb 2026),
the last release configured by TOML: main replaced TOML files with Python ``Trainer.Config``
functions (#2386) and froze the ``--section.key`` flags, whose names are these keys.
:mod:`dtlib.plan.torchtitan_schema` encodes the keys and types read there.
"""
from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import PRESETS
from dtlib.plan.emit.common import GRADIENT_CLIPPING, refuse, variants
from dtlib.plan.emit.timed import TimedPlan, as_plan, dp_overlap, precision_bytes, run_options, without
from dtlib.plan.steptime import StepOptions
from dtlib.plan.torchtitan_schema import check_torchtitan

# the planner's FP8 recipes torchtitan's [quantize.linear.float8] recipe_name runs (torchao's
# dynamic scaling: tensorwise is per-tensor current scaling); the others it has not
_FP8_RECIPES = {"tensorwise": "tensorwise", "current": "tensorwise", "rowwise": "rowwise"}


def unsupported_here(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = []
    flavor = _flavor(m)
    lacks = [] if flavor else _llama3_lacks(m)
    if not flavor and m.name in _FLAVORS:  # a registered flavor's model, changed: name what changed
        preset = PRESETS[m.name]
        lacks = [f"{f.name}={getattr(m, f.name)!r} (torchtitan's {' '.join(_FLAVORS[m.name])}: "
                 f"{getattr(preset, f.name)!r})" for f in fields(m)
                 if f.name not in ("seq", "source") and getattr(m, f.name) != getattr(preset, f.name)] + lacks
    if lacks and _llama3_lacks(m):
        out.append(f"{', '.join(lacks)}: torchtitan's llama3 model has none, and no registered flavor of its "
                   f"other families (deepseek_v3, qwen3, gpt_oss, llama4) is this model")
    elif not flavor:  # torchtitan's get_train_spec refuses a flavor it has not registered
        out.append(f"{', '.join(lacks) + ': ' if lacks else ''}no registered torchtitan v0.2.2 flavor is the model "
                   f"{m.name!r} (llama3 ships 8B, 70B, 405B); register TransformerModelArgs(dim={m.hidden}, "
                   f"n_layers={m.layers}, n_heads={m.heads}, n_kv_heads={m.kv_heads}, vocab_size={m.vocab}, "
                   f"rope_theta={m.rope_theta:g}, norm_eps={m.norm_eps:g}) with an FFN {m.ffn} wide in "
                   f"torchtitan/models/llama3/__init__.py")
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
    if precision == "nvfp4":
        out.append("precision nvfp4: torchtitan v0.2.2's quantize converters are float8 and MX, not NVIDIA's "
                   "NVFP4 recipe")
    if m.seq % (2 * p.tp * p.cp):
        out.append(f"seq {m.seq}: torchtitan needs seq_len divisible by 2 x tp x cp = {2 * p.tp * p.cp} "
                   f"(ParallelDims.seq_len_divisor)")
    slots = m.layers + 2 * p.account_for_embedding_and_loss  # torchtitan's first/last_stage_less_layers
    if p.pp > 1 and slots % (p.pp * p.virtual_stages):
        out.append(f"{slots} layers over {p.pp * p.virtual_stages} pipeline stages: not an even "
                   f"pipeline_parallel_layers_per_stage")
    if m.moe_experts and p.etp not in (1, p.tp):
        out.append(f"etp={p.etp}: torchtitan's expert tensor parallelism is 1 or tp={p.tp} (ParallelDims: "
                   f"\"Currently we only support ETP=TP or ETP=1\")")
    if p.recompute == "selective":
        out.append("recompute selective (Megatron's: core attention recomputed): torchtitan's selective modes "
                   "are per-op ('op': every second matmul saved, recompute='op') or every N-th block; none "
                   "recomputes attention alone")
    if p.shard_size is not None and p.shard_size % p.cp:
        out.append(f"shard_size {p.shard_size}: torchtitan's HSDP shards over dp_shard x cp, cp={p.cp} must divide it")
    if p.schedule == "dualpipe":
        out.append("schedule dualpipe: torch.distributed.pipelining has DualPipeV (one copy of the parameters, "
                   "two chunks per rank in a V), not DualPipe's two directions over two copies")
    return out

# dtlib's presets that are torchtitan v0.2.2's registered (model, flavor)s, read in
# torchtitan/models/{llama3,deepseek_v3,qwen3,gpt_oss}/__init__.py at commit 73a0e697: the TOML
# names a flavor; any other shape is a flavor registered in Python first
_FLAVORS = {"llama3-8b": ("llama3", "8B"), "llama3-70b": ("llama3", "70B"), "llama3-405b": ("llama3", "405B"),
            "deepseek-v2-lite": ("deepseek_v3", "16B"), "deepseek-v3": ("deepseek_v3", "671B"),
            "qwen3-30b-a3b": ("qwen3", "30B-A3B"), "qwen3-235b-a22b": ("qwen3", "235B-A22B"),
            "gpt-oss-120b": ("gpt_oss", "120b")}


def _flavor(m: TransformerConfig) -> tuple[str, str] | None:
    """torchtitan's (model, flavor) that is ``m`` field for field (any sequence length), or None."""
    preset = PRESETS.get(m.name)
    if m.name not in _FLAVORS or preset is None or m.with_(seq=preset.seq) != preset:
        return None
    return _FLAVORS[m.name]


def _llama3_lacks(m: TransformerConfig) -> list[str]:
    """The fields of ``m`` torchtitan's llama3 Transformer (SwiGLU, RMSNorm, RoPE without YaRN, no
    biases, untied embeddings, every layer alike and dense) cannot build."""
    return [name for name, lacking in (
        (f"activation {m.activation}", m.activation != "swiglu"), (f"norm {m.norm}", m.norm != "rmsnorm"),
        (f"position {m.position}", m.position != "rope"), ("bias", m.bias), ("tied_embeddings", m.tied_embeddings),
        ("embedding_norm", m.embedding_norm), ("rope_scaling yarn", m.rope_scaling != "none"),
        ("moe_experts (MoE)", m.moe_experts), ("qk_norm", m.qk_norm), ("attention_sinks", m.attention_sinks),
        ("activation_clamp", m.activation_clamp)) if lacking] + variants(m)


def realize(plan: TimedPlan, o: StepOptions) -> dict[str, tuple[Any, str]]:
    """The timed options torchtitan's TOML cannot run as they are."""
    p = plan.layout
    out = without(o, p, {"tp_overlap": "async TP (enable_async_tensor_parallel) needs torch.compile, not emitted",
                         "cp_overlap": "context_parallel_rotate_method 'allgather' gathers K/V before attention",
                         "ep_overlap": "v0.2.2 has no EP all-to-all overlap key"},
                  fused="compile.enable is not emitted (eager, torchtitan's default)",
                  flash="torchtitan's attention is SDPA")
    if dp_overlap(o, p) != dp_overlap(StepOptions(stack="torchtitan"), p):
        out["dp_overlap"] = (None, "FSDP2 prefetches each block's all-gather and overlaps its reduce-scatter "
                                   "(no key turns it off): re-timed with the torchtitan stack's overlap")
    if plan.precision == "fp8" and (o.fp8_recipe or "current") not in _FP8_RECIPES:
        out["fp8_recipe"] = ("tensorwise", f"{o.fp8_recipe}: torchtitan's float8 recipe_name has tensorwise and "
                                           f"rowwise only: emitted tensorwise and re-timed")
    if plan.precision == "fp8" and o.bf16_layers:
        out["bf16_layers"] = (0, "float8 converts every linear layer but the filter_fqns it names (module names, "
                                 "not first/last layers; none emitted): re-timed with every layer in fp8")
    if precision_bytes(o.precision) != precision_bytes("fsdp-mixed"):
        out["precision"] = ("fsdp-mixed", "FSDP2 mixed precision keeps fp32 parameter and gradient shards "
                                          "(mixed_precision_param bfloat16): re-timed with those bytes")
    if p.ep > 1 and o.moe_dispatcher == "alltoall":
        out["moe_dispatcher"] = ("flex", "torchtitan weights the expert outputs by top_scores on the token's own "
                                             "rank (models/moe/moe.py): "
                                             "no probabilities all-to-all; re-timed without it")
    return out


def torchtitan_document(plan: TimedPlan | Parallelism, model: TransformerConfig | None = None,
                        global_batch: int | None = None, precision: str = "bf16") -> dict[str, dict[str, Any]]:
    """The torchtitan TOML of the timed plan (or of a bare layout, on the torchtitan stack) as
    sections of keys (what :func:`torchtitan_toml` writes)."""
    plan = as_plan(plan, model, global_batch, precision, "torchtitan")
    refuse("torchtitan", unsupported_here, plan.layout, plan.model, plan.global_batch, plan.precision)
    o, _ = run_options("torchtitan", plan, realize)
    p, m, precision, global_batch = plan.layout, plan.model, plan.precision, plan.global_batch
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
    if p.ep > 1:  # the expert tensor parallel size always: dtlib's default 1 is torchtitan's too
        par.update(expert_parallel_degree=p.ep, expert_tensor_parallel_degree=p.etp)
    if p.pp > 1:  # micro-batches are the pipeline's: local batch = micro x m, no accumulation
        par.update(pipeline_parallel_schedule={"1f1b": "1F1B", "gpipe": "GPipe",
                                               "interleaved": "Interleaved1F1B", "dualpipev": "DualPipeV"}[p.schedule],
                   pipeline_parallel_layers_per_stage=(m.layers + 2 * p.account_for_embedding_and_loss)
                   // (p.pp * p.virtual_stages),
                   # the embedding and the output count as a layer each only as the plan balanced them
                   # (torchtitan's default 1 each would add stages to an even split)
                   pipeline_parallel_first_stage_less_layers=int(p.account_for_embedding_and_loss),
                   pipeline_parallel_last_stage_less_layers=int(p.account_for_embedding_and_loss),
                   pipeline_parallel_microbatch_size=p.micro_batch_size)
        local = p.micro_batch_size * p.num_microbatches
    else:  # gradient accumulation: global_batch / (local x dp) steps
        local = p.micro_batch_size
    training: dict[str, Any] = {"local_batch_size": local, "global_batch_size": global_batch, "seq_len": m.seq,
                                "max_norm": GRADIENT_CLIPPING, "mixed_precision_param": "bfloat16"}
    if p.offload == "params":
        training["enable_cpu_offload"] = True
    # the planner's "op" is torchtitan's per-op policy (every second matmul saved)
    ac = {"mode": "selective", "selective_ac_option": "op"} if p.recompute == "op" else {"mode": p.recompute}
    name, flavor = _flavor(m)
    doc = {"model": {"name": name, "flavor": flavor},
           "training": training, "parallelism": par, "activation_checkpoint": ac}
    if precision == "fp8":  # the LM head stays in bf16, as the planner's fp8 assumes
        doc["model"]["converters"] = ["quantize.linear.float8"]  # float8.py register_model_converter
        doc["quantize.linear.float8"] = {"recipe_name": _FP8_RECIPES[o.fp8_recipe or "current"],
                                         "filter_fqns": ["output"]}
    return doc


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(v)  # ints, floats and strings are spelled the same in TOML


def torchtitan_toml(plan: TimedPlan | Parallelism, model: TransformerConfig | None = None,
                    global_batch: int | None = None, precision: str = "bf16") -> str:
    """The torchtitan TOML (``--job.config_file``), checked against :data:`TORCHTITAN_SCHEMA`."""
    doc = torchtitan_document(plan, model, global_batch, precision)
    check_torchtitan(doc)
    return "\n".join(f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items())
                     for section, table in doc.items())


def notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = ["schema: torchtitan v0.2.2 job_config.py (the last TOML release); on main the same keys are "
             "--section.key flags"]
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always shards the norms' activations (SequenceParallel in "
                     "apply_tp): sequence_parallel becomes on (same numbers, less activation memory)")
    return notes
