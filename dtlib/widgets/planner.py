"""The planner ``"planner"``: model, cluster and batch -> the ranked layouts of
:func:`dtlib.plan.search.search`, their step-time breakdown and memory
(:func:`dtlib.viz.plan.plot_plan`), and the run's days and dollars (:func:`dtlib.plan.training.training_plan`)."""
from __future__ import annotations

from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure

from dtlib.analytic.hardware import cluster
from dtlib.analytic.presets import get_preset
from dtlib.plan.search import search
from dtlib.plan.steptime import StepOptions
from dtlib.plan.training import training_plan
from dtlib.viz.plan import plot_plan
from dtlib.widgets.base import Explorer, register

__all__ = ["planner_explorer", "planner_compute", "planner_plot", "MODELS"]

MODELS = ("capstone-10b", "llama3-8b", "llama3-70b", "gpt3-175b")


def planner_compute(model: str, nodes: int, gpu: str, global_batch: int, precision: str,
                    tokens: float, price: float) -> dict[str, Any]:
    """The top 5 layouts of ``model`` on ``nodes`` x 8 ``gpu`` at ``global_batch`` sequences, and
    the training plan of the best for ``tokens`` at ``price`` dollars per GPU-hour."""
    cfg = get_preset(model)
    cl = cluster(gpu, nodes, 8)
    r = search(cfg, cl, global_batch, options=StepOptions(dtype=precision), top=5)
    plan = None
    if r.configs:
        best = r.configs[0]
        plan = training_plan(tokens=tokens, tokens_per_step=global_batch * cfg.seq, step_time=best["step_time_s"],
                             gpus=cl.world_size, gpu=gpu, price_per_gpu_hour=price)
    return {"model": cfg.name, "gpus": cl.world_size, "gpu": gpu, "result": r, "plan": plan}


def planner_plot(d: dict[str, Any]) -> Figure:
    r, plan = d["result"], d["plan"]
    title = f"{d['model']} on {d['gpus']:,} x {d['gpu']}: {r.fitting:,} of {r.searched:,} layouts fit"
    if plan is not None:
        title += (f"; {plan.tokens / 1e12:g}T tokens: {plan.days:.1f} days, ${plan.cost_usd / 1e6:.2f}M, "
                  f"{plan.energy_mwh:,.0f} MWh, {plan.expected_failures:.1f} failures expected")
    return plot_plan(r.configs, r.capacity, title=title, why=r.why)


@register("planner")
def planner_explorer() -> Explorer:
    """Model, nodes of 8 GPUs, GPU, global batch, precision, tokens and price -> ranked layouts."""
    return Explorer(
        {"model": W.Dropdown(options=MODELS, value="capstone-10b", description="model"),
         "nodes": W.Dropdown(options=[2, 4, 16, 64, 128, 1024], value=16, description="nodes x 8"),
         "gpu": W.Dropdown(options=["h100-sxm", "h200", "b200", "a100-80gb"], value="h100-sxm", description="GPU"),
         "global_batch": W.Dropdown(options=[512, 1024, 2048, 4096], value=1024, description="batch"),
         "precision": W.ToggleButtons(options=["bf16", "fp8"], value="bf16", description="matmuls"),
         "tokens": W.Dropdown(options=[("100B", 1e11), ("1T", 1e12), ("10T", 1e13)], value=1e12,
                              description="tokens"),
         "price": W.FloatSlider(value=2.5, min=1.5, max=7.0, step=0.5, description="$/GPU-h")},
        compute=planner_compute, plot=planner_plot,
        title="The planner: every valid layout, ranked by step time at equal global batch")
