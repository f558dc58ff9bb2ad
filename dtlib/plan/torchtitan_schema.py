"""torchtitan's TOML configuration schema, encoded, so an emitted config is checked without torchtitan.

torchtitan is not installed here (it needs runtime patches to train on CPU: see
``shared/notes/frameworks-on-cpu.md``), so :func:`check_torchtitan` checks a document against the
sections, keys and value types read from ``torchtitan/config/job_config.py`` at tag ``v0.2.2``
(commit 73a0e697, Feb 2026), the last release configured by TOML files; main replaced them with
Python ``Trainer.Config`` functions (#2386) and kept the names as ``--section.key`` flags. Only the
sections :mod:`dtlib.plan.emit` writes are encoded.
"""
from __future__ import annotations

from typing import Any

__all__ = ["TORCHTITAN_SCHEMA", "check_torchtitan"]

# section -> key -> type, read from torchtitan/config/job_config.py at v0.2.2 (73a0e697): a type
# is a Python type, a tuple of Literal choices, or "list[str]". Only the sections emitted here.
_SCHEDULES = ("1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "PipelineScheduleSingle",
              "PipelineScheduleMulti", "ZBVZeroBubble", "DualPipeV")  # torch.distributed.pipelining get_schedule_class
TORCHTITAN_SCHEMA: dict[str, dict[str, Any]] = {
    "job": {"config_file": str, "dump_folder": str, "description": str},
    "model": {"name": str, "flavor": str, "hf_assets_path": str, "converters": "list[str]"},
    "optimizer": {"name": str, "lr": float, "eps": float, "weight_decay": float,
                  "implementation": ("for-loop", "foreach", "fused")},
    "training": {"dataset": str, "local_batch_size": int, "global_batch_size": int, "seq_len": int,
                 "max_norm": float, "steps": int, "enable_cpu_offload": bool, "dtype": ("bfloat16", "float32"),
                 "mixed_precision_param": ("bfloat16", "float32"), "mixed_precision_reduce": ("float32",)},
    "parallelism": {"data_parallel_replicate_degree": int, "data_parallel_shard_degree": int,
                    "fsdp_reshard_after_forward": ("default", "always", "never"), "tensor_parallel_degree": int,
                    "disable_loss_parallel": bool, "enable_async_tensor_parallel": bool,
                    "pipeline_parallel_degree": int, "pipeline_parallel_layers_per_stage": int,
                    "pipeline_parallel_first_stage_less_layers": int, "pipeline_parallel_last_stage_less_layers": int,
                    "pipeline_parallel_schedule": _SCHEDULES, "pipeline_parallel_microbatch_size": int,
                    "context_parallel_degree": int, "expert_parallel_degree": int,
                    "expert_tensor_parallel_degree": int},
    "activation_checkpoint": {"mode": ("selective", "full", "memory_budget", "none"), "selective_ac_option": str},
    "quantize.linear.float8": {"enable_fsdp_float8_all_gather": bool, "precompute_float8_dynamic_scale_for_fsdp": bool,
                               "recipe_name": ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                               "filter_fqns": "list[str]", "emulate": bool},
}


def check_torchtitan(document: dict[str, Any]) -> None:
    """Raise ValueError naming ``[section] key`` for a section, key or value type that
    :data:`TORCHTITAN_SCHEMA` does not have (a TOML document as ``tomllib`` reads it, dotted
    sections nested)."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, table: dict[str, Any]) -> None:
        for key, value in table.items():
            name = f"{prefix}.{key}" if prefix else key
            if isinstance(value, dict):
                walk(name, value)
            else:
                section, _, leaf = name.rpartition(".")
                flat.setdefault(section, {})[leaf] = value

    walk("", document)
    for section, table in flat.items():
        if section not in TORCHTITAN_SCHEMA:
            raise ValueError(f"[{section}] is not a torchtitan section; valid: {', '.join(TORCHTITAN_SCHEMA)}")
        for key, value in table.items():
            kind = TORCHTITAN_SCHEMA[section].get(key)
            if kind is None:
                raise ValueError(f"[{section}] {key} is not a torchtitan key; valid: "
                                 f"{', '.join(TORCHTITAN_SCHEMA[section])}")
            if isinstance(kind, tuple):
                ok = value in kind
            elif kind == "list[str]":
                ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            elif kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            else:
                ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if not ok:
                want = f"one of {kind}" if isinstance(kind, tuple) else getattr(kind, "__name__", kind)
                raise ValueError(f"[{section}] {key} must be {want}, got {value!r}")
