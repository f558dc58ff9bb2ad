"""Figures of lesson 11: loss against time and bytes per synchronisation scheme, staleness per
update, and a heterogeneous cluster before and after balancing. ``Figure()`` only, no pyplot."""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure

from dtlib.analytic.units import MiB
from dtlib.viz.style import FONT, SMALL_FONT, colour

__all__ = ["plot_loss_vs_time_and_bytes", "plot_staleness", "plot_rank_balance",
           "plot_stage_balance", "plot_time_and_loss"]


def plot_loss_vs_time_and_bytes(curves: Mapping[str, Mapping[str, Sequence[float]]],
                                labels: Mapping[str, str] | None = None) -> Figure:
    """Held-out loss against wall-clock seconds (left) and MiB sent per rank (right), one line per
    scheme: ``{scheme: {"loss", "time", "bytes"}}`` (a point per evaluation)."""
    if not curves:
        raise ValueError("nothing to plot: curves is empty")
    fig = Figure(figsize=(9.5, 3.6))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for i, (name, c) in enumerate(curves.items()):
        label = (labels or {}).get(name, name)
        left.plot(c["time"], c["loss"], "o-", ms=3, color=colour(i), label=label)
        right.plot([b / MiB for b in c["bytes"]], c["loss"], "o-", ms=3, color=colour(i), label=label)
    left.set_xlabel("wall-clock time (s)", fontsize=FONT)
    right.set_xlabel("MiB sent per rank", fontsize=FONT)
    for ax in (left, right):
        ax.set_ylabel("held-out loss", fontsize=FONT)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=SMALL_FONT)
    left.set_title("loss against time", fontsize=FONT + 1)
    right.set_title("loss against bytes", fontsize=FONT + 1)
    right.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_staleness(runs: Mapping[str, Mapping[str, list]], bounds: Mapping[str, float] | None = None
                   ) -> Figure:
    """Staleness of every update the parameter server applied (updates the gradient did not see),
    in the order applied, one panel per run: ``{name: {"updates": [{"staleness", "worker"}...]}}``.
    ``bounds[name]``: the most SSP allows, drawn dashed and named in the legend."""
    if not runs:
        raise ValueError("nothing to plot: runs is empty")
    fig = Figure(figsize=(3.0 * len(runs) + 2.0, 3.4))
    axes = fig.subplots(1, len(runs), sharey=True, squeeze=False)[0]
    workers = sorted({u["worker"] for r in runs.values() for u in r["updates"]})
    for ax, (name, run) in zip(axes, runs.items()):
        for w in workers:
            pts = [(i, u["staleness"]) for i, u in enumerate(run["updates"]) if u["worker"] == w]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", ms=3, color=colour(w),
                    label=f"worker {w}")
        if bounds and bounds.get(name) is not None and bounds[name] != float("inf"):
            ax.axhline(bounds[name], color="black", ls="--", lw=1, label="most SSP allows")
        ax.set_title(name, fontsize=FONT + 1)
        ax.set_xlabel("update (in the order applied)", fontsize=FONT)
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=SMALL_FONT)
    axes[0].set_ylabel("staleness (updates missed)", fontsize=FONT)
    handles = {}  # label -> first handle: one legend entry per worker across panels
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    axes[-1].legend(list(handles.values()), list(handles), fontsize=SMALL_FONT, loc="upper left",
                    bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_rank_balance(result: Mapping, phases: Sequence[str] = ("equal", "balanced")) -> Figure:
    """Per rank, the seconds per step it computes and the seconds it waits for the slowest, and
    its batch share, for each phase of :func:`dtlib.experiments.heterogeneous.balance_data_parallel`."""
    fig = Figure(figsize=(4.0 * len(phases) + 2.0, 3.6))
    axes = fig.subplots(1, len(phases), sharey=True, squeeze=False)[0]
    top = max(max([result[p]["step_time"]] + list(result[p]["busy"])) for p in phases) * 1e3
    for ax, phase in zip(axes, phases):
        r = result[phase]
        ranks = range(len(r["busy"]))
        busy = [b * 1e3 for b in r["busy"]]
        wait = [max(0.0, r["step_time"] * 1e3 - b) for b in busy]
        ax.bar(ranks, busy, color=colour(0), label="computing")
        ax.bar(ranks, wait, bottom=busy, color=colour(3), label="waiting for the slowest")
        for k in ranks:
            ax.text(k, busy[k] + wait[k], f"{r['sizes'][k]} seq", ha="center", va="bottom",
                    fontsize=SMALL_FONT)
        ax.set_xticks(list(ranks), [f"rank {k}\nx{result['slowdowns'][k]:g}" for k in ranks],
                      fontsize=SMALL_FONT)
        ax.set_title(f"{phase}: {r['throughput']:.0f} seq/s", fontsize=FONT + 1)
        ax.set_ylim(0, 1.2 * top)
        ax.tick_params(labelsize=SMALL_FONT)
    axes[0].set_ylabel("ms per step", fontsize=FONT)
    axes[-1].legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def plot_stage_balance(result: Mapping, plans: Sequence[str] = ("even", "balanced")) -> Figure:
    """Emulated seconds per micro-batch of each pipeline stage and its block count, for each split
    of :func:`dtlib.experiments.heterogeneous.balance_pipeline`; the slowest stage sets the pace."""
    fig = Figure(figsize=(4.0 * len(plans) + 2.0, 3.6))
    axes = fig.subplots(1, len(plans), sharey=True, squeeze=False)[0]
    top = max(max(result[p]["stage_seconds"]) for p in plans) * 1e3
    for ax, plan in zip(axes, plans):
        r = result[plan]
        stages = range(len(r["counts"]))
        ms = [s * 1e3 for s in r["stage_seconds"]]
        ax.bar(stages, ms, color=[colour(3) if s == max(ms) else colour(0) for s in ms])
        for k in stages:
            ax.text(k, ms[k], f"{r['counts'][k]} block{'s' if r['counts'][k] != 1 else ''}", ha="center", va="bottom", fontsize=SMALL_FONT)
        ax.set_xticks(list(stages), [f"stage {k}\nx{result['slowdowns'][k]:g}" for k in stages],
                      fontsize=SMALL_FONT)
        ax.set_title(f"{plan}: step {r['step_time'] * 1e3:.0f} ms", fontsize=FONT + 1)
        ax.set_ylim(0, 1.2 * top)
        ax.tick_params(labelsize=SMALL_FONT)
    axes[0].set_ylabel("ms per micro-batch (F + B)", fontsize=FONT)
    fig.tight_layout()
    return fig


def plot_time_and_loss(result: Mapping) -> Figure:
    """The widget's picture: loss against modelled wall-clock time for DDP and DiLoCo
    (``{"curves": {name: {"time", "loss"}}, "title": str}``), legend outside."""
    fig = Figure(figsize=(7.5, 3.6))
    ax = fig.add_subplot()
    for i, (name, c) in enumerate(result["curves"].items()):
        ax.plot(c["time"], c["loss"], "-", color=colour(i), label=name)
    ax.set_xlabel("modelled wall-clock time (s)", fontsize=FONT)
    ax.set_ylabel("held-out loss", fontsize=FONT)
    ax.set_title(result.get("title", ""), fontsize=FONT)
    ax.grid(True, alpha=0.3)
    ax.tick_params(labelsize=SMALL_FONT)
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig
