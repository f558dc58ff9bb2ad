"""Plots of the planner: the ranked layouts' step-time breakdown and error band next to their memory per GPU.

Functions take the rows of :attr:`dtlib.plan.search.SearchResult.configs` (plain dicts) and return a
``matplotlib`` Figure built with ``Figure()``.
"""
from __future__ import annotations

import textwrap
from typing import Any, Sequence

from matplotlib.figure import Figure

from dtlib.analytic.units import GiB
from dtlib.plan.steptime import TERMS
from dtlib.viz.style import FONT, PART_COLORS, SMALL_FONT, colour

__all__ = ["layout_label", "plot_plan"]


def layout_label(config: dict[str, Any]) -> str:
    """A short name for a layout: ``dp64 tp1 pp1 cp2 | ZeRO 3, none``."""
    v = f" v{config['virtual_stages']}" if config["virtual_stages"] > 1 else ""
    sp = " SP" if config["sequence_parallel"] else ""
    return (f"dp{config['dp']} tp{config['tp']} pp{config['pp']}{v} cp{config['cp']} mb{config['micro_batch']}"
            f" | ZeRO {config['zero']}, {config['recompute']}{sp}")


def plot_plan(configs: Sequence[dict[str, Any]], capacity: float, title: str = "",
              why: str | None = None) -> Figure:
    """Left: each layout's step time stacked by term (fastest on top), with its error band
    (:mod:`dtlib.plan.uncertainty`) as an error bar where the validation covers it. Right: its memory
    per GPU against ``capacity`` bytes. With no layout, ``why`` is written in the figure instead."""
    fig = Figure(figsize=(10, 0.45 * max(len(configs), 3) + 2.0))
    if not configs:
        ax = fig.add_subplot()
        ax.axis("off")
        text = why or "no layout"
        wrapped = textwrap.fill(text, 110, break_long_words=False)  # at spaces, never mid-word
        ax.text(0, 0.5, wrapped, fontsize=FONT, va="center")
        ax.set_title(title, fontsize=FONT + 1)
        return fig
    time_ax, mem_ax = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 1]}, sharey=True)
    names = [layout_label(c) for c in configs][::-1]
    rows = list(configs)[::-1]
    left = [0.0] * len(rows)
    for i, term in enumerate(TERMS):
        widths = [c["breakdown"][term] for c in rows]
        if any(widths):
            time_ax.barh(names, widths, left=left, color=colour(i), label=term)
            left = [a + b for a, b in zip(left, widths)]
    ends = list(left)
    for y, (total, c) in enumerate(zip(left, rows)):
        band = c.get("band", {}).get("step_time_s")
        if band and band["covered"]:  # the held-out error band (dtlib.plan.uncertainty) as an error bar
            time_ax.errorbar(total, y, xerr=[[total - band["low"]], [band["high"] - total]], fmt="none",
                             ecolor="black", elinewidth=1, capsize=3)
            ends[y] = band["high"]
            note = f", {100 * (band['low'] / total - 1):+.0f}%..{100 * (band['high'] / total - 1):+.0f}%"
        else:
            note = ", band: not covered" if band else ""
        time_ax.text(ends[y], y, f" {total:.3g} s{note}, MFU {100 * c['mfu']:.0f}%", va="center", fontsize=SMALL_FONT)
    time_ax.set_xlim(0, 1.45 * max(ends))
    time_ax.set_xlabel("seconds per step", fontsize=FONT)
    time_ax.tick_params(labelsize=SMALL_FONT)
    time_ax.legend(fontsize=SMALL_FONT, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / len(rows)),
                   ncol=5, frameon=False)
    time_ax.set_title(title, fontsize=FONT + 1)
    mem = [c["memory_per_gpu_bytes"] / GiB for c in rows]
    mem_ax.barh(names, mem, color=PART_COLORS["activations"])
    mem_ax.axvline(capacity / GiB, color="black", ls="--", lw=1)
    mem_ax.set_xlim(0, 1.15 * max(max(mem), capacity / GiB))
    mem_ax.set_xlabel(f"GiB per GPU (dashes: {capacity / GiB:.0f} GiB usable)", fontsize=FONT)
    mem_ax.tick_params(labelsize=SMALL_FONT)
    fig.tight_layout()
    return fig
