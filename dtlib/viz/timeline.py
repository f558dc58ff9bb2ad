"""Timelines of a real run: when each gradient bucket's all-reduce was issued and completed,
against the end of backward (data parallelism's overlap).

Each function takes recorded data and returns a ``matplotlib`` Figure built with ``Figure()``.
"""
from __future__ import annotations

from typing import Mapping

from matplotlib.figure import Figure

from dtlib.parallel.ddp import SyncRecord
from dtlib.viz.style import FONT, SMALL_FONT, colour

__all__ = ["plot_overlap_timeline"]


def plot_overlap_timeline(records: "SyncRecord | Mapping[str, SyncRecord]") -> Figure:
    """When each bucket's all-reduce was issued and completed, against the end of backward.

    One panel per record (e.g. ``{"NaiveDDP": r1, "BucketedDDP 1 MB": r2}``). Times in ms from
    the start of forward; grey = forward, light blue = loss + backward; a bar per bucket from
    issue to the completion of its all-reduce (``SyncRecord.bucket_completed``; where a hook gave
    no completion time, to the end of its wait in ``finish_gradient_synchronization``); a dot
    where its last gradient arrived. Bars that start left of the dashed line overlap backward;
    what ends right of it is communication backward did not hide.
    """
    if isinstance(records, SyncRecord):
        records = {"": records}
    if not records:
        raise ValueError("nothing to plot: give at least one SyncRecord")
    fig = Figure(figsize=(8, 1.2 + 0.35 * sum(len(r.bucket_issued) + 2 for r in records.values())))
    # one time axis for every panel, so runs compare at a glance (tick labels on every panel)
    axes = fig.subplots(len(records), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (name, rec) in zip(axes, records.items()):
        t0 = rec.forward_start
        ms = lambda t: 1e3 * (t - t0)  # noqa: E731
        nb = len(rec.bucket_issued)
        ax.barh(nb + 1, ms(rec.forward_end), left=0, color="#bbbbbb", height=0.7)
        ax.text(0, nb + 1, " forward", va="center", fontsize=SMALL_FONT)
        if rec.backward_end is not None:
            ax.barh(nb, ms(rec.backward_end) - ms(rec.forward_end), left=ms(rec.forward_end),
                    color="#a6cee3", height=0.7)
            ax.text(ms(rec.forward_end), nb, " loss + backward", va="center", fontsize=SMALL_FONT)
            ax.axvline(ms(rec.backward_end), color="black", ls="--", lw=1)
        for b in range(nb):
            issued, done = rec.bucket_issued[b], rec.bucket_done[b]
            completed = rec.bucket_completed[b] if rec.bucket_completed else None
            if issued is None:
                continue
            end = next((t for t in (completed, done) if t is not None), issued)
            ax.barh(nb - 1 - b, max(ms(end) - ms(issued), 1e-3), left=ms(issued), height=0.6,
                    color=colour(b))
            if rec.bucket_ready[b] is not None:
                ax.plot(ms(rec.bucket_ready[b]), nb - 1 - b, "k.", ms=4)
        ax.set_yticks(range(nb + 2), [f"bucket {b}" for b in reversed(range(nb))] + ["", ""],
                      fontsize=SMALL_FONT)
        ax.set_xlabel("ms since forward started")
        ax.xaxis.set_tick_params(labelbottom=True)
        title = f"{name}: " if name else ""
        ax.set_title(f"{title}{rec.overlapped_buckets}/{nb} buckets issued before backward ended",
                     fontsize=FONT)
    fig.tight_layout()
    return fig
