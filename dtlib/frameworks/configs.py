"""The configs of :mod:`dtlib.plan.emit`, checked by each framework's own config classes.

A config that a framework refuses at launch is a wasted cluster reservation; these checks run the
framework's own validation here, on CPU, before anyone pays:

* DeepSpeed: its ``DeepSpeedConfig`` (batch arithmetic, ZeRO and offload keys), through
  :func:`dtlib.frameworks.deepspeed_config.validate_deepspeed_config`;
* Megatron: Megatron-Core's ``TransformerConfig``/``ModelParallelConfig`` built from the flags,
  through :func:`dtlib.frameworks.megatron_flags.megatron_configs` (Megatron-LM's launch rules in
  ``parse_megatron_flags``), then the model flags on those configs;
* torchtitan: not installed (it runs on CPU only with fragile patches, see docs/frameworks.md), so
  the TOML is parsed with ``tomllib`` and checked against the schema read from its
  ``job_config.py`` (:data:`dtlib.plan.emit.TORCHTITAN_SCHEMA`);
* JAX: every spec built as a ``jax.sharding.PartitionSpec`` on an ``AbstractMesh`` of the emitted
  axis sizes (no devices needed, so a 64-way mesh checks here) and each weight's shard shape
  computed by ``NamedSharding.shard_shape``, which raises on an indivisible dimension.

Frameworks are imported inside the functions, so ``import dtlib`` never needs them.
"""
from __future__ import annotations

import tomllib
from typing import Any

from dtlib.analytic.layout import Parallelism
from dtlib.plan.emit import JAX_AXES, Emitted, check_torchtitan

__all__ = ["check_deepspeed", "check_megatron", "check_torchtitan_toml", "check_jax", "check_emitted"]


def check_deepspeed(config: dict[str, Any], world_size: int) -> Any:
    """DeepSpeed's own ``DeepSpeedConfig`` of ``config`` on ``world_size`` data-parallel ranks."""
    from dtlib.frameworks.deepspeed_config import validate_deepspeed_config

    return validate_deepspeed_config(config, world_size)


# The emitted flags dtlib's Megatron runner does not take (dtlib.frameworks.megatron_flags runs a
# tiny GPT), as the Megatron-Core config fields Megatron-LM sets from them (arguments.py at
# core_v0.16.1 generates most flags from TransformerConfig's field names; --swiglu, --num-experts,
# --disable-bias-linear and --fp8-format are renamed there). flag -> (config, field, value or type).
_MODEL_FLAGS: dict[str, tuple[str, str, Any]] = {
    "--ffn-hidden-size": ("transformer", "ffn_hidden_size", int),
    "--num-query-groups": ("transformer", "num_query_groups", int),
    "--group-query-attention": ("gqa", "", True),
    "--swiglu": ("transformer", "gated_linear_unit", True),
    "--normalization": ("transformer", "normalization", str),
    "--disable-bias-linear": ("transformer", "add_bias_linear", False),
    "--bf16": ("transformer", "bf16", True),
    "--fp16": ("transformer", "fp16", True),
    "--fp8-format": ("transformer", "fp8", str),
    "--expert-model-parallel-size": ("transformer", "expert_model_parallel_size", int),
    "--num-experts": ("transformer", "num_moe_experts", int),
    "--moe-router-topk": ("transformer", "moe_router_topk", int),
    "--use-megatron-fsdp": ("ddp", "use_megatron_fsdp", True),
    "--overlap-param-gather": ("ddp", "overlap_param_gather", True),
    "--data-parallel-sharding-strategy": ("ddp", "data_parallel_sharding_strategy", str),
    "--optimizer-cpu-offload": ("optimizer", "optimizer_cpu_offload", True),
    "--use-precision-aware-optimizer": ("optimizer", "use_precision_aware_optimizer", True),
    "--position-embedding-type": ("choice", "", ("learned_absolute", "rope", "mrope", "relative", "none")),
    "--ckpt-format": ("choice", "", ("torch", "torch_dist", "torch_dcp", "fsdp_dtensor")),
}


def _split_megatron(flags: list[str]) -> tuple[list[str], dict[str, Any]]:
    """(the flags the runner's parser reads, {other flag: its value or True})."""
    from dtlib.frameworks.megatron_flags import SWITCH_FLAGS, VALUE_FLAGS

    runner, other, i = [], {}, 0
    while i < len(flags):
        flag = flags[i]
        takes_value = flag in VALUE_FLAGS or (flag in _MODEL_FLAGS and _MODEL_FLAGS[flag][2] not in (True, False))
        if takes_value and (i + 1 == len(flags) or flags[i + 1].startswith("--")):
            raise ValueError(f"{flag} needs a value")
        value = flags[i + 1] if takes_value else True
        if flag in VALUE_FLAGS or flag in SWITCH_FLAGS:
            runner += [flag] + ([value] if takes_value else [])
        elif flag in _MODEL_FLAGS:
            other[flag] = value
        else:
            raise ValueError(f"unknown Megatron-LM flag {flag!r}")
        i += 2 if takes_value else 1
    return runner, other


