"""DiLoCo explorer: ``"diloco"`` (H, outer learning rate, link bandwidth, slow-rank factor ->
time and loss of DiLoCo next to DDP)."""
from __future__ import annotations

import ipywidgets as W

from dtlib.experiments.local_sgd import diloco_tradeoff
from dtlib.viz.local_sgd import plot_time_and_loss
from dtlib.widgets.base import Explorer, register

__all__ = ["diloco_explorer"]


@register("diloco")
def diloco_explorer() -> Explorer:
    """H (inner steps per synchronisation), DiLoCo's outer learning rate, the link's bandwidth and
    how much slower the slowest rank is -> held-out loss against wall-clock time for DDP and
    DiLoCo. The losses are real training runs of 4 replicas of a small TinyGPT (simulated in one
    process, cached); the time is this machine's measured step time x the slowdown plus, per
    synchronisation, an all-reduce over the emulated link (:func:`dtlib.experiments.local_sgd.modelled_seconds`)."""
    return Explorer(
        {"sync_every": W.SelectionSlider(options=[1, 2, 4, 8, 16], value=8, description="H (steps per sync)"),
         "outer_lr": W.SelectionSlider(options=[0.3, 0.5, 0.7, 1.0], value=0.7, description="outer lr"),
         # the lesson's link (dtlib.experiments.local_sgd.Run: 20 MB/s) by default
         "bandwidth_mb_s": W.FloatLogSlider(value=20.0, base=10, min=-1, max=3, step=0.1, readout_format=".3g",
                                            description="link MB/s"),
         "slowdown": W.FloatSlider(value=1.0, min=1.0, max=4.0, step=0.5, description="slowest rank x")},
        compute=diloco_tradeoff, plot=plot_time_and_loss,
        title="DiLoCo against DDP: communicate every H steps")
