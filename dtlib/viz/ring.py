"""The ring all-reduce drawn step by step, replayed from the schedule the library executes
(:func:`dtlib.parallel.collectives.ring_schedule` / ``ring_progress``).

Each function takes data and returns a ``matplotlib`` Figure built with ``Figure()`` (no pyplot).
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from dtlib.parallel.collectives import ring_progress, ring_schedule
from dtlib.viz.style import FONT, SMALL_FONT, colour

__all__ = ["plot_ring_all_reduce", "plot_ring_steps"]


def plot_ring_all_reduce(world_size: int, step: int) -> Figure:
    """Each rank's chunks after ``step`` steps of a ring all-reduce, and the sends of the next step.

    A cell shows how many ranks' inputs it already sums (full colour = all of them); arrows are
    the chunk transfers of step ``step + 1`` (from :func:`~dtlib.parallel.collectives.ring_schedule`).
    """
    n = world_size
    held = ring_progress(n, step)
    plan = ring_schedule(n, "reduce_scatter") + ring_schedule(n, "all_gather")
    fig = Figure(figsize=(1.1 * n + 2.5, 0.8 * n + 1.2))
    ax = fig.add_subplot()
    for r in range(n):
        y = n - 1 - r
        for c in range(n):
            frac = len(held[r][c]) / n
            ax.add_patch(Rectangle((c, y + 0.1), 0.9, 0.8, facecolor=colour(c),
                                   alpha=0.15 + 0.85 * frac, edgecolor="black", lw=0.6))
            ax.text(c + 0.45, y + 0.5, f"{len(held[r][c])}/{n}", ha="center", va="center", fontsize=SMALL_FONT)
        ax.text(-0.15, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=FONT)
    if step < len(plan):
        for src, dst, chunk in plan[step]:
            ys, yd = n - 1 - src + 0.5, n - 1 - dst + 0.5
            ax.add_patch(FancyArrowPatch((chunk + 0.9, ys), (chunk + 0.9, yd), color="black",
                                         arrowstyle="->", mutation_scale=10,
                                         connectionstyle="arc3,rad=-0.4", lw=0.8))
    phase = "reduce-scatter" if step < n - 1 else ("all-gather" if step < 2 * (n - 1) else "done")
    ax.set_xlim(-1.4, n + 0.3)
    ax.set_ylim(0, n)
    ax.set_title(f"ring all-reduce, {n} ranks: after step {step} of {2 * (n - 1)} ({phase}); "
                 "cell = inputs summed, arrows = next sends", fontsize=FONT)
    ax.axis("off")
    fig.tight_layout()
    return fig


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
                ax.text(c, r, f"{grid[r, c]}", ha="center", va="center", fontsize=SMALL_FONT,
                        color="white" if grid[r, c] == n else "black")
        if k > 0:  # outline what arrived in this step: (receiver, chunk)
            for _, dst, chunk in plan[k - 1]:
                ax.add_patch(_outline(chunk, dst))
        phase = ("start" if k == 0 else
                 f"reduce-scatter {k}/{n - 1}" if k <= n - 1 else f"all-gather {k - n + 1}/{n - 1}")
        ax.set_title(phase, fontsize=SMALL_FONT)
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=SMALL_FONT)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=SMALL_FONT)
    fig.suptitle(f"ring all-reduce on {n} ranks: number = ranks' inputs summed in that chunk "
                 "(outlined: just received)", fontsize=FONT)
    fig.tight_layout()
    return fig


def _outline(chunk: int, rank: int) -> Rectangle:
    return Rectangle((chunk - 0.5, rank - 0.5), 1, 1, fill=False, edgecolor="#e15759", lw=2)
