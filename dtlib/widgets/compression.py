"""Compression explorer: ``"compression"`` (PowerSGD rank, top-k share, steps -> bytes per step
and accuracy, a real 2-rank run)."""
from __future__ import annotations

import ipywidgets as W

from dtlib.experiments.communication import compression_runs
from dtlib.viz.comm import plot_compression_tradeoff
from dtlib.viz.style import FONT
from dtlib.widgets.base import Explorer, register

__all__ = ["compression_explorer"]


def _compression_result(powersgd_rank: int, topk_percent: float, steps: int) -> dict:
    methods = ["none (fp32 all-reduce)", f"PowerSGD rank {powersgd_rank}",
               f"top-k {topk_percent:g}% + error feedback"]
    rows = compression_runs(methods, steps=steps, world_size=2, batch=32, seed=0)
    base = rows[0]["bytes_per_step"]
    return {"rows": rows, "steps": steps,
            "fewer_bytes": {r["method"]: base / r["bytes_per_step"] for r in rows}}


def _compression_plot(r: dict):
    # one axis for every setting, so moving a slider moves the points, not the scale
    fig = plot_compression_tradeoff(r["rows"], accuracy_range=(0, 100))
    fewer = ", ".join(f"{m.split(' +')[0]}: {x:.0f}x" for m, x in r["fewer_bytes"].items() if x > 1)
    fig.axes[0].set_title(f"{r['steps']} steps on 2 ranks, one seed (a few points are noise); "
                          f"fewer bytes than fp32 - {fewer}", fontsize=FONT)
    return fig


@register("compression")
def compression_explorer() -> Explorer:
    """PowerSGD rank, top-k share and training steps -> bytes each rank sends per step and test
    accuracy, next to the uncompressed all-reduce (a real 2-rank run of the MNIST CNN with
    :func:`dtlib.experiments.communication.compression_runs`; PowerSGD compresses after 10 steps)."""
    return Explorer(
        {"powersgd_rank": W.SelectionSlider(options=[1, 2, 4, 8, 16], value=2,
                                            description="PowerSGD rank"),
         "topk_percent": W.SelectionSlider(options=[0.1, 1.0, 10.0], value=1.0,
                                           description="top-k %"),
         "steps": W.SelectionSlider(options=[20, 40, 80], value=40, description="steps")},
        compute=_compression_result, plot=_compression_plot,
        title="Gradient compression, measured: bytes per step vs accuracy")
