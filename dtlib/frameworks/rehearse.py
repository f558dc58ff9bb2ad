"""``dtlib plan --emit FRAMEWORK --rehearse``: the planned layout, shrunk, run under that framework
on this machine's CPU ranks and compared with one process.

The rehearsal a platform engineer does before renting the cluster, in the framework they will use:

1. keep what the framework's runner here runs (:data:`RUNS`: DeepSpeed alone runs DP x ZeRO,
   Megatron-Core tp x pp x dp with SP and interleaving, a JAX mesh data/fsdp x model), one line
   per dimension dropped;
2. shrink as :func:`dtlib.experiments.shrunk_layout.shrink_layout` shrinks a plan (every size
   > 1 becomes 2, at most 8 ranks, the batch cut down), with its lines;
3. emit the framework's config for the shrunk layout and the runner's tiny model
   (:func:`dtlib.plan.emit.emit`), then run it in float32 with SGD and no clipping, as the
   one-process reference trains (:func:`_for_cpu` says why, one line per change);
4. run it a few steps and the same model on one process, and :func:`~dtlib.frameworks.common.compare`;
5. say which planned dimensions the run exercised and which it did not, and why (:func:`coverage`):
   the verdict is PASS only for the rehearsed ones (:func:`verdict`; docs/rehearse.md).

The full-size part of ``--rehearse`` (the planned model's memory per rank) is
:mod:`dtlib.frameworks.fullsize`.

torchtitan is not rehearsed: it is not installed (it runs on CPU only with five patches; see
docs/frameworks.md), so its TOML is checked against its schema instead.
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import asdict, fields
from typing import Any

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.frameworks.common import FrameworkRun, compare
from dtlib.plan.emit import Emitted, emit

__all__ = ["REHEARSABLE", "RUNS", "STEPS", "MAX_RANKS", "shrink_for", "coverage", "verdict", "rehearse",
           "rehearse_all", "rehearsal_lines"]

REHEARSABLE = ("deepspeed", "megatron", "jax")
MAX_RANKS = 8
STEPS = 3  # warm-up-free SGD: a wrong gradient shows from step 2's loss and in every parameter


# what each framework's runner here takes from a layout; everything else goes back to its default
RUNS: dict[str, tuple[tuple[str, ...], str]] = {
    "deepspeed": (("dp", "zero", "micro_batch_size", "num_microbatches"),
                  "DeepSpeed alone runs data parallelism x ZeRO (tp/pp/cp need Megatron-DeepSpeed)"),
    "megatron": (("dp", "tp", "pp", "sequence_parallel", "schedule", "virtual_stages", "micro_batch_size",
                  "num_microbatches", "recompute"),
                 "dtlib.frameworks.megatron_core runs tp x pp x dp with sequence parallelism, interleaving and "
                 "recomputation, without ZeRO (Megatron-Core's DistributedOptimizer takes CUDA tensors only; "
                 "Megatron-FSDP is not run here)"),
    "jax": (("dp", "tp", "zero"),
            "the GSPMD mesh has data, fsdp and model axes and the runner's fixed batch of 8 sequences"),
}
# SGD as the runners and the one-process references train (dtlib.experiments.shrunk_layout.TINY's
# rate): its update is proportional to the gradient, so a gradient off by a factor moves the
# weights, where Adam's normalised update would hide it
LR = 0.5


def _model(framework: str) -> TransformerConfig:
    """The runner's model as a TransformerConfig, so the emitted config describes what runs."""
    if framework == "deepspeed":  # TinyGPT of dtlib.experiments.shrunk_layout.TINY
        from dtlib.frameworks.deepspeed_zero import MODEL

        return MODEL
    if framework == "megatron":  # run_megatron's defaults (4 layers: pp 2 x 2 chunks; tied, as Megatron's default)
        return TransformerConfig(name="megatron-tiny", layers=4, hidden=32, heads=4, vocab=64, seq=16,
                                 tied_embeddings=True)
    # jax_gspmd.MODEL: RMSNorm, no biases, no position embedding (rope stands in: no weights either)
    return TransformerConfig(name="jax-tiny", layers=2, hidden=32, heads=4, ffn=128, vocab=64, seq=16, bias=False,
                             norm="rmsnorm", position="rope")


