"""Plots for the data-parallel family: the ring step by step, bandwidth, overlap, compression, memory.

Each function takes plain data (what :mod:`dtlib.parallel` records or the benchmarks print) and
returns a ``matplotlib.figure.Figure`` built with ``Figure()`` (no pyplot state).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from dtlib.parallel.collectives import ring_progress, ring_schedule
from dtlib.parallel.ddp import SyncRecord

__all__ = ["plot_ring_all_reduce", "plot_bandwidth", "plot_overlap_timeline",
           "plot_compression_tradeoff", "plot_rank_memory"]

_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7"]


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
            ax.add_patch(Rectangle((c, y + 0.1), 0.9, 0.8, facecolor=_COLORS[c % len(_COLORS)],
                                   alpha=0.15 + 0.85 * frac, edgecolor="black", lw=0.6))
            ax.text(c + 0.45, y + 0.5, f"{len(held[r][c])}/{n}", ha="center", va="center", fontsize=8)
        ax.text(-0.15, y + 0.5, f"rank {r}", ha="right", va="center", fontsize=9)
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
                 "cell = inputs summed, arrows = next sends", fontsize=9)
    ax.axis("off")
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
                        color=_COLORS[i % len(_COLORS)], label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="message size (bytes)")
        if len(collectives) > 1:
            ax.set_title(str(collective), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"{metric} (GB/s)")
    extra = [f"{k}={rows[0][k]}" for k in ("collective", "world_size")
             if k in rows[0] and (k != "collective" or len(collectives) == 1)]
    title = f"{metric} as nccl-tests defines it" + (f" ({', '.join(extra)})" if extra else "")
    if len(collectives) > 1:
        fig.suptitle(title, fontsize=10)
    else:
        axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_overlap_timeline(records: "SyncRecord | Mapping[str, SyncRecord]") -> Figure:
    """When each bucket's all-reduce was issued and waited for, against the end of backward.

    One panel per record (e.g. ``{"NaiveDDP": r1, "BucketedDDP 1 MB": r2}``). Times in ms from
    the start of forward; grey = forward, light blue = loss + backward; a bar per bucket from
    issue to the end of its wait in ``finish_gradient_synchronization``; a dot where its last
    gradient arrived. Bars that start left of the dashed line overlap backward.
    """
    if isinstance(records, SyncRecord):
        records = {"": records}
    if not records:
        raise ValueError("nothing to plot: give at least one SyncRecord")
    fig = Figure(figsize=(8, 1.2 + 0.35 * sum(len(r.bucket_issued) + 2 for r in records.values())))
    axes = fig.subplots(len(records), 1, squeeze=False)[:, 0]
    for ax, (name, rec) in zip(axes, records.items()):
        t0 = rec.forward_start
        ms = lambda t: 1e3 * (t - t0)  # noqa: E731
        nb = len(rec.bucket_issued)
        ax.barh(nb + 1, ms(rec.forward_end), left=0, color="#bbbbbb", height=0.7)
        ax.text(0, nb + 1, " forward", va="center", fontsize=7)
        if rec.backward_end is not None:
            ax.barh(nb, ms(rec.backward_end) - ms(rec.forward_end), left=ms(rec.forward_end),
                    color="#a6cee3", height=0.7)
            ax.text(ms(rec.forward_end), nb, " loss + backward", va="center", fontsize=7)
            ax.axvline(ms(rec.backward_end), color="black", ls="--", lw=1)
        for b in range(nb):
            issued, done = rec.bucket_issued[b], rec.bucket_done[b]
            if issued is None:
                continue
            end = done if done is not None else issued
            ax.barh(nb - 1 - b, max(ms(end) - ms(issued), 1e-3), left=ms(issued), height=0.6,
                    color=_COLORS[b % len(_COLORS)])
            if rec.bucket_ready[b] is not None:
                ax.plot(ms(rec.bucket_ready[b]), nb - 1 - b, "k.", ms=4)
        ax.set_yticks(range(nb + 2), [f"bucket {b}" for b in reversed(range(nb))] + ["", ""],
                      fontsize=7)
        ax.set_xlabel("ms since forward started")
        title = f"{name}: " if name else ""
        ax.set_title(f"{title}{rec.overlapped_buckets}/{nb} buckets issued before backward ended",
                     fontsize=9)
    fig.tight_layout()
    return fig


def plot_compression_tradeoff(rows: Sequence[Mapping]) -> Figure:
    """Final accuracy against bytes sent per rank per step (log scale), one point per method.

    ``rows``: dicts with ``method``, ``bytes_per_step`` and ``accuracy`` (0-1), optionally
    ``accuracy_std`` (drawn as an error bar), e.g. from ``benchmarks/bench_compression.py``.
    """
    if not rows:
        raise ValueError("nothing to plot: rows is empty")
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        # colours repeat after 8 methods; the marker changes so that every point stays distinct
        ax.errorbar(r["bytes_per_step"], 100 * r["accuracy"], yerr=100 * r.get("accuracy_std", 0.0),
                    color=_COLORS[i % len(_COLORS)], marker="os^D"[i // len(_COLORS) % 4], ms=6,
                    capsize=3, ls="none", label=r["method"], zorder=3)
    ax.set_xscale("log")
    ax.set(xlabel="bytes sent per rank per step (ring model)", ylabel="final accuracy (%)",
           title="gradient compression: bytes saved vs accuracy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def plot_rank_memory(per_rank: Mapping[str, Sequence[Mapping[str, float]]],
                     predicted: Mapping[str, float] | None = None) -> Figure:
    """Stacked bars of model-state bytes per rank for each strategy, with predictions as ticks.

    ``per_rank``: ``{"DDP": [{"parameters": b, "gradients": b, "optimizer": b}, ...], ...}``, one
    dict per rank; ``predicted``: ``{"DDP": total bytes per rank, ...}`` (e.g. :mod:`dtlib.memory`).
    """
    if not per_rank:
        raise ValueError("nothing to plot: per_rank is empty")
    parts = list(dict.fromkeys(k for ranks in per_rank.values() for d in ranks for k in d))
    fig = Figure(figsize=(max(6.0, 1.0 + 0.5 * sum(len(v) + 1 for v in per_rank.values())), 4.0))
    ax = fig.add_subplot()
    x, ticks, labels = 0, [], []
    for strategy, ranks in per_rank.items():
        start = x
        for d in ranks:
            bottom = 0.0
            for j, part in enumerate(parts):
                h = d.get(part, 0) / 2 ** 20
                ax.bar(x, h, bottom=bottom, color=_COLORS[j % len(_COLORS)], width=0.8)
                bottom += h
            x += 1
        if predicted and strategy in predicted:
            ax.hlines(predicted[strategy] / 2 ** 20, start - 0.45, x - 0.55, colors="black",
                      linestyles="--", lw=1.2)
        ticks.append((start + x - 1) / 2)
        labels.append(f"{strategy}\n(ranks 0-{len(ranks) - 1})")
        x += 1
    handles = [Rectangle((0, 0), 1, 1, color=_COLORS[j % len(_COLORS)]) for j in range(len(parts))]
    ax.legend(handles, parts, fontsize=8)
    ax.set_xticks(ticks, labels, fontsize=8)
    ax.set_ylabel("MiB per rank")
    ax.set_title("model states per rank" + (" (dashed: prediction)" if predicted else ""), fontsize=10)
    fig.tight_layout()
    return fig
