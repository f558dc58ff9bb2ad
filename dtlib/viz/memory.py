"""Plots of memory per GPU: what each byte per parameter holds, stacked breakdowns against the
GPU's capacity, memory curves, the recompute trade-off and predicted vs measured bytes.

Functions take data (:class:`~dtlib.analytic.memory.MemoryBreakdown`, :class:`Precision`, dicts) and
return a ``matplotlib`` Figure built with ``Figure()`` (no pyplot, so nothing leaks).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure

from dtlib.analytic.memory import MemoryBreakdown
from dtlib.analytic.precision import Precision
from dtlib.analytic.units import GiB, MiB
from dtlib.viz.charts import plot_curves, plot_grouped_bars
from dtlib.viz.style import FONT, PALETTE, PART_COLORS, SMALL_FONT

__all__ = ["plot_memory_breakdown", "COMPONENTS", "plot_bytes_per_param", "plot_memory_curves",
           "plot_recompute_tradeoff", "plot_predicted_vs_measured"]

# (attribute, label, colour) bottom to top
COMPONENTS = [(attr, label, PART_COLORS[label]) for attr, label in (
    ("parameters", "parameters"), ("gradients", "gradients"), ("optimizer", "optimizer states"),
    ("activations", "activations"), ("temporary", "temporary buffers"),
    ("overhead", "framework overhead"))]


def plot_memory_breakdown(breakdowns: "MemoryBreakdown | Mapping[str, MemoryBreakdown]",
                          gpu_memory: float | None = None, title: str = "Memory per GPU") -> Figure:
    """One stacked bar per breakdown (GiB, the total under each bar) and a dashed line at the
    GPU's memory, named in the legend.

    ``gpu_memory`` (bytes) defaults to the first breakdown's GPU, if it has one.
    """
    if isinstance(breakdowns, MemoryBreakdown):
        breakdowns = {"": breakdowns}
    if not breakdowns:
        raise ValueError("nothing to plot: give at least one MemoryBreakdown")
    first = next(iter(breakdowns.values()))
    if gpu_memory is None and first.gpu is not None:
        gpu_memory = first.gpu.memory_bytes
    fig = Figure(figsize=(max(6.5, 1.3 * len(breakdowns) + 5), 4.2))
    ax = fig.add_subplot()
    names = list(breakdowns)
    bottoms = [0.0] * len(names)
    for attr, label, colour in COMPONENTS:
        heights = [(getattr(b, attr) or 0.0) / GiB for b in breakdowns.values()]
        if any(heights):
            ax.bar(names, heights, bottom=bottoms, label=label, color=colour, width=0.6)
            bottoms = [x + y for x, y in zip(bottoms, heights)]
    # totals under the bars, where the capacity line can never cross them
    ax.set_xticks(range(len(names)), [f"{n}\n{t:.1f} GiB" if n else f"{t:.1f} GiB"
                                      for n, t in zip(names, bottoms)], fontsize=SMALL_FONT)
    if gpu_memory:
        # the capacity is named in the legend (outside the axes): no bar or label can hide it
        name = first.gpu.name if first.gpu is not None else "GPU"
        ax.axhline(gpu_memory / GiB, color="black", linestyle="--", linewidth=1,
                   label=f"{name}: {gpu_memory / GiB:.0f} GiB")
        ax.set_ylim(0, 1.15 * max(max(bottoms), gpu_memory / GiB))
    ax.set_ylabel("GiB per GPU (most loaded GPU)")
    ax.set_title(title, fontsize=FONT + 1)
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


_PARTS = [("param", "working weights", PART_COLORS["working weights"]),
          ("grad", "gradients", PART_COLORS["gradients"]),
          ("master", "fp32 master weights", PART_COLORS["fp32 master weights"]),
          ("grad_copy", "fp32 gradient copy", PART_COLORS["fp32 gradient copy"]),
          ("states", "optimizer states (Adam m, v)", PART_COLORS["optimizer states"])]


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
        ax.text(total + 0.2, i, f"{total:g}", va="center", fontsize=SMALL_FONT)
    ax.set_xlabel("bytes per parameter")
    ax.set_xlim(0, 1.12 * max(left))
    ax.set_title(title, fontsize=FONT + 1)
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_memory_curves(x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str = "",
                       title: str = "", gpu_memory: float | None = None, gpu_name: str = "GPU",
                       logx: bool = False, logy: bool = False) -> Figure:
    """One line per series (bytes, drawn in GiB) against ``x``, with the GPU's memory dashed;
    ``logx`` (base 2, ticks at the given x) and ``logy`` (base 10) for wide ranges."""
    reference = (gpu_memory / GiB, f"{gpu_name}: {gpu_memory / GiB:.0f} GiB") if gpu_memory else None
    return plot_curves(x, series, xlabel, "GiB per GPU", title=title, logx=logx, logy=logy,
                       scale=1 / GiB, reference=reference)


def plot_recompute_tradeoff(runs: Mapping[str, Mapping[str, float]],
                            title: str = "Gradient checkpointing trades compute for memory") -> Figure:
    """Two panels, one bar per run: bytes saved for backward (MiB) and step time (ms).

    ``runs``: ``{name: {"saved_bytes": ..., "step_seconds": ...}}``.
    """
    if not runs:
        raise ValueError("nothing to plot: give at least one run")
    names = list(runs)
    colours = PALETTE[:len(names)]
    fig = Figure(figsize=(7.5, 3.0))
    left, right = fig.subplots(1, 2)
    for ax, key, scale, unit in ((left, "saved_bytes", MiB, "MiB saved for backward"),
                                 (right, "step_seconds", 1e-3, "ms per training step")):
        values = [runs[n][key] / scale for n in names]
        ax.bar(names, values, color=colours, width=0.6)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=SMALL_FONT)
        ax.set_ylabel(unit)
        ax.set_ylim(0, 1.15 * max(values))
    fig.suptitle(title, fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def plot_predicted_vs_measured(predicted: Mapping[str, float], measured: Mapping[str, float],
                               title: str = "Predicted vs measured") -> Figure:
    """Grouped bars (MiB) per component, annotated with the relative error of the prediction."""
    if set(predicted) != set(measured):
        raise ValueError(f"predicted and measured need the same components, got {sorted(predicted)} "
                         f"and {sorted(measured)}")
    values = {n: {"predicted (dtlib)": predicted[n], "measured (PyTorch)": measured[n]} for n in predicted}
    errors = {n: f"{(predicted[n] - measured[n]) / measured[n]:+.1%}" if measured[n] else "n/a"
              for n in predicted}
    return plot_grouped_bars(values, "MiB", title=title, scale=MiB, labels=errors)
