"""Pipeline plots: Gantt charts of a schedule (simulated or measured), activations held over time,
and a schedule beside the activation memory of each rank (the bubble against m is a
:func:`dtlib.viz.charts.plot_curves`).

Each function takes a :class:`~dtlib.parallel.schedules.Timeline` (from
:func:`~dtlib.parallel.schedules.simulate` or :func:`~dtlib.parallel.pipeline.timeline_of`) or plain
numbers, and returns a ``matplotlib.figure.Figure`` built with ``Figure()``.
"""
from __future__ import annotations

from typing import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from dtlib.parallel.schedules import KIND_NAMES, Timeline
from dtlib.viz.style import FONT, PALETTE, SMALL_FONT

__all__ = ["draw_gantt", "plot_gantt", "plot_measured_vs_ideal", "plot_in_flight", "plot_schedule_memory"]

KIND_COLORS = {"F": PALETTE[0], "B": PALETTE[1], "W": PALETTE[2]}


def draw_gantt(ax: Axes, timeline: Timeline, title: str = "", unit: str = "", scale: float = 1.0) -> None:
    """One row per rank (rank 0 on top), one bar per action, labelled with its micro-batch; later
    chunks of an interleaved schedule are drawn lighter. Gaps are the bubble."""
    t0 = timeline.start
    chunks = 1 + max(e.action.chunk for ops in timeline.events for e in ops)
    for ops in timeline.events:
        for e in ops:
            y = timeline.ranks - 1 - e.rank
            x, w = (e.start - t0) * scale, (e.end - e.start) * scale
            alpha = 1.0 - 0.45 * e.action.chunk / max(1, chunks - 1) if chunks > 1 else 1.0
            ax.add_patch(Rectangle((x, y - 0.4), w, 0.8, facecolor=KIND_COLORS[e.action.kind], alpha=alpha,
                                   edgecolor="white", linewidth=0.5))
            if w > 0:
                ax.text(x + w / 2, y, str(e.action.microbatch), ha="center", va="center", fontsize=SMALL_FONT,
                        color="white", clip_on=True)
    ax.set_ylim(-0.6, timeline.ranks - 0.4)
    ax.set_yticks(range(timeline.ranks), [f"rank {r}" for r in reversed(range(timeline.ranks))])
    ax.set_xlim(0, timeline.makespan * scale)
    ax.set_xlabel(f"time{f' ({unit})' if unit else ''}")
    ax.set_title(f"{title}{': ' if title else ''}bubble {timeline.bubble_ratio:.2f} of compute "
                 f"({100 * timeline.bubble_fraction:.0f}% idle)", fontsize=FONT)


def _legend(fig: Figure, timeline: Timeline) -> None:
    kinds = sorted({e.action.kind for ops in timeline.events for e in ops}, key="FBW".index)
    fig.legend(handles=[Patch(color=KIND_COLORS[k], label=KIND_NAMES[k]) for k in kinds],
               loc="upper right", fontsize=SMALL_FONT, ncols=len(kinds))


def plot_gantt(timeline: Timeline, title: str = "", unit: str = "", scale: float = 1.0) -> Figure:
    """The Gantt chart of one timeline (numbers in the bars: micro-batches)."""
    fig = Figure(figsize=(9, 0.45 * timeline.ranks + 1.3))
    draw_gantt(fig.add_subplot(), timeline, title, unit, scale)
    _legend(fig, timeline)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    return fig


def plot_measured_vs_ideal(measured: Timeline, ideal: Timeline, title: str = "") -> Figure:
    """A real run's Gantt chart (ms) above the simulator's for the same schedule and costs."""
    fig = Figure(figsize=(9, 0.9 * measured.ranks + 2.2))
    top, bottom = fig.subplots(2, 1, sharex=True)
    draw_gantt(top, measured, f"{title} measured".strip(), "ms", 1e3)
    draw_gantt(bottom, ideal, f"{title} simulated".strip(), "ms", 1e3)
    bottom.set_xlim(0, 1e3 * max(measured.makespan, ideal.makespan))  # shared: show the longer whole
    _legend(fig, measured)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def plot_in_flight(timelines: dict[str, Timeline], rank: int = 0) -> Figure:
    """Micro-batch chunks whose activations ``rank`` holds over time, one line per schedule."""
    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot()
    for name, t in timelines.items():
        points = t.in_flight(rank)
        xs = [0.0] + [(time - t.start) / t.makespan for time, _ in points]
        ys = [0] + [held for _, held in points]
        ax.step(xs, ys, where="post", label=f"{name} (peak {t.peak_in_flight[rank]})")
    ax.set_xlabel("time (fraction of the step)")
    ax.set_ylabel(f"held on rank {rank}")
    ax.legend(fontsize=SMALL_FONT)
    fig.tight_layout()
    return fig


def plot_schedule_memory(timeline: Timeline, activation_gib: Sequence[float], title: str = "") -> Figure:
    """A schedule's Gantt chart beside the activation memory each rank holds at its peak."""
    fig = Figure(figsize=(11, 0.45 * timeline.ranks + 1.6))
    gantt, bars = fig.subplots(1, 2, width_ratios=(4, 1), sharey=True)
    draw_gantt(gantt, timeline, title)
    ys = [timeline.ranks - 1 - r for r in range(timeline.ranks)]
    bars.barh(ys, activation_gib, color=PALETTE[6])
    for y, gib, held in zip(ys, activation_gib, timeline.peak_in_flight):
        bars.text(gib, y, f" {gib:.1f} ({held})", va="center", fontsize=SMALL_FONT)
    bars.set_xlim(0, 1.35 * max(activation_gib))
    bars.set_xlabel("peak activations (GiB)\n(micro-batch chunks held)", fontsize=SMALL_FONT)
    _legend(fig, timeline)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig
