"""Checkpoint-interval explorer ``"checkpoint_interval"``: GPUs, MTBF per GPU, checkpoint size,
storage bandwidth and restart time -> goodput against the interval, Young's and Daly's points and
a Monte-Carlo run (:func:`dtlib.resilience.interval.interval_study`)."""
from __future__ import annotations

import ipywidgets as W

from dtlib.analytic.reliability import LLAMA3_GPU_MTBF_HOURS
from dtlib.resilience.interval import checkpoint_cost, interval_study
from dtlib.viz.resilience import plot_goodput_vs_interval
from dtlib.widgets.base import Explorer, register

__all__ = ["checkpoint_interval_explorer"]


def _result(gpus: int, gpu_mtbf_hours: float, checkpoint_gb: float, bandwidth_gbs: float,
            restart_minutes: float) -> dict:
    cost = checkpoint_cost(checkpoint_gb * 1e9, bandwidth_gbs * 1e9)
    study = interval_study(gpus, gpu_mtbf_hours, cost, restart_minutes * 60, points=25, segments=1000, runs=4)
    return {**study, "checkpoint_seconds": cost}


def _plot(r: dict):
    return plot_goodput_vs_interval(
        r, title=f"job MTBF {r['mtbf_seconds'] / 3600:.2f} h, checkpoint {r['checkpoint_seconds']:.0f} s: "
                 f"Daly {r['daly'] / 60:.1f} min -> {100 * r['goodput_at_daly']:.1f}% goodput")


@register("checkpoint_interval")
def checkpoint_interval_explorer() -> Explorer:
    """The cluster and its storage -> how often to checkpoint, and what it costs."""
    return Explorer(
        {"gpus": W.SelectionSlider(options=[1024, 2048, 4096, 8192, 16384, 32768, 100000], value=16384,
                                   description="GPUs"),
         "gpu_mtbf_hours": W.FloatLogSlider(value=LLAMA3_GPU_MTBF_HOURS, base=10, min=3.5, max=6, readout_format=",.0f",
                                            description="MTBF/GPU (h)"),
         "checkpoint_gb": W.FloatLogSlider(value=800, base=10, min=1, max=4, description="ckpt (GB)"),
         "bandwidth_gbs": W.FloatLogSlider(value=10, base=10, min=0, max=3, description="storage GB/s"),
         "restart_minutes": W.FloatSlider(value=10, min=0, max=60, step=1, description="restart (min)")},
        compute=_result, plot=_plot,
        title="How often to checkpoint: goodput vs interval (Young 1974, Daly 2006, simulation)")
