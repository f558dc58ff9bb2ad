"""A JAX mesh with a ``PartitionSpec`` per weight role of a planned layout: the mesh axes and
weight roles :func:`dtlib.frameworks.jax_gspmd.run_jax` takes."""
from __future__ import annotations

from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.plan.emit.common import model_code_note, refuse, variants
from dtlib.plan.emit.timed import TimedPlan, as_plan
from dtlib.plan.steptime import StepOptions

JAX_AXES = ("data", "fsdp", "model")
JAX_ROLES = ("embed", "attn.qkv", "attn.out", "mlp.up", "mlp.down", "norm", "head")


def unsupported_here(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    out = [f"{name}={size}: not expressed by a GSPMD mesh of weights here (pipelining and ring attention "
           f"are program structure, not a PartitionSpec)" for name, size in (("pp", p.pp), ("cp", p.cp)) if size > 1]
    if p.ep > 1:
        out.append(f"ep={p.ep}: the weight roles are a dense transformer's; experts are not laid out here")
    extra = [name for name, used in (("moe_experts (MoE: no dense stand-in)", m.moe_experts), ("qk_norm", m.qk_norm),
                                     ("attention_sinks", m.attention_sinks)) if used]
    if extra + variants(m):
        out.append(f"{', '.join(extra + variants(m))}: the weight roles are a dense Llama/GPT block's")
    if p.offload != "none":
        out.append(f"offload {p.offload}: a mesh places arrays on devices only")
    if precision == "nvfp4":
        out.append("precision nvfp4: NVIDIA's NVFP4 recipe is Transformer Engine's, not a mesh's dtype")
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


def realize(plan: TimedPlan, o: StepOptions) -> dict[str, tuple[Any, str]]:
    """Nothing: dtlib has no JAX stack, so the plan keeps the stack it was timed with (XLA's
    scheduler, not the mesh, decides what overlaps; :func:`notes` says so)."""
    return {}


def jax_mesh(plan: TimedPlan | Parallelism, model: TransformerConfig | None = None, global_batch: int | None = None,
             precision: str = "bf16") -> dict[str, Any]:
    """``{"mesh": {axis: size}, "specs": {role: spec}, "batch": spec, "shapes": {role: shape}}``:
    each spec one entry per dimension (None, an axis name, or a list of axis names), what
    :func:`dtlib.frameworks.jax_gspmd.run_jax` takes."""
    plan = as_plan(plan, model, global_batch, precision, "jax")
    refuse("jax", unsupported_here, plan.layout, plan.model, plan.global_batch, plan.precision)
    layout, model, precision = plan.layout, plan.model, plan.precision
    data, fsdp, tp = _jax_sizes(layout)
    batch_axes = [a for a, n in (("data", data), ("fsdp", fsdp)) if n > 1]
    batch = [batch_axes[0] if len(batch_axes) == 1 else batch_axes or None, None]
    return {"mesh": dict(zip(JAX_AXES, (data, fsdp, tp))), "specs": _jax_specs(data, fsdp, tp),
            "batch": batch, "shapes": {k: list(v) for k, v in _jax_shapes(model).items()},
            "micro_batch_size": layout.micro_batch_size, "num_microbatches": layout.num_microbatches,
            "dtype": {"bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}[precision]}


def notes(p: Parallelism, m: TransformerConfig, precision: str) -> list[str]:
    notes = ["mesh axes as jax.make_mesh(..., axis_types=(AxisType.Auto,) * 3): XLA inserts the collectives",
             "dtlib has no JAX stack (dtlib.analytic.stacks): the step time is the one timed, with its stack's "
             "overlaps and kernels; XLA's scheduler decides what a JAX run overlaps"]
    if p.zero in (1, 2):
        notes.append(f"ZeRO-{p.zero} has no exact GSPMD equivalent: the fsdp axis shards parameters too (ZeRO-3)")
    if p.sequence_parallel:
        notes.append("sequence parallelism is a sharding constraint on activations, not on weights: not in these specs")
    if precision == "fp8":
        notes.append("fp8: matmul precision is the program's (e.g. jax.nn.scaled_matmul); the weights stay bfloat16")
    if p.num_microbatches > 1:
        notes.append(f"{p.num_microbatches} micro-batches are a loop (gradient accumulation) in the training step")
    notes.append(model_code_note(m, "the JAX program's (the mesh and specs carry shapes only)"))
    return notes
