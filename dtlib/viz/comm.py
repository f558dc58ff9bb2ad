"""Communication plots: the alpha-beta model against measurements, bandwidth as nccl-tests
defines it, time curves (flat vs hierarchical all-reduce) and compression's bytes vs accuracy.

Each function takes data and returns a ``matplotlib`` Figure built with ``Figure()`` (no pyplot).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from dtlib.analytic.comm import bus_factor
from dtlib.viz.style import FONT, PALETTE, SMALL_FONT, colour

__all__ = ["plot_alpha_beta", "plot_bandwidth", "plot_compression_tradeoff"]


def plot_alpha_beta(sizes: Sequence[float], model: Mapping[str, Sequence[float]], world_size: int,
                    measured: Sequence[Mapping] | None = None,
                    collective: str = "all_reduce", mark: float | None = None,
                    title: str = "") -> Figure:
    """Time (left) and nccl-tests bus bandwidth (right) against message size, log-log.

    ``model``: ``{label: seconds for each of sizes}`` (lines, e.g. :func:`dtlib.analytic.comm.collective_time`);
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
            ax.plot(x, y, "-", color=colour(i), label=label)
    impls = list(dict.fromkeys(r["impl"] for r in measured or []))
    for j, label in enumerate(impls, start=len(model)):
        pts = sorted((r["bytes"], r["seconds"]) for r in measured if r["impl"] == label)
        xs, t = np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts], dtype=float)
        for ax, y in ((ax_t, t * 1e3), (ax_b, factor * xs / t / 1e9)):
            ax.plot(xs, y, "o", ms=4, color=colour(j), label=label)
    for ax, ylabel in ((ax_t, "time (ms)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="message size S (bytes)", ylabel=ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if mark is not None:
            ax.axvline(mark, color="black", ls=":", lw=1)
    # one legend for both panels, outside them: it never covers a curve or the marked size
    ax_b.legend(*ax_t.get_legend_handles_labels(), fontsize=SMALL_FONT, loc="upper left",
                bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title or f"{collective} on {world_size} ranks", fontsize=FONT + 1)
    fig.tight_layout()
    return fig



def plot_bandwidth(rows: Sequence[Mapping], metric: str = "busbw") -> Figure:
    """Bandwidth (GB/s) against message size, one line per implementation, one panel per
    collective.

    ``rows``: dicts with ``impl``, ``bytes`` and ``metric`` (bytes/s), e.g. from
    ``benchmarks/bench_collectives.py``; rows with different ``collective`` values go to side-by-side
    panels (same y axis), and ``world_size`` goes in the title.
    """
    if metric not in ("busbw", "algbw"):
        raise ValueError(f"metric must be 'busbw' or 'algbw', got {metric!r}")
    if not rows:
        raise ValueError("nothing to plot: rows is empty")
    collectives = list(dict.fromkeys(r.get("collective") for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig = Figure(figsize=(max(6.5, 4.3 * len(collectives)), 3.8))
    axes = fig.subplots(1, len(collectives), sharey=True, squeeze=False)[0]
    for ax, collective in zip(axes, collectives):
        for i, impl in enumerate(impls):  # the same colour for an implementation in every panel
            pts = sorted((r["bytes"], r[metric]) for r in rows
                         if r["impl"] == impl and r.get("collective") == collective)
            if pts:
                ax.plot([b for b, _ in pts], [v / 1e9 for _, v in pts], "o-", ms=3,
                        color=colour(i), label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="message size (bytes)")
        if len(collectives) > 1:
            ax.set_title(str(collective), fontsize=FONT + 1)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=SMALL_FONT)
    axes[0].set_ylabel(f"{metric} (GB/s)")
    extra = [f"{k}={rows[0][k]}" for k in ("collective", "world_size")
             if k in rows[0] and (k != "collective" or len(collectives) == 1)]
    title = f"{metric} as nccl-tests defines it" + (f" ({', '.join(extra)})" if extra else "")
    if len(collectives) > 1:
        fig.suptitle(title, fontsize=FONT + 1)
    else:
        axes[0].set_title(title, fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def plot_compression_tradeoff(rows: Sequence[Mapping], accuracy_range: tuple[float, float] | None = None) -> Figure:
    """Final accuracy against bytes sent per rank per step (log scale), one point per method.

    ``rows``: dicts with ``method``, ``bytes_per_step`` and ``accuracy`` (0-1), optionally
    ``accuracy_std`` (drawn as an error bar), e.g. from ``compression_runs(seeds=...)`` or
    ``benchmarks/bench_compression.py``. ``accuracy_range``: the accuracy axis in percent, fixed
    (a widget that rescales its axis on every change makes a 1-point difference look like 50).
    """
    if not rows:
        raise ValueError("nothing to plot: rows is empty")
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        # colours repeat after 10 methods; the marker changes so that every point stays distinct
        ax.errorbar(r["bytes_per_step"], 100 * r["accuracy"], yerr=100 * r.get("accuracy_std", 0.0),
                    color=colour(i), marker="os^D"[i // len(PALETTE) % 4], ms=6,
                    capsize=3, ls="none", label=r["method"], zorder=3)
    ax.set_xscale("log")
    ax.set(xlabel="bytes sent per rank per step (ring model)", ylabel="final accuracy (%)",
           title="gradient compression: bytes saved vs accuracy")
    ax.grid(True, which="both", alpha=0.3)
    if accuracy_range is not None:
        ax.set_ylim(*accuracy_range)
    # outside the axes: the uncompressed baseline (top right) and every error bar stay visible
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
