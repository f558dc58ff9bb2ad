"""Plots of lesson 3 (where the memory goes): bytes per parameter by convention, memory curves,
the recompute trade-off and predicted vs measured bytes.

Each function takes data and returns a ``matplotlib`` Figure built with ``Figure()`` (no pyplot).
For stacked per-GPU breakdowns use :func:`dtlib.viz.memory.plot_memory_breakdown`.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure

from dtlib.memory import GiB
from dtlib.precision import Precision
from dtlib.viz import set_log_axes

__all__ = ["plot_bytes_per_param", "plot_memory_curves", "plot_recompute_tradeoff",
           "plot_predicted_vs_measured"]

MiB = 2 ** 20
# (Precision attribute, label, colour) left to right
_PARTS = [("param", "working weights", "#4c72b0"), ("grad", "gradients", "#55a868"),
          ("master", "fp32 master weights", "#dd8452"), ("grad_copy", "fp32 gradient copy", "#937860"),
          ("states", "optimizer states (Adam m, v)", "#c44e52")]


def plot_bytes_per_param(conventions: Mapping[str, Precision],
                         title: str = "Bytes per parameter of the model states") -> Figure:
    """One horizontal stacked bar per convention: what each byte per parameter holds."""
    if not conventions:
        raise ValueError("nothing to plot: give at least one Precision")
    names = list(conventions)[::-1]
    fig = Figure(figsize=(7.5, 0.45 * len(names) + 1.4))
    ax = fig.add_subplot()
    left = [0.0] * len(names)
    for attr, label, colour in _PARTS:
        widths = [getattr(conventions[n], attr) for n in names]
        if any(widths):
            ax.barh(names, widths, left=left, label=label, color=colour, height=0.6)
            left = [x + w for x, w in zip(left, widths)]
    for i, total in enumerate(left):
        ax.text(total + 0.2, i, f"{total:g}", va="center", fontsize=8)
    ax.set_xlabel("bytes per parameter")
    ax.set_xlim(0, 1.12 * max(left))
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_memory_curves(x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str = "",
                       title: str = "", gpu_memory: float | None = None, gpu_name: str = "GPU",
                       logx: bool = False, logy: bool = False) -> Figure:
    """One line per series (bytes, drawn in GiB) against ``x``, with the GPU's memory dashed;
    ``logx`` (base 2, ticks at the given x) and ``logy`` (base 10) for wide ranges."""
    if not series:
        raise ValueError("nothing to plot: give at least one series")
    for name, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(x)} x values: "
                             "give one value per x")
    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.add_subplot()
    for name, ys in series.items():
        ax.plot(x, [y / GiB for y in ys], marker="o", markersize=3, label=name)
    if gpu_memory:
        ax.axhline(gpu_memory / GiB, color="black", linestyle="--", linewidth=1)
        ax.text(x[0], gpu_memory / GiB, f" {gpu_name}: {gpu_memory / GiB:.0f} GiB", va="bottom", fontsize=8)
    set_log_axes(ax, x, logx, logy)
    if not logy:
        ax.set_ylim(bottom=0)
    ax.set(xlabel=xlabel, ylabel="GiB per GPU")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_recompute_tradeoff(runs: Mapping[str, Mapping[str, float]],
                            title: str = "Gradient checkpointing trades compute for memory") -> Figure:
    """Two panels, one bar per run: bytes saved for backward (MiB) and step time (ms).

    ``runs``: ``{name: {"saved_bytes": ..., "step_seconds": ...}}``.
    """
    if not runs:
        raise ValueError("nothing to plot: give at least one run")
    names = list(runs)
    colours = ["#4c72b0", "#c44e52", "#55a868", "#8172b2"][:len(names)] or None
    fig = Figure(figsize=(7.5, 3.0))
    left, right = fig.subplots(1, 2)
    for ax, key, scale, unit in ((left, "saved_bytes", MiB, "MiB saved for backward"),
                                 (right, "step_seconds", 1e-3, "ms per training step")):
        values = [runs[n][key] / scale for n in names]
        ax.bar(names, values, color=colours, width=0.6)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_ylim(0, 1.15 * max(values))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_predicted_vs_measured(predicted: Mapping[str, float], measured: Mapping[str, float],
                               title: str = "Predicted vs measured") -> Figure:
    """Grouped bars (MiB) per component, annotated with the relative error of the prediction."""
    if set(predicted) != set(measured):
        raise ValueError(f"predicted and measured need the same components, got {sorted(predicted)} "
                         f"and {sorted(measured)}")
    names = list(predicted)
    fig = Figure(figsize=(7, 3.4))
    ax = fig.add_subplot()
    xs = range(len(names))
    ax.bar([i - 0.2 for i in xs], [predicted[n] / MiB for n in names], width=0.4, label="predicted (dtlib)",
           color="#4c72b0")
    ax.bar([i + 0.2 for i in xs], [measured[n] / MiB for n in names], width=0.4, label="measured (PyTorch)",
           color="#dd8452")
    for i, n in enumerate(names):
        error = (predicted[n] - measured[n]) / measured[n] if measured[n] else 0.0
        ax.text(i, max(predicted[n], measured[n]) / MiB, f"{error:+.1%}", ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("MiB")
    ax.set_ylim(0, 1.18 * max(max(predicted.values()), max(measured.values())) / MiB)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
