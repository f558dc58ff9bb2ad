"""What the four emitters share: the names and files, the input check, and the one refusal path.

Every emitter (:mod:`.megatron`, :mod:`.deepspeed`, :mod:`.torchtitan`, :mod:`.jax`) checks its
inputs with :func:`check_inputs` and refuses through :func:`reasons` / :func:`refuse`: the layout
check of :mod:`dtlib.analytic.layout`, the memory options no framework but Megatron-LM is emitted
with, then the framework's own list. A config that silently runs another layout is worse than none.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism, check_layout

FRAMEWORKS = ("megatron", "deepspeed", "torchtitan", "jax")
FILENAMES = {"megatron": "megatron_flags.txt", "deepspeed": "ds_config.json", "torchtitan": "torchtitan.toml",
             "jax": "jax_mesh.json"}
PRECISIONS = ("bf16", "fp16", "fp8", "nvfp4")
# the optimizer block of the DeepSpeed JSON: AdamW as GPT-3 and Llama trained (Brown et al. 2020,
# App. B: beta2 0.95, weight decay 0.1; Touvron et al. 2023, Sec. 2.2); lr is the user's choice.
ADAMW = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
# written out, not left to defaults: DeepSpeed 0.19 clips at 1.0 when the key is absent
# (constants.GRADIENT_CLIPPING_DEFAULT), Megatron-LM's --clip-grad and torchtitan's max_norm also
# default to 1.0, GPT-3 and Llama clip at 1.0. Stated, so that a reader sees it and can set 0.0.
GRADIENT_CLIPPING = 1.0


@dataclass(frozen=True)
class Emitted:
    """One framework's config for one plan: ``text`` (the file's content) and ``data`` (flags,
    dict), or, when ``unsupported`` is not empty, neither (one line per reason). ``retimed``: one
    line per timed option the config runs otherwise; ``timing``: the step the config makes
    (:data:`dtlib.plan.emit.timed.TIMING`; re-timed when ``retimed`` is not empty), or None."""
    framework: str
    text: str
    data: Any
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    retimed: list[str] = field(default_factory=list)
    timing: dict[str, Any] | None = None

    @property
    def filename(self) -> str:
        return FILENAMES[self.framework]

    def to_dict(self) -> dict[str, Any]:
        return {"framework": self.framework, "file": self.filename, "text": self.text, "data": self.data,
                "unsupported": self.unsupported, "notes": self.notes, "retimed": self.retimed,
                "timing": self.timing}


def check_inputs(layout: Parallelism, model: TransformerConfig, global_batch: int, precision: str) -> None:
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


def _memory_options_unsupported(framework: str, p: Parallelism) -> list[str]:
    """The layout options of docs/stacks.md ("memory that admits what ran") a framework's config
    is not emitted with: Megatron-LM takes partial recompute of the other layers with none
    (``--recompute-method block``) and the balanced split, torchtitan the balanced split
    (``pipeline_parallel_first/last_stage_less_layers``) and per-op recompute; nothing else yet."""
    megatron = framework == "megatron"
    out = []
    if p.recompute == "op" and framework != "torchtitan":
        out.append(f"recompute op (torchtitan's per-op checkpointing) is not emitted for {framework}")
    if p.recompute_layers and not (megatron and p.recompute == "none"):
        out.append(f"recompute_layers={p.recompute_layers} with recompute={p.recompute!r} is not emitted for "
                   f"{framework}" + (" (Megatron-LM's block method leaves the other layers unrecomputed: "
                                     "use recompute='none')" if megatron else ""))
    if p.account_for_embedding_and_loss and framework not in ("megatron", "torchtitan"):
        out.append(f"account_for_embedding_and_loss is not emitted for {framework}")
    if p.activation_offload_layers:
        out.append(f"activation_offload_layers is not emitted for {framework}")
    if p.recompute_modules and not (megatron and not p.recompute_layers):
        out.append(f"recompute_modules is not emitted for {framework}" + (
            " with recompute_layers (Megatron-LM takes one --recompute-granularity)" if megatron else ""))
    return out


Reasons = Callable[[Parallelism, TransformerConfig, str], list[str]]


def reasons(framework: str, own: Reasons, layout: Parallelism, model: TransformerConfig, global_batch: int,
            precision: str) -> list[str]:
    """Why ``framework`` cannot express ``layout`` (its ``own`` list after the shared checks)."""
    check_inputs(layout, model, global_batch, precision)
    return _memory_options_unsupported(framework, layout) + own(layout, model, precision)


def refuse(framework: str, own: Reasons, layout: Parallelism, model: TransformerConfig, global_batch: int,
           precision: str) -> None:
    """Raise ValueError with every reason of :func:`reasons`, if any."""
    found = reasons(framework, own, layout, model, global_batch, precision)
    if found:
        raise ValueError(f"{framework} cannot express this layout: " + "; ".join(found))


def variants(m: TransformerConfig) -> list[str]:
    """The fields of ``m`` beyond a Llama/GPT block with every MLP alike (docs/models.md)."""
    return [name for name, used in (
        ("moe_ffn", m.moe_ffn not in (None, m.ffn)), ("moe_shared_experts", m.moe_shared_experts),
        ("moe_dense_layers", m.moe_dense_layers), ("moe_layer_freq", m.moe_layer_freq != 1),
        ("kv_lora_rank (MLA)", m.kv_lora_rank), ("head_dim", m.head_dim != m.hidden // m.heads),
        ("sliding_window", m.sliding_window), ("mtp_layers (MTP)", m.mtp_layers)) if used]


# the fields that change the model but not its shape (TransformerConfig's docstring)
BEHAVIOUR_FIELDS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "norm_eps", "qk_norm", "router_score",
                    "router_expert_bias", "routed_scaling", "attention_sinks", "activation_clamp")


def model_code_note(m: TransformerConfig, where: str) -> str:
    """The note of a config that carries no model: every field the model's code must set."""
    values = ", ".join(f"{f.name}={getattr(m, f.name)!r}" for f in fields(m) if f.name not in ("name", "source"))
    return f"the model is {where}, not this config: build it with {values}, dropout 0"


def json_lines(data: dict[str, Any]) -> str:
    """JSON with one top-level key per line: short enough to read, still one valid document."""
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}\n"


def flag_lines(flags: list[str]) -> str:
    """One flag (and its value) per line, continued with backslashes, as a launch script has them."""
    lines: list[str] = []
    for word in flags:
        if word.startswith("--") or not lines:
            lines.append(word)
        else:
            lines[-1] += f" {word}"
    return " \\\n".join(lines) + "\n"

