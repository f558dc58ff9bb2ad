"""Pictures of the cluster around a job: the global sample order read by different world sizes,
traffic between nodes for a placement, a gang scheduler's Gantt chart, replica checksums over steps
and the bytes of incremental checkpoints. ``Figure()`` only (no pyplot)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dtlib.analytic.units import format_bytes
from dtlib.viz.style import FONT, SMALL_FONT, colour

__all__ = ["plot_sample_order", "plot_placement_traffic", "plot_schedule_gantt", "plot_replica_checksums",
           "plot_checkpoint_bytes"]


def plot_sample_order(orders: Mapping[str, Sequence[tuple[int, int]]], title: str = "") -> Figure:
    """One row per run (e.g. ``"2 ranks"``): a cell per global position, labelled with the sample id
    read there and coloured by the rank that read it. ``orders[run]`` lists ``(sample_id, rank)`` in
    global position order; runs of one global order show the same ids in every row."""
    if not orders:
        raise ValueError("nothing to plot: orders is empty")
    rows = list(orders)
    width = max(len(orders[name]) for name in rows)
    ranks = sorted({rank for name in rows for _, rank in orders[name]})
    fig = Figure(figsize=(max(7.0, 0.42 * width + 2.5), 0.62 * len(rows) + 1.3))
    ax = fig.add_subplot()
    for y, name in enumerate(rows):
        for x, (i, rank) in enumerate(orders[name]):
            ax.add_patch(_cell(x, y, colour(rank)))
            ax.text(x + 0.5, y + 0.5, str(i), ha="center", va="center", fontsize=SMALL_FONT, color="white")
    ax.set_xlim(0, width)
    ax.set_ylim(len(rows), 0)
    ax.set_yticks([y + 0.5 for y in range(len(rows))], rows, fontsize=FONT)
    ax.set_xlabel("global position (sample id written in each cell)", fontsize=FONT)
    ax.tick_params(labelsize=SMALL_FONT)
    ax.set_title(title or "one global order, whatever the number of ranks", fontsize=FONT + 1)
    ax.legend(handles=[Patch(color=colour(r), label=f"rank {r}") for r in ranks],
              fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


def _cell(x: float, y: float, color: str, hatch: str | None = None):
    from matplotlib.patches import Rectangle
    return Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, facecolor=color, edgecolor="white", hatch=hatch)


def plot_placement_traffic(results: Mapping[str, Mapping[str, Any]], nodes_per_rack: int,
                           title: str = "") -> Figure:
    """One heat map per placement: bytes per step from node (row) to node (column); the diagonal
    stays in NVLink, the outlined squares are racks (one leaf switch), the rest crosses the spine.
    ``results[name]`` holds ``matrix`` (node x node bytes) and ``tiers`` (bytes per tier)."""
    if not results:
        raise ValueError("nothing to plot: results is empty")
    names = list(results)
    fig = Figure(figsize=(3.3 * len(names) + 1.2, 3.9))
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    top = max(max(max(r) for r in results[n]["matrix"]) for n in names) or 1.0
    image = None
    for ax, name in zip(axes, names):
        m = np.asarray(results[name]["matrix"], dtype=float)
        image = ax.imshow(m / 2 ** 30, cmap="viridis", vmin=0, vmax=top / 2 ** 30)
        n = m.shape[0]
        for start in range(0, n, nodes_per_rack):
            size = min(nodes_per_rack, n - start)
            ax.add_patch(_square(start - 0.5, size))
        t = results[name]["tiers"]
        ax.set_title(f"{name}\nleaf {format_bytes(t['leaf'])}, spine {format_bytes(t['spine'])}", fontsize=FONT)
        ax.set_xlabel("to node", fontsize=FONT)
        ax.set_ylabel("from node", fontsize=FONT)
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        ax.tick_params(labelsize=SMALL_FONT)
    cbar = fig.colorbar(image, ax=list(axes), shrink=0.85)
    cbar.set_label("GiB per step", fontsize=FONT)
    cbar.ax.tick_params(labelsize=SMALL_FONT)
    fig.suptitle(title or "traffic between nodes for each placement (boxes: racks)", fontsize=FONT + 1)
    return fig


def _square(start: float, size: int):
    from matplotlib.patches import Rectangle
    return Rectangle((start, start), size, size, fill=False, edgecolor="white", linewidth=1.5)


def plot_schedule_gantt(schedules: Mapping[str, Sequence[Any]], gpus: int, gpus_per_node: int,
                        title: str = "") -> Figure:
    """One panel per policy: a GPU per row, each job a bar over the GPUs and time it held; a job
    spread over more nodes than it needs is hatched (it runs slower). ``schedules[policy]`` is
    :func:`dtlib.plan.scheduler.simulate`'s list."""
    if not schedules:
        raise ValueError("nothing to plot: schedules is empty")
    names = list(schedules)
    jobs = list(dict.fromkeys(s.job.name for sched in schedules.values() for s in sched))
    end = max(s.end for sched in schedules.values() for s in sched)
    fig = Figure(figsize=(8.5, 1.0 + (0.22 * gpus + 0.7) * len(names)))
    axes = fig.subplots(len(names), 1, squeeze=False, sharex=True)[:, 0]
    for ax, name in zip(axes, names):
        for s in schedules[name]:
            c = colour(jobs.index(s.job.name))
            for g in s.gpus:
                ax.barh(g, s.end - s.start, left=s.start, height=0.8, color=c,
                        hatch="//" if s.slowdown > 1 else None, edgecolor="white")
            gs = sorted(s.gpus)
            block = next((i for i in range(1, len(gs)) if gs[i] != gs[i - 1] + 1), len(gs))  # first run
            ax.text((s.start + s.end) / 2, (gs[0] + gs[block - 1]) / 2, s.job.name, ha="center",
                    va="center", fontsize=SMALL_FONT, color="black",
                    bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=1))
        for b in range(gpus_per_node, gpus, gpus_per_node):
            ax.axhline(b - 0.5, color="black", linewidth=0.8)
        ax.set_ylim(gpus - 0.5, -0.5)
        ax.set_xlim(0, end * 1.02)
        ax.set_yticks(range(gpus))
        ax.tick_params(labelsize=SMALL_FONT)
        ax.set_ylabel("GPU", fontsize=FONT)
        finish = max(s.end for s in schedules[name])
        wait = sum(s.wait for s in schedules[name]) / len(schedules[name])
        ax.set_title(f"{name}: all done at {finish:g}, mean wait {wait:.1f}", fontsize=FONT)
    axes[-1].set_xlabel("time (lines between rows: node boundaries)", fontsize=FONT)
    handles = [Patch(color=colour(i), label=j) for i, j in enumerate(jobs)]
    handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//", label="spread: slower"))
    axes[0].legend(handles=handles, fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title or "gang scheduling: who runs where and when", fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def plot_replica_checksums(records: Sequence[Mapping[str, Any]], world_size: int, flipped: tuple[int, int] | None = None,
                           title: str = "") -> Figure:
    """A cell per (step, rank): green where its checksum agreed with its replicas', red where it was
    named as diverged, grey on steps without a comparison. ``records``: ``dtlib train --metrics``
    lines; ``flipped``: (step, rank) of the injected bit flip, marked with an x."""
    if not records:
        raise ValueError("nothing to plot: records is empty")
    steps = [r["step"] for r in records]
    fig = Figure(figsize=(max(6.0, 0.45 * len(steps) + 2.5), 0.45 * world_size + 1.5))
    ax = fig.add_subplot()
    for x, r in enumerate(records):
        for rank in range(world_size):
            if "diverged" not in r:
                c = "#dddddd"
            else:
                c = "#e15759" if rank in r["diverged"] else "#59a14f"
            ax.add_patch(_cell(x, rank, c))
    if flipped is not None and flipped[0] in steps:
        ax.plot(steps.index(flipped[0]) + 0.5, flipped[1] + 0.5, marker="x", color="black", markersize=10,
                linestyle="none", label="bit flipped")
    ax.set_xlim(0, len(steps))
    ax.set_ylim(world_size, 0)
    ax.set_xticks([x + 0.5 for x in range(len(steps))], [str(s) for s in steps], fontsize=SMALL_FONT)
    ax.set_yticks([r + 0.5 for r in range(world_size)], [f"rank {r}" for r in range(world_size)], fontsize=SMALL_FONT)
    ax.set_xlabel("step", fontsize=FONT)
    handles = [Patch(color="#59a14f", label="agrees"), Patch(color="#e15759", label="diverged"),
               Patch(color="#dddddd", label="not compared")]
    if flipped is not None:
        handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or "cross-replica parameter checksums", fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def plot_checkpoint_bytes(runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str = "") -> Figure:
    """Bytes each save wrote, one group of bars per run (``runs[name]``: ``dtlib train
    --incremental``'s ``checkpoint_bytes``), full saves solid and deltas hatched."""
    if not runs:
        raise ValueError("nothing to plot: runs is empty")
    fig = Figure(figsize=(7.5, 3.4))
    ax = fig.add_subplot()
    names = list(runs)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        for j, w in enumerate(runs[name]):
            ax.bar(j + (i - (len(names) - 1) / 2) * width, w["bytes"] / 1e3, width, color=colour(i),
                   hatch="//" if w["kind"] == "delta" else None, edgecolor="white",
                   label=name if j == 0 else None)
    steps = [w["step"] for w in runs[names[0]]]
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=SMALL_FONT)
    ax.set_xlabel("checkpoint after step", fontsize=FONT)
    ax.set_ylabel("kB written (rank 0)", fontsize=FONT)
    ax.tick_params(labelsize=SMALL_FONT)
    handles = ax.get_legend_handles_labels()[0] + [Patch(facecolor="white", edgecolor="gray", hatch="//",
                                                         label="delta")]
    ax.legend(handles=handles, fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or "incremental checkpoints: bytes per save", fontsize=FONT + 1)
    fig.tight_layout()
    return fig
