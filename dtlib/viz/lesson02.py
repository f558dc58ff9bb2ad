"""Plots of lesson 2 (communication): every step of a ring all-reduce, the alpha-beta model against
measurements, and time curves (flat vs hierarchical all-reduce).

Each function takes data and returns a ``matplotlib`` Figure built with ``Figure()`` (no pyplot).
The overlap timeline, bandwidth and compression plots are in :mod:`dtlib.viz.parallel`.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlib.comm import bus_factor
from dtlib.parallel.collectives import ring_progress, ring_schedule
from dtlib.viz import set_log_axes

__all__ = ["plot_ring_steps", "plot_alpha_beta", "plot_curves"]

_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1"]


def plot_ring_steps(world_size: int) -> Figure:
    """Every state of a ring all-reduce on ``world_size`` ranks, one small panel per step.

    A panel is a rank x chunk grid; a cell's number (and shade) says how many ranks' inputs that
    rank's copy of the chunk already sums; the cells that were just sent are outlined. Replays
    :func:`~dtlib.parallel.collectives.ring_progress`, i.e. the schedule the library executes.
    """
    n = world_size
    if not 2 <= n <= 8:
        raise ValueError(f"world_size must be between 2 and 8 to draw, got {n}")
    steps = 2 * (n - 1)
    plan = ring_schedule(n, "reduce_scatter") + ring_schedule(n, "all_gather")
    cols = min(steps + 1, 4 if n > 3 else steps + 1)
    rows = -(-(steps + 1) // cols)
    fig = Figure(figsize=(2.0 * cols + 0.6, 2.0 * rows + 0.5))
    axes = fig.subplots(rows, cols, squeeze=False)
    for k, ax in enumerate(axes.flat):
        if k > steps:
            ax.axis("off")
            continue
        held = ring_progress(n, k)
        grid = np.array([[len(held[r][c]) for c in range(n)] for r in range(n)])
        ax.imshow(grid, cmap="Blues", vmin=0, vmax=n * 1.15)
        for r in range(n):
            for c in range(n):
                ax.text(c, r, f"{grid[r, c]}", ha="center", va="center", fontsize=8,
                        color="white" if grid[r, c] == n else "black")
        if k > 0:  # outline what arrived in this step: (receiver, chunk)
            for _, dst, chunk in plan[k - 1]:
                ax.add_patch(_outline(chunk, dst))
        phase = ("start" if k == 0 else
                 f"reduce-scatter {k}/{n - 1}" if k <= n - 1 else f"all-gather {k - n + 1}/{n - 1}")
        ax.set_title(phase, fontsize=8)
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
    fig.suptitle(f"ring all-reduce on {n} ranks: number = ranks' inputs summed in that chunk "
                 "(outlined: just received)", fontsize=9)
    fig.tight_layout()
    return fig


def _outline(chunk: int, rank: int) -> Rectangle:
    return Rectangle((chunk - 0.5, rank - 0.5), 1, 1, fill=False, edgecolor="#e15759", lw=2)


def plot_alpha_beta(sizes: Sequence[float], model: Mapping[str, Sequence[float]], world_size: int,
                    measured: Sequence[Mapping] | None = None,
                    collective: str = "all-reduce", mark: float | None = None,
                    title: str = "") -> Figure:
    """Time (left) and nccl-tests bus bandwidth (right) against message size, log-log.

    ``model``: ``{label: seconds for each of sizes}`` (lines, e.g. :func:`dtlib.comm.collective_time`);
    ``measured``: rows with ``impl``, ``bytes`` and ``seconds`` (points, one colour per ``impl``;
    e.g. from :func:`dtlib.experiments.communication.time_all_reduce`). busbw = S / t x the collective's bus
    factor (nccl-tests doc/PERFORMANCE.md). ``mark`` draws a vertical line at one message size.
    """
    if not model and not measured:
        raise ValueError("nothing to plot: give model curves or measurements")
    factor = bus_factor(collective, world_size)
    fig = Figure(figsize=(9.5, 3.6))
    ax_t, ax_b = fig.subplots(1, 2)
    x = np.asarray(sizes, dtype=float)
    for i, (label, secs) in enumerate(model.items()):
        t = np.asarray(secs, dtype=float)
        for ax, y in ((ax_t, t * 1e3), (ax_b, factor * x / t / 1e9)):
            ax.plot(x, y, "-", color=_COLORS[i % len(_COLORS)], label=label)
    impls = list(dict.fromkeys(r["impl"] for r in measured or []))
    for j, label in enumerate(impls, start=len(model)):
        pts = sorted((r["bytes"], r["seconds"]) for r in measured if r["impl"] == label)
        xs, t = np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)
        for ax, y in ((ax_t, t * 1e3), (ax_b, factor * xs / t / 1e9)):
            ax.plot(xs, y, "o", ms=4, color=_COLORS[j % len(_COLORS)], label=label)
    for ax, ylabel in ((ax_t, "time (ms)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="message size S (bytes)", ylabel=ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if mark is not None:
            ax.axvline(mark, color="black", ls=":", lw=1)
    ax_t.legend(fontsize=7)
    fig.suptitle(title or f"{collective} on {world_size} ranks", fontsize=10)
    fig.tight_layout()
    return fig


def plot_curves(x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str,
                ylabel: str, title: str = "", logx: bool = False, logy: bool = False,
                scale: float = 1.0) -> Figure:
    """One line per series against ``x`` (values multiplied by ``scale``, e.g. 1e3 for ms)."""
    if not series:
        raise ValueError("nothing to plot: give at least one series")
    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.add_subplot()
    for i, (label, ys) in enumerate(series.items()):
        if len(ys) != len(x):
            raise ValueError(f"series {label!r} has {len(ys)} values for {len(x)} x values")
        ax.plot(x, [scale * y for y in ys], "o-", ms=3, color=_COLORS[i % len(_COLORS)], label=label)
    set_log_axes(ax, x, logx, logy)
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
