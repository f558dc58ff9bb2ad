"""ZeRO and FSDP plots: what each strategy holds per rank and what it sends.

Each function takes data and returns a ``matplotlib`` Figure built with ``Figure()`` (no pyplot).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlib.analytic.units import MiB, binary_unit
from dtlib.viz.charts import plot_grouped_bars
from dtlib.viz.style import FONT, PART_COLORS, SMALL_FONT, colour

__all__ = ["STAGE_NAMES", "plot_stage_costs", "plot_zero_stages", "plot_side_by_side"]

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP (ZeRO-3)"}

_PARTS = [(p, PART_COLORS[p]) for p in ("parameters", "gradients", "optimizer")]


def plot_stage_costs(per_rank: Mapping[str, Sequence[Mapping[str, float]]],
                     predicted: Mapping[str, Mapping[str, float]] | None = None,
                     sent: Mapping[str, Mapping[str, float]] | None = None,
                     gpu_memory: float | None = None, gpu_name: str = "GPU",
                     title: str = "") -> Figure:
    """Left: model-state bytes per rank for each strategy (stacked parameters / gradients /
    optimizer, one bar per rank), the predicted total as a dashed line. Right (if ``sent``):
    bytes one rank sends per step, one bar per series (e.g. ``measured`` and ``predicted``).

    ``per_rank``: ``{"DDP": [{"parameters": b, "gradients": b, "optimizer": b}, ...]}``;
    ``predicted``: ``{"DDP": {"parameters": b, ...}}`` (e.g. :func:`dtlib.analytic.memory.memory_per_gpu`);
    ``sent``: ``{"DDP": {"measured": b, "predicted": b}}``; ``gpu_memory`` draws the GPU's memory.
    """
    if not per_rank:
        raise ValueError("nothing to plot: per_rank is empty")
    fig = Figure(figsize=(10.5 if sent else 7.0, 3.9))
    axes = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]}) if sent else [fig.add_subplot()]
    ax = axes[0]
    totals = [sum(d.get(p, 0) for p, _ in _PARTS) for ranks in per_rank.values() for d in ranks]
    pred_totals = [sum(v.get(p, 0) for p, _ in _PARTS) for v in (predicted or {}).values()]
    scale, unit = binary_unit(max(totals + pred_totals + [gpu_memory or 0]))
    x, ticks = 0, []
    for strategy, ranks in per_rank.items():
        start = x
        for d in ranks:
            bottom = 0.0
            for part, part_colour in _PARTS:
                h = d.get(part, 0) / scale
                ax.bar(x, h, bottom=bottom, color=part_colour, width=0.8)
                bottom += h
            x += 1
        if predicted and strategy in predicted:
            total = sum(predicted[strategy].get(p, 0) for p, _ in _PARTS) / scale
            ax.hlines(total, start - 0.45, x - 0.55, colors="black", linestyles="--", lw=1.2)
        ticks.append(((start + x - 1) / 2, strategy if len(ranks) == 1 else
                      f"{strategy}\n(ranks 0-{len(ranks) - 1})"))
        x += 1
    # only the parts some bar draws: a legend entry for nothing drawn misleads (issue 38)
    drawn = [(p, c) for p, c in _PARTS if any(d.get(p, 0) for ranks in per_rank.values() for d in ranks)]
    handles = [Rectangle((0, 0), 1, 1, color=c) for _, c in drawn]
    labels = [p for p, _ in drawn]
    if predicted:
        handles.append(ax.plot([], [], "k--", lw=1.2)[0])
        labels.append("predicted")
    if gpu_memory:  # named in the legend, which sits outside the axes: nothing hides the line
        handles.append(ax.axhline(gpu_memory / scale, color="grey", lw=1))
        labels.append(f"{gpu_name}: {gpu_memory / scale:.0f} {unit}")
    ax.set_xticks([t for t, _ in ticks], [s for _, s in ticks], fontsize=SMALL_FONT)
    ax.set_ylim(0, 1.1 * max(totals + pred_totals + [gpu_memory or 0]) / scale)
    ax.set_ylabel(f"{unit} per rank")
    ax.legend(handles, labels, fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("model states per rank", fontsize=FONT)
    if sent:
        ax2 = axes[1]
        names = list(dict.fromkeys(k for v in sent.values() for k in v))
        s_scale, s_unit = binary_unit(max(b for v in sent.values() for b in v.values()))
        width = 0.8 / len(names)
        for j, series in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(sent))]
            ax2.bar(xs, [v.get(series, 0) / s_scale for v in sent.values()], width=width,
                    color=colour(j), label=series)
        ax2.set_xticks(range(len(sent)), list(sent), fontsize=SMALL_FONT, rotation=20)
        ax2.set_ylabel(f"{s_unit} sent per rank per step")
        ax2.set_title("communication (ring model)", fontsize=FONT)
        ax2.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        fig.suptitle(title, fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def plot_zero_stages(result: Mapping[int, Mapping], title: str = "") -> Figure:
    """:func:`plot_stage_costs` of a ``{stage: {"per_rank", "predicted", "sent"}}`` result (as
    :func:`dtlib.experiments.zero.measure_zero_stages` returns): measured bars, predicted dashes,
    and the bytes rank 0 sent next to :func:`dtlib.analytic.comm.strategy_volumes`' prediction."""
    names = {z: STAGE_NAMES.get(z, f"stage {z}") for z in result}
    return plot_stage_costs(
        {names[z]: r["per_rank"] for z, r in result.items()},
        predicted={names[z]: r["predicted"] for z, r in result.items()},
        sent={names[z]: {"measured": r["sent"], "predicted": r["predicted"]["sent"]}
              for z, r in result.items() if "sent" in r and "sent" in r["predicted"]},
        title=title)


def plot_side_by_side(values: Mapping[str, Mapping[str, float]], ylabel: str = "MiB per rank",
                      title: str = "", scale: float = MiB) -> Figure:
    """Grouped bars: one group per key of ``values``, one bar per series inside it
    (e.g. ``{"sharded parameters": {"dtlib FSDP": b, "fully_shard": b}}``), divided by ``scale``."""
    return plot_grouped_bars(values, ylabel, title=title, scale=scale)