def check_megatron(flags: list[str], world_size: int) -> tuple[Any, Any, Any]:
    """Megatron-Core's ``(TransformerConfig, DistributedDataParallelConfig, OptimizerConfig)`` built
    from ``flags`` on ``world_size`` ranks: Megatron-LM's launch rules and the layout through
    :func:`dtlib.frameworks.megatron_flags.megatron_configs`, then the model, precision, Megatron-FSDP
    and offload flags set on those configs (``dataclasses.replace`` runs Megatron-Core's
    ``__post_init__`` checks again, e.g. query groups vs tensor-parallel size)."""
    import dataclasses

    import torch
    import torch.nn.functional as F
    from megatron.core.optimizer import OptimizerConfig

    from dtlib.frameworks.megatron_flags import megatron_configs

    runner, other = _split_megatron(list(flags))
    if "--use-megatron-fsdp" in other and "--overlap-param-gather" in runner:
        # validate_args: --overlap-param-gather needs the distributed optimizer *or* Megatron-FSDP
        # (the runner's parser knows only the former), and --overlap-grad-reduce either way
        runner.remove("--overlap-param-gather")
        if "--overlap-grad-reduce" not in runner:
            raise ValueError("--overlap-param-gather needs --overlap-grad-reduce (Megatron-LM)")
        other["--overlap-param-gather"] = True
    transformer, ddp = megatron_configs(runner, world_size)
    fields: dict[str, dict[str, Any]] = {"transformer": {}, "ddp": {}, "optimizer": {}}
    for flag, value in other.items():
        config, name, kind = _MODEL_FLAGS[flag]
        if config == "choice" and value not in kind:
            raise ValueError(f"{flag} must be one of {', '.join(kind)}, got {value!r}")
        if config in fields and kind is int and not value.isdigit():
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if config in fields:
            fields[config][name] = kind(value) if isinstance(kind, type) else kind
    if "--num-query-groups" in other and "--group-query-attention" not in other:
        raise ValueError("--num-query-groups needs --group-query-attention (Megatron-LM ignores it otherwise)")
    t = fields["transformer"]
    if t.get("gated_linear_unit"):  # Megatron-LM's --swiglu: a gated SiLU MLP
        t["activation_func"] = F.silu
    if t.get("bf16") or t.get("fp16"):
        t["params_dtype"] = torch.bfloat16 if t.get("bf16") else torch.float16
    try:
        transformer = dataclasses.replace(transformer, **t)
        ddp = dataclasses.replace(ddp, **fields["ddp"])
        optimizer = OptimizerConfig(optimizer="adam", bf16=bool(t.get("bf16")), fp16=bool(t.get("fp16")),
                                    use_distributed_optimizer=ddp.use_distributed_optimizer, **fields["optimizer"])
    except (AssertionError, ValueError) as exc:  # Megatron-Core's own refusal, as one line
        raise ValueError(f"Megatron-Core refuses the flags: {str(exc).splitlines()[0]}") from None
    except TypeError as exc:  # utils.is_te_min_version compares None (no Transformer Engine) with a version
        if "NoneType" not in str(exc):
            raise
        raise ValueError("these flags need Transformer Engine (Megatron-Core checks its version), which is not "
                         "installed here: checked up to that point") from None
    return transformer, ddp, optimizer


def check_torchtitan_toml(text: str) -> dict[str, Any]:
    """The TOML parsed (``tomllib``) and checked against torchtitan's schema; the document."""
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the torchtitan TOML does not parse: {exc}") from None
    check_torchtitan(document)
    return document


def check_jax(document: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Each role's ``PartitionSpec`` placed on an ``AbstractMesh`` of the emitted sizes; returns
    each role's (and ``batch``'s first dimension's) per-device shard shape."""
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    mesh = document["mesh"]
    unknown = set(mesh) - set(JAX_AXES)
    if unknown:
        raise ValueError(f"mesh axes {sorted(unknown)} are not {JAX_AXES}")
    abstract = AbstractMesh(tuple(mesh.values()), tuple(mesh))

    def spec(entries: list[Any]) -> PartitionSpec:
        return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in entries))

    shards = {}
    for role, shape in document["shapes"].items():
        try:
            shards[role] = NamedSharding(abstract, spec(document["specs"][role])).shard_shape(tuple(shape))
        except Exception as exc:  # jax's IndivisibleError / DuplicateSpecError: say which role
            raise ValueError(f"jax rejects specs[{role!r}] = {document['specs'][role]} on shape {shape}: "
                             f"{str(exc).splitlines()[0]}") from None
    batch_rows = document["micro_batch_size"] * mesh["data"] * mesh["fsdp"]
    shards["batch"] = NamedSharding(abstract, spec(document["batch"])).shard_shape((batch_rows, 1))
    return shards


def check_emitted(emitted: Emitted, layout: Parallelism) -> str:
    """Run the framework's own check of ``emitted``, the config of ``layout``; one line saying what
    accepted it. A config that was not emitted (unsupported) is an error naming why."""
    if emitted.unsupported:
        raise ValueError(f"{emitted.framework}: nothing to check, the layout is not expressible: "
                         + "; ".join(emitted.unsupported))
    if emitted.framework == "deepspeed":  # DeepSpeed's data-parallel size: world / (tp x pp)
        check_deepspeed(emitted.data, layout.dp)
        return f"accepted by DeepSpeed's DeepSpeedConfig on {layout.dp} data-parallel ranks"
    if emitted.framework == "megatron":
        check_megatron(emitted.data, layout.gpus)
        return f"accepted by Megatron-Core's TransformerConfig on {layout.gpus} ranks"
    if emitted.framework == "torchtitan":
        check_torchtitan_toml(emitted.text)
        return "matches torchtitan's job_config.py schema (v0.2.2)"
    check_jax(emitted.data)
    return "every PartitionSpec divides its weight on a jax.sharding.AbstractMesh"
