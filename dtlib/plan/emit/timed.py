"""The plan as it was timed, as one value, and the run a framework's config really makes of it.

A :class:`TimedPlan` is what the emitters take: the layout, the model, the global batch, the
precision and the :class:`~dtlib.plan.steptime.StepOptions` the step time used (and the cluster
it was timed on), so no knob that was timed can be left out of a config. Each framework module
says, in ``realize``, what its config does with each option (:func:`run_options`): an option it
can write is written, one it cannot is replaced by what the framework really does, and the plan
is then re-timed with that (:func:`retime`), with one line per replaced option saying why.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.precision import get_precision
from dtlib.analytic.stacks import DEFAULT_STACK, get_stack
from dtlib.plan.emit.common import PRECISIONS
from dtlib.plan.steptime import StepOptions, resolve

__all__ = ["TimedPlan", "FRAMEWORK_STACKS", "as_plan", "run_options", "retime", "dp_overlap", "precision_bytes",
           "Realize", "TIMING", "without"]

# the dtlib.analytic.stacks stack each framework runs as; JAX has none (XLA's scheduler decides
# what overlaps: the plan keeps the stack it was timed with, and says so)
FRAMEWORK_STACKS: dict[str, str | None] = {"megatron": "megatron", "deepspeed": "deepspeed",
                                           "torchtitan": "torchtitan", "jax": None}


@dataclass(frozen=True)
class TimedPlan:
    """One planned run: ``layout`` of ``model`` at ``global_batch`` sequences, ``precision``
    (``bf16``, ``fp16`` or ``fp8`` matmuls), timed with ``options`` (as given: :attr:`resolved`
    fills them from their stack) on ``cluster`` (None: not timed, so nothing can be re-timed)
    with ``dropout`` masks or not. ``timing``: the printed numbers (``step_time_s``, ``mfu``,
    ``memory_per_gpu_bytes``), or None."""
    layout: Parallelism
    model: TransformerConfig
    global_batch: int
    options: StepOptions = StepOptions()
    precision: str = "bf16"
    cluster: Cluster | None = None
    dropout: bool | None = None
    timing: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, Parallelism):
            raise ValueError(f"layout must be a dtlib.analytic.layout.Parallelism, got {self.layout!r}")
        if not isinstance(self.model, TransformerConfig):
            raise ValueError(f"model must be a dtlib.analytic.config.TransformerConfig, got {self.model!r}")
        if not isinstance(self.options, StepOptions):
            raise ValueError(f"options must be a dtlib.plan.steptime.StepOptions, got {self.options!r}")
        validate.integer("global_batch", self.global_batch)
        validate.one_of("precision", self.precision, PRECISIONS)
        # fp8 / nvfp4 matmuls are StepOptions.dtype fp8 / nvfp4; bf16 and fp16 both time as 16-bit matmuls
        if _matmuls(self.precision) != self.options.dtype:
            raise ValueError(f"precision={self.precision!r} but options.dtype={self.options.dtype!r}: fp8 and "
                             f"nvfp4 matmuls are both or neither")

    @property
    def resolved(self) -> StepOptions:
        """``options`` filled from their stack (:func:`dtlib.plan.steptime.resolve`)."""
        return resolve(self.options, self.dropout)[0]


def as_plan(plan: "TimedPlan | Parallelism", model: TransformerConfig | None, global_batch: int | None,
            precision: str, framework: str) -> TimedPlan:
    """``plan`` itself, or the untimed plan of a bare layout (the older call form ``(layout, model,
    global_batch, precision)``), with ``framework``'s stack."""
    if isinstance(plan, TimedPlan):
        if model is not None or global_batch is not None:
            raise ValueError("give a TimedPlan alone, or a layout with model and global_batch")
        return plan
    if model is None or global_batch is None:
        raise ValueError("a layout needs model and global_batch (or give a TimedPlan)")
    validate.one_of("precision", precision, PRECISIONS)
    stack = FRAMEWORK_STACKS.get(framework) or DEFAULT_STACK
    return TimedPlan(plan, model, global_batch, StepOptions(stack=stack, dtype=_matmuls(precision)), precision)


def _matmuls(precision: str) -> str:
    """The step-time matmul dtype of a config precision (bf16 and fp16 time as 16-bit matmuls)."""
    return precision if precision in ("fp8", "nvfp4") else "bf16"


