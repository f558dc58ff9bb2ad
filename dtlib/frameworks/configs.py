"""The configs of :mod:`dtlib.plan.emit`, checked by each framework's own config classes.

A config that a framework refuses at launch is a wasted cluster reservation; these checks run the
framework's own validation here, on CPU, before anyone pays:

* DeepSpeed: its ``DeepSpeedConfig`` (batch arithmetic, ZeRO and offload keys), through
  :func:`dtlib.frameworks.deepspeed_config.validate_deepspeed_config`;
* Megatron: each flag read against Megatron-LM's argument list recorded from its own parser at
  ``core_v0.16.1`` (:mod:`dtlib.frameworks.megatron_args`) with ``validate_args``' rules, then
  Megatron-Core's ``TransformerConfig``/DDP/optimizer configs built from the arguments, and the
  model itself on the meta device (:mod:`dtlib.frameworks.megatron_meta`);
* torchtitan: the TOML parsed with ``tomllib`` and checked against the schema read from its
  ``job_config.py`` (:data:`dtlib.plan.emit.TORCHTITAN_SCHEMA`), then, where torchtitan 0.2.2 is
  installed, parsed by its ``ConfigManager`` and its model built on meta
  (:mod:`dtlib.frameworks.torchtitan_check`);
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


def _from_args(cls: type, args: dict[str, Any], **fixed: Any) -> Any:
    """``cls`` built from every argument named like one of its fields, as Megatron-LM builds its
    DDP and optimizer configs (training.py ``get_model``, ``get_megatron_optimizer_config``)."""
    import dataclasses

    kw = {f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args and f.init}
    return cls(**{**kw, **fixed})


def _te_version() -> Any:
    from megatron.core.utils import get_te_version

    try:
        return get_te_version()
    except Exception:  # noqa: BLE001 -- Megatron-Core raises whatever importing TE raised
        return None


def check_megatron(flags: list[str], world_size: int) -> tuple[Any, Any, Any]:
    """Megatron-Core's ``(TransformerConfig, DistributedDataParallelConfig, OptimizerConfig)`` of
    ``flags`` on ``world_size`` ranks: every flag read against Megatron-LM's own argument list at
    core_v0.16.1 (:mod:`dtlib.frameworks.megatron_args`: name, arity, type, choices), the
    ``validate_args`` rules those flags reach, then Megatron-Core's own config classes built from the
    arguments as Megatron-LM builds them (their ``__post_init__`` checks run)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from dtlib.frameworks.megatron_args import parse_args, validate
    from dtlib.frameworks.megatron_meta import megatron_transformer_config

    args = parse_args(list(flags))
    validate(args, world_size)
    transformer = megatron_transformer_config(args)
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.uint8}
    for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
        args[name] = dtypes[args[name]]  # validate_args l. 645-653 maps the names to torch dtypes
    # OptimizerConfig's precision-aware optimizer asks Transformer Engine's version (>= 2.1); with no
    # TE here that check cannot run, so the rest of the config is checked without it
    te_free = {"use_precision_aware_optimizer": False} if _te_version() is None else {}
    try:
        ddp = _from_args(DistributedDataParallelConfig, args)
        optimizer = _from_args(OptimizerConfig, args, params_dtype=transformer.params_dtype, **te_free)
    except (AssertionError, ValueError) as exc:  # Megatron-Core's own refusal, as one line
        raise ValueError(f"Megatron-Core refuses the flags: {str(exc).splitlines()[0]}") from None
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
        from dtlib.frameworks.megatron_args import record
        from dtlib.frameworks.megatron_meta import params_per_rank

        check_megatron(emitted.data, layout.gpus)
        count = params_per_rank(emitted.data, layout.gpus)
        return (f"accepted by Megatron-LM's arguments ({record()['tag']}) and Megatron-Core's configs on "
                f"{layout.gpus} ranks; its GPTModel holds {count:,} parameters on rank 0")
    if emitted.framework == "torchtitan":
        from dtlib.frameworks.torchtitan_check import check_torchtitan_job, import_torchtitan

        check_torchtitan_toml(emitted.text)
        try:
            import_torchtitan()
        except ImportError as exc:  # the schema read from its source is then the whole check
            return f"matches torchtitan's job_config.py schema (v0.2.2); {exc}"
        built = check_torchtitan_job(emitted.text)
        return (f"accepted by torchtitan 0.2.2's ConfigManager, pipeline split and converters; its "
                f"{emitted.data['model']['name']} {emitted.data['model']['flavor']} holds {built['parameters']:,} "
                f"parameters")
    check_jax(emitted.data)
    return "every PartitionSpec divides its weight on a jax.sharding.AbstractMesh"