# the parallel dimensions a verdict speaks for: name, whether a layout uses it, and its size
_DIMENSIONS: tuple[tuple[str, Any], ...] = (
    ("dp", lambda L: L.dp), ("tp", lambda L: L.tp), ("pp", lambda L: L.pp), ("cp", lambda L: L.cp),
    ("ep", lambda L: L.ep), ("etp", lambda L: L.etp), ("zero", lambda L: L.zero),
    ("sp", lambda L: int(L.sequence_parallel)),
    ("interleaving", lambda L: L.virtual_stages if L.schedule in ("interleaved", "dualpipev") else 1),
)
_UNUSED = {"zero": 0, "sp": 0}  # every other dimension is unused at 1
SHRUNK_AWAY = "dropped by the shrink to at most 8 CPU ranks or refused by the trainer (dtlib.trainer.shrink)"


def coverage(framework: str, planned: Parallelism, run: Parallelism,
             model: TransformerConfig | None = None) -> tuple[list[str], dict[str, str]]:
    """Which of ``planned``'s parallel dimensions the shrunk ``run`` exercised, and for each one it
    did not, why. A dimension counts as rehearsed when the plan uses it and the run uses it too (at
    any size: 2 exercises the same collectives as 64). An MoE ``model`` adds ``moe``: every runner
    here trains a dense model."""
    rehearsed, missing = [], {}
    dropped = RUNS[framework][1]
    for name, size in _DIMENSIONS:
        unused = _UNUSED.get(name, 1)
        if size(planned) == unused:
            continue
        if size(run) != unused:
            rehearsed.append(name)
        else:
            key = {"sp": "sequence_parallel", "interleaving": "virtual_stages"}.get(name, name)
            missing[name] = dropped if key not in RUNS[framework][0] else SHRUNK_AWAY
    if model is not None and model.moe_experts:
        missing["moe"] = (f"the runner's model is dense: {model.name}'s {model.moe_experts} experts, router and "
                          f"token dispatch are not run")
    return rehearsed, missing


def verdict(passed: bool, rehearsed: list[str], not_rehearsed: list[str]) -> tuple[str, str]:
    """``("pass" | "partial" | "fail", text)``: PASS only for the dimensions that ran, e.g.
    ``"PASS for dp x zero; tp, pp not rehearsed"``."""
    ran = " x ".join(rehearsed) or "one process"
    if not passed:
        return "fail", f"FAIL for {ran}"
    if not not_rehearsed:
        return "pass", f"PASS for {ran}"
    return "partial", f"PASS for {ran}; {', '.join(not_rehearsed)} not rehearsed"


def _check_framework(framework: str) -> None:
    if framework not in REHEARSABLE:
        why = " (not installed: its TOML is checked against its schema instead)" if framework == "torchtitan" else ""
        raise ValueError(f"framework {framework!r} cannot be rehearsed here{why}; valid: {', '.join(REHEARSABLE)}")


