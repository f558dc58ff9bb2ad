"""Generic charts the topic modules share: lines against a swept value, and grouped bars.

Each function takes data and returns a ``matplotlib`` Figure built with ``Figure()`` (no pyplot).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure

from dtlib.viz.style import FONT, SMALL_FONT, colour, set_log_axes

__all__ = ["plot_curves", "plot_grouped_bars"]


def plot_curves(x: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str,
                ylabel: str, title: str = "", logx: bool = False, logy: bool = False,
                scale: float = 1.0, reference: tuple[float, str] | None = None) -> Figure:
    """One line per series against ``x`` (values multiplied by ``scale``, e.g. 1e3 for ms).

    ``reference``: ``(value, label)`` drawn as a dashed horizontal line (already scaled), e.g. a
    GPU's memory; its label sits at the right end, above the line, and the legend goes outside
    the axes so that it never hides the line or the curves.
    """
    if not series:
        raise ValueError("nothing to plot: give at least one series")
    for label, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series {label!r} has {len(ys)} values for {len(x)} x values: "
                             "give one value per x")
    fig = Figure(figsize=(7.5, 3.6))
    ax = fig.add_subplot()
    for i, (label, ys) in enumerate(series.items()):
        ax.plot(x, [scale * y for y in ys], "o-", ms=3, color=colour(i), label=label)
    if reference is not None:
        value, text = reference
        ax.axhline(value, color="black", ls="--", lw=1)
        ax.annotate(text, (1.0, value), xycoords=("axes fraction", "data"), ha="right", va="bottom",
                    fontsize=SMALL_FONT)
    set_log_axes(ax, x, logx, logy)
    if not logy:
        ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel, fontsize=FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.set_title(title, fontsize=FONT + 1)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_grouped_bars(values: Mapping[str, Mapping[str, float]], ylabel: str, title: str = "",
                      scale: float = 1.0, labels: Mapping[str, str] | None = None,
                      fmt: str = "{:.2f}",
                      errors: Mapping[str, Mapping[str, tuple[float, float]]] | None = None) -> Figure:
    """One group per key of ``values``, one bar per series inside it, divided by ``scale``
    (e.g. ``{"sharded parameters": {"dtlib FSDP": b, "fully_shard": b}}``). Each bar carries its
    value, or ``labels[group]`` above the group's tallest bar when given. ``errors`` (same keys)
    gives a bar's spread as ``(low, high)`` values, drawn as an error bar (e.g. the quartiles of
    repeated runs around their median)."""
    if not values:
        raise ValueError("nothing to plot: values is empty")
    for group, spreads in (errors or {}).items():
        for name, (low, high) in spreads.items():
            if not low <= values[group][name] <= high:
                raise ValueError(f"errors[{group!r}][{name!r}] = ({low}, {high}) must enclose the value "
                                 f"{values[group][name]}")
    series = list(dict.fromkeys(k for v in values.values() for k in v))
    fig = Figure(figsize=(max(6.5, 1.6 * len(values) + 2.5), 3.6))
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    tallest = 0.0
    for j, name in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(values))]
        ys = [v.get(name, 0) / scale for v in values.values()]
        tallest = max([tallest] + ys)
        ax.bar(xs, ys, width=width, color=colour(j), label=name)
        spread = [errors.get(g, {}).get(name) if errors else None for g in values]
        tops = ys[:]
        for i, (x, y, lh) in enumerate(zip(xs, ys, spread)):
            if lh is not None:
                ax.errorbar(x, y, yerr=[[y - lh[0] / scale], [lh[1] / scale - y]], color="black", capsize=3, lw=1)
                tops[i] = lh[1] / scale
        tallest = max([tallest] + tops)
        if labels is None:
            for x, y, top in zip(xs, ys, tops):
                ax.text(x, top, fmt.format(y), ha="center", va="bottom", fontsize=SMALL_FONT)
    for i, group in enumerate(values):
        if labels and group in labels:
            top = max(values[group].values()) / scale
            ax.text(i, top, labels[group], ha="center", va="bottom", fontsize=SMALL_FONT)
    ax.set_xticks(range(len(values)), list(values), fontsize=SMALL_FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.set_ylim(0, 1.18 * tallest)  # room above the bars for their labels
    ax.set_title(title, fontsize=FONT + 1)
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