def dp_overlap(options: StepOptions, layout: Parallelism) -> float:
    """The DP overlap the step time uses for ``layout``: the option, else its stack's for the ZeRO stage."""
    if options.dp_overlap is not None:
        return options.dp_overlap
    stack = get_stack(options.stack)
    return stack.dp_overlap_zero3 if layout.zero == 3 else stack.dp_overlap


def precision_bytes(spec: Any) -> tuple[float, ...]:
    """Bytes per parameter and per activation of a precision convention: what the plan counts."""
    p = get_precision(spec)
    return (p.param, p.grad, p.master, p.grad_copy, p.states, p.activation)


def without(o: StepOptions, layout: Parallelism, overlaps: dict[str, str], fused: str | None = None,
            flash: str | None = None) -> dict[str, tuple[Any, str]]:
    """What :data:`Realize` says of a config that lacks some overlaps (``overlaps``: option ->
    why, re-timed at 0 where that dimension is > 1), runs eager elementwise kernels (``fused``:
    why) and SDPA attention, which stores no scores (``flash``: why)."""
    sizes = {"tp_overlap": layout.tp, "cp_overlap": layout.cp, "ep_overlap": layout.ep}
    out = {name: (0.0, f"{why}: re-timed with it exposed") for name, why in overlaps.items()
           if getattr(o, name) and sizes[name] > 1}
    if fused and o.fused_elementwise:
        out["fused_elementwise"] = (False, f"{fused}: re-timed with one kernel per elementwise operator")
    if flash and not o.flash_attention:
        out["flash_attention"] = (True, f"{flash}: SDPA (FlashAttention) stores no s x s scores")
    return out


# a framework module's realize(plan, options) -> {field: (value the config runs, why)} for the
# resolved options its config cannot write as they are
Realize = Callable[[TimedPlan, StepOptions], dict[str, tuple[Any, str]]]


def run_options(framework: str, plan: TimedPlan, realize: Realize) -> tuple[StepOptions, list[str]]:
    """The resolved options ``framework``'s config runs, and one line per option that differs
    from the timed ones: the stack first (``--emit F`` runs F's stack), then ``realize``'s."""
    changed = []
    options = plan.options
    stack = FRAMEWORK_STACKS[framework]
    if stack is not None and get_stack(options.stack).name != stack:
        changed.append(f"stack: timed as {get_stack(options.stack).name}, {framework} runs as dtlib's {stack} "
                       f"stack (dtlib.analytic.stacks): its overlaps, kernels and precision")
        options = replace(options, stack=stack, **{k: None for k in _STACK_FILLED})
    resolved = resolve(options, plan.dropout)[0]
    forced = realize(replace(plan, options=resolved), resolved)
    changed += [f"{name}: {why}" for name, (_, why) in forced.items()]
    return replace(resolved, **{name: value for name, (value, _) in forced.items()}), changed


# the fields resolve() fills from the stack: a new stack fills them again
_STACK_FILLED = ("precision", "fp8_recipe", "moe_dispatcher", "tp_overlap", "cp_overlap", "fused_elementwise",
                 "dp_overlap")


def retime(plan: TimedPlan, options: StepOptions, headroom: float = 1.0) -> dict[str, Any] | None:
    """The step of ``plan``'s layout with ``options`` (:func:`dtlib.plan.search.search` with every
    knob pinned, so the row is the one the search prints): ``step_time_s``, ``mfu``,
    ``memory_per_gpu_bytes``, ``breakdown`` (:data:`TIMING`); None when the plan has no cluster or a
    hybrid shard size, or the run does not fit in the whole GPU memory."""
    from dtlib.plan.search import GIVEN_OPTIONS, search

    p = plan.layout
    if plan.cluster is None or p.shard_size is not None:
        return None
    fixed = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "etp": p.etp,
             "virtual_stages": p.virtual_stages, "micro_batch_size": p.micro_batch_size, "zero": p.zero,
             "recompute": p.recompute, "sequence_parallel": p.sequence_parallel, "offload": p.offload}
    fixed |= {k: getattr(p, k) for k in GIVEN_OPTIONS}
    r = search(plan.model, plan.cluster, plan.global_batch, options=options, fixed=fixed, headroom=headroom,
               tp_within_node=False, dropout=plan.dropout, top=1)
    return {k: r.configs[0][k] for k in TIMING} if r.configs else None


# the numbers of a timed step that a plan prints (dtlib.plan.search rows' keys)
TIMING = ("step_time_s", "tokens_per_s", "mfu", "memory_per_gpu_bytes", "breakdown")
