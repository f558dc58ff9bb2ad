"""Fault-tolerance pictures: goodput against the checkpoint interval (formula, expectation,
simulation) with Young's and Daly's intervals marked."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from matplotlib.figure import Figure

from dtlib.viz.style import FONT, SMALL_FONT, colour

__all__ = ["plot_goodput_vs_interval"]


def plot_goodput_vs_interval(study: Mapping[str, Any], title: str = "") -> Figure:
    """``study`` as :func:`dtlib.resilience.interval.interval_study` returns it: goodput (%) against
    the interval (minutes, log axis): Young's first-order line, Daly's expectation, the simulated
    runs as dots, and vertical lines at Young's and Daly's intervals."""
    minutes = np.asarray(study["intervals"]) / 60
    fig = Figure(figsize=(9.0, 3.6))
    ax = fig.add_subplot()
    ax.plot(minutes, 100 * np.asarray(study["first_order"]), "-", color=colour(0),
            label="Young, first order: 1 - C/τ - (τ/2 + R)/M")
    ax.plot(minutes, 100 * np.asarray(study["expected"]), "-", color=colour(1), label="Daly, exact expectation")
    ax.plot(minutes, 100 * np.asarray(study["simulated"]), "o", ms=3, color=colour(2),
            label="simulated runs (mean)")
    # the shorter interval's label on the left of its line, the longer one's on the right
    marks = sorted((("young", "Young", ":"), ("daly", "Daly", "--")), key=lambda m: study[m[0]])
    for (key, name, style), side in zip(marks, ("right", "left")):
        ax.axvline(study[key] / 60, color="black", ls=style, lw=1)
        ax.annotate(f" {name} {study[key] / 60:.1f} min ", (study[key] / 60, 0.97), xycoords=("data", "axes fraction"),
                    ha=side, va="top", fontsize=SMALL_FONT)
    ax.set_xscale("log")
    top = 100 * max(np.max(study["expected"]), np.max(study["simulated"]))
    ax.set_ylim(max(0.0, top - 25), top + 6)  # room above the curves for the labels
    ax.set_xlabel("checkpoint interval τ (minutes)", fontsize=FONT)
    ax.set_ylabel("goodput (%)", fontsize=FONT)
    ax.set_title(title or f"job MTBF {study['mtbf_seconds'] / 3600:.2f} h: best simulated interval "
                 f"{study['simulated_best'] / 60:.1f} min", fontsize=FONT + 1)
    ax.grid(True, which="both", alpha=0.3)
    # outside the axes: inside, it would cover a curve or the vertical lines
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
