"""A timed plan written as each framework's real launch configuration.

:func:`emit` turns the planner's timed plan (:class:`~dtlib.plan.emit.timed.TimedPlan`: the
layout, the model, the global batch, the precision and the step options the step time used)
into Megatron-LM's ``pretrain_gpt.py`` flags, a DeepSpeed JSON, a torchtitan TOML or a JAX mesh
with a ``PartitionSpec`` per weight role. Where a framework cannot express the plan, the result
carries one line per reason in ``unsupported`` and no config: a config that silently runs
another model or layout is worse than none. Where it runs a timed option otherwise, ``retimed``
says so and ``timing`` is the re-timed step (docs/emit.md). ``notes`` say what the config leaves
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

One module per framework (:mod:`.megatron`, :mod:`.deepspeed`, :mod:`.torchtitan`, :mod:`.jax`),
each with the list of what its framework cannot express next to the config it writes; they share
one layout check and one refusal path (:mod:`.common`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism
from dtlib.plan.emit import deepspeed, jax, megatron, torchtitan
from dtlib.analytic.units import GiB
from dtlib.outputs import check_output_dir
from dtlib.plan.emit.common import FILENAMES, FRAMEWORKS, PRECISIONS, Emitted, flag_lines, json_lines, reasons
from dtlib.plan.emit.timed import FRAMEWORK_STACKS, TimedPlan, as_plan, retime, run_options
from dtlib.plan.emit.deepspeed import deepspeed_config
from dtlib.plan.emit.jax import JAX_AXES, JAX_ROLES, jax_mesh
from dtlib.plan.emit.megatron import megatron_flags
from dtlib.plan.emit.torchtitan import torchtitan_document, torchtitan_toml
from dtlib.plan.torchtitan_schema import TORCHTITAN_SCHEMA, check_torchtitan

__all__ = ["FRAMEWORKS", "FILENAMES", "PRECISIONS", "Emitted", "emit", "unsupported", "megatron_flags",
           "deepspeed_config", "torchtitan_toml", "torchtitan_document", "jax_mesh", "check_torchtitan",
           "TORCHTITAN_SCHEMA", "JAX_AXES", "JAX_ROLES", "emit_all", "emitted_lines", "check_emit_options",
           "TimedPlan", "FRAMEWORK_STACKS"]

_MODULES = {"megatron": megatron, "deepspeed": deepspeed, "torchtitan": torchtitan, "jax": jax}


def unsupported(framework: str, plan: TimedPlan | Parallelism, model: TransformerConfig | None = None,
                global_batch: int | None = None, precision: str = "bf16") -> list[str]:
    """Why ``framework`` cannot express the plan (one line each; empty when it can)."""
    validate.one_of("framework", framework, FRAMEWORKS)
    plan = as_plan(plan, model, global_batch, precision, framework)
    return reasons(framework, _MODULES[framework].unsupported_here, plan.layout, plan.model, plan.global_batch,
                   plan.precision)


def emit(framework: str, plan: TimedPlan | Parallelism, model: TransformerConfig | None = None,
         global_batch: int | None = None, precision: str = "bf16") -> Emitted:
    """``framework``'s config of the timed ``plan`` (or of a bare layout with ``model``,
    ``global_batch`` and ``precision``, untimed, on the framework's stack), or why it cannot be
    written. ``retimed`` lists the timed options the config runs otherwise, and ``timing`` is the
    step of the run the config makes (re-timed when ``retimed`` is not empty)."""
    plan = as_plan(plan, model, global_batch, precision, framework)
    found = unsupported(framework, plan)
    if found:
        return Emitted(framework, "", None, found, [])
    module = _MODULES[framework]
    notes = module.notes(plan.layout, plan.model, plan.precision)
    runs, retimed = run_options(framework, plan, module.realize)
    timing = retime(plan, runs) if retimed else plan.timing
    if framework == "megatron":
        data: Any = megatron_flags(plan)
        text = flag_lines(data)
    elif framework == "deepspeed":
        data = deepspeed_config(plan)
        text = json_lines(data)
    elif framework == "torchtitan":
        data, text = torchtitan_document(plan), torchtitan_toml(plan)
    else:
        data = jax_mesh(plan)
        text = json_lines(data)
    return Emitted(framework, text, data, [], notes, retimed, timing)


def check_emit_options(frameworks: list[str] | None, directory: str | None, rehearse: bool) -> None:
    """The command line's ``--emit``/``--emit-dir``/``--rehearse``, checked before anything runs."""
    for flag, given in (("--emit-dir", directory is not None), ("--rehearse", rehearse)):
        if given and not frameworks:
            raise ValueError(f"{flag} needs --emit FRAMEWORK (one of {', '.join(FRAMEWORKS)})")
    if directory is not None:
        check_output_dir("--emit-dir", directory)


def emit_all(frameworks: list[str], plan: TimedPlan, directory: str | None = None) -> dict[str, dict[str, Any]]:
    """:func:`emit` of ``plan`` for each framework (once each, in order) as dicts; with
    ``directory``, each expressible config is also written there under :data:`FILENAMES` (key ``written``)."""
    out = {f: emit(f, plan).to_dict() for f in dict.fromkeys(frameworks)}
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
                  + [f"  note: {n}" for n in e["notes"]] + _timing_lines(name, e))
    return lines


def _timing_lines(name: str, e: dict[str, Any]) -> list[str]:
    """What the config runs otherwise than timed, and the step it makes then."""
    lines = [f"  re-timed: {r}" for r in e["retimed"]]
    t = e["timing"]
    if e["retimed"]:
        lines.append(f"  {name} runs layout #1 at {t['step_time_s']:.3f} s per step, MFU {100 * t['mfu']:.1f}%, "
                     f"{t['memory_per_gpu_bytes'] / GiB:.1f} GiB per GPU" if t else
                     f"  {name}'s run is not re-timed (the plan has no cluster or has a hybrid shard size, or the run "
                     f"does not fit in the GPU's memory at all)")
    return lines
