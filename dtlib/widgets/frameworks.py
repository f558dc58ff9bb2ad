"""Emitter explorer ``"emitted_configs"``: a layout of a 8B model -> what ``dtlib plan --emit`` writes
for DeepSpeed, Megatron-LM and JAX (:mod:`dtlib.plan.emit`), the lines a framework cannot express,
its caveats (notes and re-timed lines), and the model-state bytes per rank
:mod:`dtlib.analytic.memory` predicts. Pure and fast: nothing
is launched."""
from __future__ import annotations

import json

import ipywidgets as W

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.presets import get_preset
from dtlib.plan.emit import emit
from dtlib.viz.frameworks import plot_emitted
from dtlib.widgets.base import Explorer, register

__all__ = ["emitted_configs_explorer", "emitted_configs", "FRAMEWORKS", "MODEL", "PRECISION"]

MODEL = "llama3-8b"
PRECISION = "bf16"
# what the widget shows, in its order: emitter name -> panel title
FRAMEWORKS = {"deepspeed": "DeepSpeed JSON", "megatron": "Megatron-LM flags", "jax": "JAX mesh and specs"}


def emitted_configs(zero: int, dp: int, tp: int, pp: int, micro_batch_size: int, global_batch: int) -> dict:
    """The layout's predicted model-state bytes per rank and each framework's emitted text and
    unsupported lines. ``global_batch`` must be a multiple of ``dp x micro_batch_size`` (the
    remaining factor is the number of micro-batches, Megatron's ``num_microbatches``)."""
    per_step = dp * micro_batch_size
    if global_batch % per_step:
        raise ValueError(f"global_batch ({global_batch}) must be a multiple of dp x micro_batch_size ({per_step})")
    layout = Parallelism(dp=dp, tp=tp, pp=pp, zero=zero, micro_batch_size=micro_batch_size,
                         num_microbatches=global_batch // per_step)
    model = get_preset(MODEL)
    memory = memory_per_gpu(model, layout, precision="zero")
    emitted = {name: emit(name, layout, model, global_batch, PRECISION) for name in FRAMEWORKS}
    return {"layout": layout, "global_batch": global_batch,
            "predicted": {"parameters": memory.parameters, "gradients": memory.gradients,
                          "optimizer": memory.optimizer},
            "texts": {FRAMEWORKS[n]: _compact(n, e) for n, e in emitted.items()},
            "unsupported": {FRAMEWORKS[n]: list(e.unsupported) for n, e in emitted.items()},
            # the emitter's caveats (e.g. JAX writes ZeRO-1 as ZeRO-3) and what it re-timed
            "notes": {FRAMEWORKS[n]: list(e.notes) + list(e.retimed) for n, e in emitted.items()}}


def _compact(framework: str, emitted) -> str:
    """The emitted config in few lines for a panel: DeepSpeed's keys one per line, Megatron's flags
    without their line continuations, JAX's mesh and one spec per role."""
    if emitted.unsupported:
        return ""
    if framework == "deepspeed":
        return "\n".join(f"{key}: {json.dumps(value)}" for key, value in emitted.data.items())
    if framework == "jax":
        specs = [f"{role}: P({', '.join(repr(a) if a else 'None' for a in spec)})"
                 for role, spec in emitted.data["specs"].items()]
        return "\n".join([f"mesh {emitted.data['mesh']}"] + specs + [f"batch: P{tuple(emitted.data['batch'])}"])
    return emitted.text.replace(" \\\n", "\n")


def _plot(r: dict):
    L = r["layout"]
    return plot_emitted(r["predicted"], r["texts"], r["unsupported"], notes=r["notes"],
                        title=f"{MODEL} on dp{L.dp} x tp{L.tp} x pp{L.pp} = {L.gpus} GPUs, ZeRO-{L.zero}, "
                              f"global batch {r['global_batch']} = {L.micro_batch_size} x {L.num_microbatches} "
                              f"micro-batches x dp{L.dp}")


@register("emitted_configs")
def emitted_configs_explorer() -> Explorer:
    """One layout, three frameworks' configurations, and the bytes each rank will hold."""
    return Explorer(
        {"zero": W.Dropdown(options=[0, 1, 2, 3], value=1, description="ZeRO stage"),
         "dp": W.Dropdown(options=[1, 2, 4, 8], value=4, description="dp"),
         "tp": W.Dropdown(options=[1, 2, 4, 8], value=2, description="tp"),
         "pp": W.Dropdown(options=[1, 2, 4], value=1, description="pp"),
         "micro_batch_size": W.Dropdown(options=[1, 2, 4], value=1, description="micro-batch"),
         "global_batch": W.Dropdown(options=[32, 64, 128, 256], value=64, description="global batch")},
        compute=emitted_configs, plot=_plot,
        title="dtlib plan --emit: one layout in each framework's language (red: what it cannot express)")
