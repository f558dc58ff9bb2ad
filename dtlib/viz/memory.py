"""Plots of memory per GPU: stacked breakdown bars against the GPU's capacity.

Functions take data (:class:`~dtlib.memory.MemoryBreakdown`) and return a ``matplotlib`` Figure
built with ``Figure()`` (no pyplot, so nothing leaks between notebook cells or tests).
"""
from __future__ import annotations

from typing import Mapping

from matplotlib.figure import Figure

from dtlib.memory import GiB, MemoryBreakdown

__all__ = ["plot_memory_breakdown", "COMPONENTS"]

# (attribute, label, colour) bottom to top
COMPONENTS = [("parameters", "parameters", "#4c72b0"), ("gradients", "gradients", "#55a868"),
              ("optimizer", "optimizer states", "#c44e52"), ("activations", "activations", "#8172b2"),
              ("temporary", "temporary buffers", "#ccb974"), ("overhead", "framework overhead", "#8c8c8c")]


def plot_memory_breakdown(breakdowns: "MemoryBreakdown | Mapping[str, MemoryBreakdown]",
                          gpu_memory: float | None = None, title: str = "Memory per GPU") -> Figure:
    """One stacked bar per breakdown (GiB) and a dashed line at the GPU's memory.

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
    for i, total in enumerate(bottoms):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=8)
    if gpu_memory:
        name = first.gpu.name if first.gpu is not None else "GPU"
        ax.axhline(gpu_memory / GiB, color="black", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.5, gpu_memory / GiB, f" {name}: {gpu_memory / GiB:.0f} GiB",
                va="bottom", ha="right", fontsize=8)
        ax.set_ylim(0, 1.15 * max(max(bottoms), gpu_memory / GiB))
    ax.set_ylabel("GiB per GPU (most loaded GPU)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
