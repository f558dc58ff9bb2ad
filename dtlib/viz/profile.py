"""Profile pictures: the breakdown of a step per rank (stacked bars, with the findings), a step's
timeline drawn from the parsed trace, and the faults side by side."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from matplotlib.figure import Figure

from dtlib.profile.breakdown import PARTS
from dtlib.viz.style import FONT, PROFILE_COLORS, SMALL_FONT

__all__ = ["plot_breakdown", "plot_step_timeline", "plot_fault_shares"]

_LABELS = {"compute": "compute", "exposed_comm": "exposed communication", "bubble": "bubble",
           "data": "data loading", "optimizer": "optimizer", "other": "other / idle",
           "comm_in_flight": "collective in flight"}


def _stacked(ax, rows: Mapping[str, Mapping[str, float]], scale: float) -> None:
    names = list(rows)
    left = [0.0] * len(names)
    for part in PARTS:
        widths = [scale * rows[n][part] for n in names]
        ax.barh(names, widths, left=left, color=PROFILE_COLORS[part], label=_LABELS[part])
        left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.tick_params(labelsize=FONT)


def plot_breakdown(profile: Mapping[str, Any], findings: Sequence[Any] | None = None) -> Figure:
    """Milliseconds per step of each part, one bar per rank; the findings (if given) in the title."""
    rows = {f"rank {k}": parts for k, parts in profile["breakdown"].items()}
    text = "; ".join(f"{i}. [{f.severity}] {f.kind} {f.share:.0%}"
                     for i, f in enumerate((findings or [])[:3], 1)) or "none above the threshold"
    fig = Figure(figsize=(7.5, 2.2 + 0.35 * len(rows)))
    ax = fig.add_subplot()
    _stacked(ax, rows, 1e3)
    ax.set_xlabel("ms per step", fontsize=FONT)
    ax.set_title(f"step {profile['step_time'] * 1e3:.0f} ms, MFU {profile['mfu']:.0%}, "
                 f"HFU {profile['hfu']:.0%}" + ("" if findings is None else f"\nfindings: {text}"),
                 fontsize=FONT)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=SMALL_FONT, ncol=6, loc="lower center")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    return fig


def plot_step_timeline(intervals_by_rank: Mapping[Any, Mapping[str, Sequence[tuple[float, float]]]]) -> Figure:
    """One step on each rank as drawn from its trace (:func:`dtlib.profile.breakdown.step_intervals`):
    a row of parts per rank, and under it the collectives in flight on any thread."""
    fig = Figure(figsize=(7.5, 1.6 + 0.7 * len(intervals_by_rank)))
    ax = fig.add_subplot()
    labels = []
    for row, (rank, parts) in enumerate(intervals_by_rank.items()):
        for part in (*PARTS, "comm_in_flight"):
            y = 2 * row + (0.75 if part == "comm_in_flight" else 0)
            spans = [(s * 1e3, (t - s) * 1e3) for s, t in parts.get(part, [])]
            ax.broken_barh(spans, (y - 0.3, 0.6 if part != "comm_in_flight" else 0.3),
                           color=PROFILE_COLORS[part], label=_LABELS[part] if row == 0 else None)
        labels.append((2 * row, f"rank {rank}"))
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=FONT)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step", fontsize=FONT)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=SMALL_FONT, ncol=4, loc="lower center")
    fig.tight_layout(rect=(0, 0.22, 1, 1))
    return fig


def plot_fault_shares(profiles: Mapping[str, Mapping[str, Any]]) -> Figure:
    """Each run's breakdown as shares of its slowest rank's step, one bar per run, labelled with
    the top finding."""
    rows = {}
    for name, p in profiles.items():
        slowest = max(p["breakdown"], key=lambda k: p["breakdown"][k]["step"])
        parts = p["breakdown"][slowest]
        top = p["findings"][0].kind if p["findings"] else "none"
        rows[f"{name} -> {top}"] = {k: parts[k] / parts["step"] for k in PARTS}
    fig = Figure(figsize=(7.5, 1.4 + 0.4 * len(rows)))
    ax = fig.add_subplot()
    _stacked(ax, rows, 100.0)
    ax.set_xlabel("% of the step (slowest rank); label: injected fault -> top finding", fontsize=FONT)
    fig.legend(*ax.get_legend_handles_labels(), fontsize=SMALL_FONT, ncol=6, loc="lower center")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig
