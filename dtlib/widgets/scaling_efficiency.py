"""Scaling-efficiency explorer: world size and per-rank batch -> measured throughput and efficiency."""
import ipywidgets as W

from dtlib.data import load_mnist
from dtlib.experiments.scaling_efficiency import measure_throughput, scaling_efficiency
from dtlib.viz.training import plot_scaling
from dtlib.widgets.base import Explorer, register


def _measure(max_ranks: int, per_rank_batch: int, data) -> dict:
    throughput = measure_throughput(list(range(1, max_ranks + 1)), data, per_rank_batch, steps=4,
                                    progress=False)
    return {"throughput": throughput, "efficiency": scaling_efficiency(throughput)}


@register("scaling")
def scaling_explorer(data=None) -> Explorer:
    data = data if data is not None else load_mnist("train", verbose=False)
    return Explorer(
        {"per_rank_batch": W.Dropdown(options=[16, 64, 256], value=64, description="batch/rank"),
         "max_ranks": W.IntSlider(value=2, min=1, max=4, description="up to N ranks")},
        compute=lambda per_rank_batch, max_ranks: _measure(max_ranks, per_rank_batch, data),
        plot=lambda r: plot_scaling(r["throughput"], r["efficiency"]),
        title="Weak scaling measured on this machine")
