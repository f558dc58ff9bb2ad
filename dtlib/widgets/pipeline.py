"""The pipeline explorer: schedule, p, m, v and the relative cost of F/B/W ->
:func:`dtlib.parallel.simulate` -> Gantt chart, bubble and the activations each rank holds
(:func:`dtlib.analytic.activations.layer_bytes` per layer, times the layers of a chunk, times the chunks
in flight), drawn by :func:`dtlib.viz.pipeline.plot_schedule_memory`.

``v`` (chunks per rank) applies to the interleaved schedule only; an interleaved setting that
Megatron-LM rejects (m not a multiple of p) is shown as its error message.
"""
from __future__ import annotations

from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure

from dtlib.analytic.activations import layer_bytes
from dtlib.analytic.memory import resolve_model
from dtlib.analytic.units import GiB
from dtlib.parallel.schedules import SCHEDULE_NAMES, schedule, simulate
from dtlib.viz.pipeline import plot_schedule_memory
from dtlib.widgets.base import Explorer, register

__all__ = ["pipeline_explorer", "explorer_compute", "explorer_plot"]


def explorer_compute(schedule_name: str, pp: int, microbatches: int, virtual_stages: int,
                     backward_over_forward: float, weight_share: float, model: str = "llama3-8b",
                     micro_batch: int = 1) -> dict[str, Any]:
    """Simulated timeline (F costs 1; B + W cost ``backward_over_forward``, of which W is
    ``weight_share``) and each rank's peak activation GiB for ``model`` (bf16, no dropout, no
    s x s attention scores kept: selective recompute, as with flash attention)."""
    v = virtual_stages if schedule_name == "interleaved" else 1
    actions = schedule(schedule_name, pp, microbatches, v)
    t_weight = backward_over_forward * weight_share
    timeline = simulate(actions, 1.0, backward_over_forward - t_weight, t_weight)
    cfg = resolve_model(model)
    per_layer = layer_bytes(cfg.seq, micro_batch, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn,
                            swiglu=cfg.activation == "swiglu", dropout=False, recompute="selective")
    layers_per_chunk = cfg.layers / (pp * v)
    gib = [held * layers_per_chunk * per_layer / GiB for held in timeline.peak_in_flight]
    return {"timeline": timeline, "activation_gib": gib, "name": schedule_name, "p": pp,
            "m": microbatches, "v": v, "model": model}


def explorer_plot(result: dict[str, Any]) -> Figure:
    p, m, v = result["p"], result["m"], result["v"]
    title = f"{result['name']}, p={p}, m={m}" + (f", v={v}" if v > 1 else "")
    title += f" [(p-1)/(vm) = {(p - 1) / (v * m):.2f}]; {result['model']}"
    return plot_schedule_memory(result["timeline"], result["activation_gib"], title)


@register("pipeline")
def pipeline_explorer() -> Explorer:
    controls = {
        "schedule_name": W.Dropdown(options=list(SCHEDULE_NAMES), value="1f1b", description="schedule"),
        "pp": W.IntSlider(value=4, min=2, max=8, description="p (ranks)"),
        "microbatches": W.IntSlider(value=8, min=1, max=16, description="m"),
        "virtual_stages": W.IntSlider(value=2, min=2, max=4, description="v (interleaved)"),
        "backward_over_forward": W.FloatSlider(value=2.0, min=1.0, max=3.0, step=0.25,
                                               description="(B+W) / F"),
        "weight_share": W.FloatSlider(value=0.5, min=0.0, max=0.75, step=0.05, description="W share"),
    }
    return Explorer(controls, explorer_compute, explorer_plot,
                    title="Pipeline schedules: who idles, and how much each rank holds")
