"""Tensor-parallel explorer ``"tp_within_node"``: TP degree, model width and link -> the time one
layer spends in its 4 all-reduces vs in its matmuls (:func:`dtlib.analytic.comm.tp_layer_times`)."""
from __future__ import annotations

import ipywidgets as W

from dtlib.analytic.comm import tp_layer_times
from dtlib.viz.charts import plot_curves
from dtlib.widgets.base import Explorer, register

__all__ = ["tp_within_node_explorer"]

TP_DEGREES = [1, 2, 4, 8, 16, 32, 64]


def _result(tp: int, hidden: int, link: str) -> dict:
    sweep = tp_layer_times(hidden, TP_DEGREES, link)
    here = tp_layer_times(hidden, tp, link)
    return {"tp": tp, "hidden": hidden, "link": link,
            "comm_ms": [1e3 * t for t in sweep["comm_seconds"]],
            "compute_ms": [1e3 * t for t in sweep["compute_seconds"]],
            "comm_here_ms": 1e3 * here["comm_seconds"], "compute_here_ms": 1e3 * here["compute_seconds"]}


def _plot(r: dict):
    verdict = ("communication dominates" if r["comm_here_ms"] > r["compute_here_ms"]
               else "compute dominates")
    return plot_curves(
        TP_DEGREES, {"all-reduces (4 per layer)": r["comm_ms"], "matmuls (H100 bf16 peak)": r["compute_ms"]},
        "TP degree", "ms per layer (fwd + bwd)", logx=True, logy=True,
        title=f"h={r['hidden']} over {r['link']}, TP={r['tp']}: {r['comm_here_ms']:.2f} ms of "
              f"all-reduce vs {r['compute_here_ms']:.2f} ms of matmul - {verdict}")


@register("tp_within_node")
def tp_within_node_explorer() -> Explorer:
    """TP degree, width and link -> communication vs computation per layer (seq 4096, one
    sequence per micro-batch, bf16 activations, H100 peak)."""
    return Explorer(
        {"tp": W.SelectionSlider(options=TP_DEGREES, value=8, description="TP degree"),
         "hidden": W.SelectionSlider(options=[2048, 4096, 8192, 16384], value=8192,
                                     description="hidden"),
         "link": W.Dropdown(options=["nvlink4", "ib-ndr", "pcie5"], value="nvlink4",
                            description="link")},
        compute=_result, plot=_plot,
        title="Why TP stays within a node: per-layer all-reduce time vs matmul time")
