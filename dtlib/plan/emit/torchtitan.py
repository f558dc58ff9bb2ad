"""The torchtitan TOML of a planned layout.

Source: torchtitan ``torchtitan/config/job_config.py`` at tag ``v0.2.2`` (commit 73a0e697, Feb 2026),
the last release configured by TOML: main replaced TOML files with Python ``Trainer.Config``
functions (#2386) and froze the ``--section.key`` flags, whose names are these keys.
:mod:`dtlib.plan.torchtitan_schema` encodes the keys and types read there.
"""
from __future__ import annotations

import json
from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.plan.emit.common import GRADIENT_CLIPPING, refuse, variants
from dtlib.plan.torchtitan_schema import check_torchtitan


def unsupported_here(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = []
    if variants(m):
        out.append(f"{', '.join(variants(m))}: dtlib emits torchtitan's llama3 model, which has none "
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
    refuse("torchtitan", unsupported_here, layout, model, global_batch, precision)
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


def notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = ["schema: torchtitan v0.2.2 job_config.py (the last TOML release); on main the same keys are "
             "--section.key flags"]
    if m.name not in _TORCHTITAN_FLAVORS:
        notes.append(f"flavor {m.name!r}: register a llama3 flavor with {m.layers} layers, hidden {m.hidden}, "
                     f"{m.heads} heads ({m.kv_heads} KV), ffn {m.ffn}, vocab {m.vocab} (torchtitan ships 8B/70B/405B)")
    if p.tp > 1 and not p.sequence_parallel:
        notes.append("torchtitan's tensor parallelism always shards the norms' activations (SequenceParallel in "
                     "apply_tp): sequence_parallel becomes on (same numbers, less activation memory)")
    return notes