def shrink_for(framework: str, layout: Parallelism) -> tuple[Parallelism, TransformerConfig, list[str]]:
    """The layout ``framework``'s runner runs here, the runner's model, and one line per change."""
    from dtlib.trainer.shrink import shrink_layout

    _check_framework(framework)
    keeps, why = RUNS[framework]
    default = Parallelism()
    changes = {f.name: getattr(default, f.name) for f in fields(Parallelism)
               if f.name not in keeps and getattr(layout, f.name) != getattr(default, f.name)}
    lines = [", ".join(f"{name} {getattr(layout, name)} -> {value}" for name, value in changes.items())
             + f": {why}"] if changes else []
    kept = layout.with_(**changes)
    config, shrunk_lines = shrink_layout(kept, MAX_RANKS)
    # the last line describes dtlib's TinyGPT, not the framework's model; the recompute line dtlib's
    # trainer (a framework that recomputes keeps the planned kind)
    lines += [line for line in shrunk_lines[:-1] if not line.startswith("recompute ")]
    shrunk = Parallelism(dp=config.dp, tp=config.tp, pp=config.pp, cp=config.cp, zero=config.zero,
                         sequence_parallel=config.sequence_parallel, schedule=config.schedule,
                         virtual_stages=config.virtual_stages, micro_batch_size=config.micro_batch_size,
                         num_microbatches=config.num_microbatches, recompute=kept.recompute)
    model = _model(framework)
    if framework == "jax":  # the runner's batch is fixed: one step of 8 sequences, no accumulation
        shrunk = shrunk.with_(micro_batch_size=8 // shrunk.dp, num_microbatches=1)
        lines.append(f"batch -> {shrunk.global_batch} sequences in one step: jax_gspmd.MODEL's batch")
    return shrunk, model, lines


def _for_cpu(e: Emitted) -> tuple[Any, list[str]]:
    """The emitted config as the CPU ranks and the one-process reference run it, and what changed:
    float32 (bf16 rounding, ~4e-3 relative, would hide a wrong gradient inside any tolerance) and,
    for DeepSpeed, SGD without clipping (what :func:`~dtlib.frameworks.deepspeed_zero.reference_run`
    mirrors; DeepSpeed's default clipping would change the numbers)."""
    if e.framework == "megatron":
        return _megatron_for_cpu(e.data)
    if e.framework == "deepspeed":
        data = {k: v for k, v in e.data.items() if k not in ("bf16", "fp16")}
        data.update(gradient_clipping=0.0, optimizer={"type": "SGD", "params": {"lr": LR}})
        if e.data["zero_optimization"]["stage"] >= 1:  # the engine asserts it for a torch optimizer under ZeRO
            data["zero_allow_untested_optimizer"] = True
        return data, [f"precision -> float32, optimizer AdamW -> SGD lr {LR:g} (zero_allow_untested_optimizer), "
                      f"gradient_clipping {e.data['gradient_clipping']:g} -> 0: as the one-process reference trains"]
    return {**e.data, "dtype": "float32"}, ["precision -> float32: CPU devices compare in float32"]


# Megatron-LM flags the CPU runner leaves out: kernels and overlaps that change speed, never the
# numbers a step computes (Megatron-Core documents each as a performance option), with why
_MEGATRON_SPEED_ONLY = {
    "--tp-comm-overlap": "TP communication overlap needs Transformer Engine's userbuffers (CUDA)",
    "--moe-grouped-gemm": "grouped GEMM kernels need CUDA",
    "--moe-permute-fusion": "the fused permute kernel needs Transformer Engine",
    "--overlap-moe-expert-parallel-comm": "expert-parallel overlap needs CUDA streams",
    "--no-masked-softmax-fusion": "fusions are CUDA kernels, off on CPU anyway",
    "--no-bias-dropout-fusion": "fusions are CUDA kernels, off on CPU anyway",
    "--no-rope-fusion": "fusions are CUDA kernels, off on CPU anyway",
    "--no-bias-swiglu-fusion": "fusions are CUDA kernels, off on CPU anyway",
    "--no-bias-gelu-fusion": "fusions are CUDA kernels, off on CPU anyway",
}
_MEGATRON_SPEED_ONLY_VALUES = {
    "--attention-backend": "the attention kernel choice needs CUDA; the runner's is the local one",
    "--cp-comm-type": "the runner does not run context parallelism",
    "--fp8-recipe": "FP8 needs Transformer Engine; the run compares in float32",
    "--fp8-format": "FP8 needs Transformer Engine; the run compares in float32",
    "--recompute-modules": "recomputing a module repeats its forward: memory, not the numbers",
}
# model flags whose value the runner's tiny GPT builds anyway (dtlib.frameworks.megatron_flags:
# dropout 0, LayerNorm epsilon Megatron-Core's 1e-5); another value would be another model
_MEGATRON_RUNNER_BUILDS = {"--hidden-dropout": 0.0, "--attention-dropout": 0.0, "--norm-epsilon": 1e-5}


def _megatron_for_cpu(flags: list[str]) -> tuple[list[str], list[str]]:
    """Megatron-LM flags as the CPU runner takes them, and one line per change (see the tables)."""
    from dtlib.frameworks.megatron_flags import SWITCH_FLAGS, VALUE_FLAGS

    data, dropped, i = [], [], 0
    while i < len(flags):
        flag, i = flags[i], i + 1
        values = []
        while i < len(flags) and not flags[i].startswith("--"):  # --recompute-modules takes several
            values.append(flags[i])
            i += 1
        value = " ".join(values) or None
        if flag in _MEGATRON_SPEED_ONLY or flag in _MEGATRON_SPEED_ONLY_VALUES:
            why = _MEGATRON_SPEED_ONLY.get(flag) or _MEGATRON_SPEED_ONLY_VALUES[flag]
            dropped.append(f"{flag}{'' if value is None else ' ' + value} left out: {why}")
        elif flag in _MEGATRON_RUNNER_BUILDS:
            if float(value) != _MEGATRON_RUNNER_BUILDS[flag]:
                raise ValueError(f"the CPU runner builds {flag} {_MEGATRON_RUNNER_BUILDS[flag]:g}, the config "
                                 f"says {value}: not rehearsable")
        elif flag == "--ffn-hidden-size":  # the tiny GPT's FFN is Megatron's default 4 x hidden
            continue
        elif flag == "--make-vocab-size-divisible-by":
            dropped.append(f"{flag} {value} left out: the runner's vocabulary stays unpadded, as its "
                           f"one-process reference's")
        elif flag in ("--bf16", "--fp16", "--grad-reduce-in-bf16"):  # the run compares in float32
            continue
        elif flag in VALUE_FLAGS or flag in SWITCH_FLAGS:
            data += [flag] + values
        else:
            raise ValueError(f"the CPU runner cannot run Megatron-LM flag {flag}: not rehearsable")
    lines = ["precision -> float32, optimizer Adam (Megatron-LM's default) -> --optimizer sgd: as the "
             "one-process reference trains"]
    return data + ["--optimizer", "sgd"], lines + dropped


def _run(framework: str, layout: Parallelism, model: TransformerConfig, data: Any, steps: int,
         timeout: float) -> tuple[FrameworkRun, FrameworkRun]:
    """The framework's run of the emitted config and its one-process reference."""
    if framework == "deepspeed":
        from dtlib.frameworks.deepspeed_zero import reference_run, run_deepspeed

        return run_deepspeed(data, layout.dp, steps, timeout=timeout), reference_run(data, steps)
    if framework == "megatron":
        from dtlib.frameworks.megatron_core import run_megatron, run_megatron_flags
        from dtlib.frameworks.megatron_flags import parse_megatron_flags

        # the reference: the same flags read by the same parser (model, seed, optimizer), on one rank
        single = {**parse_megatron_flags(data, layout.gpus), "tp": 1, "pp": 1, "dp": 1, "sequence_parallel": False,
                  "virtual_stages": 1, "num_microbatches": layout.num_microbatches * layout.dp,
                  "overlap_grad_reduce": False}
        return run_megatron_flags(data, layout.gpus, steps), run_megatron(**single, steps=steps, timeout=timeout)
    from dtlib.frameworks.jax_gspmd import reference_run, run_jax

    return (run_jax(data["mesh"], data["specs"], data["batch"], steps, timeout=timeout),
            reference_run(steps, timeout=timeout))


def rehearse(framework: str, layout: Parallelism, precision: str = "bf16", *, steps: int = STEPS,
             timeout: float = 120.0, model: TransformerConfig | None = None) -> dict[str, Any]:
    """Shrink ``layout`` for ``framework`` (:func:`shrink_for`), emit its config, run it and one
    process, and compare. Returns ``framework``, ``layout`` (the shrunk one), ``changes``,
    ``config`` (the emitted config as run), both runs' ``losses``, ``max_loss_diff``,
    ``max_param_diff``, ``tolerance``, ``passed`` (the rehearsed dimensions matched one process),
    ``rehearsed`` / ``not_rehearsed`` (:func:`coverage`; ``why_not`` per dimension) and
    ``verdict`` / ``verdict_text`` (:func:`verdict`: ``partial`` when a planned dimension did not
    run). ``model``: the planned model, to say that an MoE model was not rehearsed."""
    shrunk, model, changes = shrink_for(framework, layout)
    emitted = emit(framework, shrunk, model, shrunk.global_batch, precision)
    if emitted.unsupported:  # a shrink rule is wrong, not the plan
        raise ValueError(f"the shrunk layout is not expressible in {framework}: {'; '.join(emitted.unsupported)}")
    config, cpu_lines = _for_cpu(emitted)
    changes += cpu_lines
    # a framework's own chatter (DeepSpeed's logger writes to the sys.stdout it finds at import)
    # goes to stderr: stdout is the report, e.g. `dtlib plan --json`
    with contextlib.redirect_stdout(sys.stderr):
        run, reference = _run(framework, shrunk, model, config, steps, timeout)
    # dtlib's own tolerances for a parallel run vs one process (float32 sums in another order
    # differ by ~1e-7; a wrong gradient moves SGD weights by > 1e-3), as lesson 10's rehearsal
    from dtlib.experiments.parallel3d import LOSS_TOL, PARAM_TOL

    diff = compare(run, reference)
    tolerance = {"max_loss_diff": LOSS_TOL, "max_param_diff": PARAM_TOL}
    passed = all(diff[k] <= tolerance[k] for k in tolerance)
    rehearsed, why_not = coverage(framework, layout, shrunk, model)
    kind, text = verdict(passed, rehearsed, list(why_not))
    described = (f"{model.layers} layers, hidden {model.hidden}, {model.heads} heads, {model.seq}-token sequences, "
                 f"vocabulary {model.vocab} (the runner's model)")
    return {"framework": framework, "layout": asdict(shrunk), "ranks": shrunk.gpus, "changes": changes,
            "model": described, "config": config, "steps": steps, "losses": run.losses,
            "reference_losses": reference.losses, **diff, "tolerance": tolerance, "passed": passed,
            "rehearsed": rehearsed, "not_rehearsed": list(why_not), "why_not": why_not, "verdict": kind,
            "verdict_text": text, "notes": run.notes}


def rehearse_all(emitted: dict[str, dict[str, Any]], layout: Parallelism, precision: str = "bf16",
                 *, steps: int = STEPS, model: TransformerConfig | None = None) -> dict[str, dict[str, Any]]:
    """:func:`rehearse` each framework of ``emitted`` (:func:`dtlib.plan.emit.emit_all`'s result);
    one not rehearsed here (torchtitan, or a layout it cannot express) says why."""
    out = {}
    for name, e in emitted.items():
        if e["unsupported"]:
            out[name] = {"framework": name, "passed": None, "why": "it cannot express this layout: nothing emitted"}
        elif name not in REHEARSABLE:
            out[name] = {"framework": name, "passed": None,
                         "why": "not installed here: its TOML was checked against its job_config.py schema"}
        else:
            out[name] = rehearse(name, layout, precision, steps=steps, model=model)
    return out


def rehearsal_lines(results: dict[str, dict[str, Any]]) -> list[str]:
    """The text of :func:`rehearse_all`, labelled "numerics (shrunk run vs one process)": per
    framework the shrunk layout and what changed, the differences from one process, which planned
    dimensions ran and which did not (and why), and the verdict (:func:`verdict`), or why it was
    not rehearsed."""
    lines = []
    for result in results.values():
        if result["passed"] is None:
            lines.append(f"numerics (shrunk run vs one process) under {result['framework']}: not run ({result['why']})")
            continue
        L = result["layout"]
        shape = " ".join(f"{k} {L[k]}" for k in ("dp", "tp", "pp", "cp", "zero", "micro_batch_size",
                                                  "num_microbatches"))
        extra = (" sp" if L["sequence_parallel"] else "") + (f" {L['schedule']} v{L['virtual_stages']}"
                                                            if L["virtual_stages"] > 1 else "")
        lines += ([f"numerics (shrunk run vs one process) under {result['framework']}: {shape}{extra} on "
                   f"{result['ranks']} CPU ranks"]
                  + [f"  changed: {line}" for line in result["changes"]] + [f"  model: {result['model']}"]
                  + [f"  vs one process, {result['steps']} steps: max loss diff {result['max_loss_diff']:.2e}, "
                     f"max param diff {result['max_param_diff']:.2e} (tolerances {result['tolerance']['max_loss_diff']:.0e}"
                     f", {result['tolerance']['max_param_diff']:.0e})"]
                  + [f"  rehearsed: {', '.join(result['rehearsed']) or 'none (one process)'}"]
                  + [f"  not rehearsed: {name} ({why})" for name, why in result["why_not"].items()]
                  + [f"  verdict: {result['verdict_text']}"])
    return lines
