"""Pictures of one layout under several frameworks: the losses next to one process, the bytes each
rank holds against the prediction, the collectives each framework issued, what a silent default
changes, and what the emitter writes for a layout. ``Figure()`` only (no pyplot); each function
takes plain data (numbers, dicts of numbers, strings), never a framework object."""
from __future__ import annotations

import textwrap
from typing import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlib.analytic.units import GiB, binary_unit
from dtlib.viz.charts import plot_grouped_bars
from dtlib.viz.style import FONT, PART_COLORS, SMALL_FONT, colour
from dtlib.viz.zero import plot_stage_costs

__all__ = ["plot_framework_losses", "plot_framework_memory", "plot_framework_collectives",
           "plot_silent_defaults", "plot_emitted", "plot_fullsize_terms"]

# Differences of exactly 0 cannot sit on a log axis: they are drawn at this floor and labelled.
_FLOOR = 1e-12
_STATES = ("parameters", "gradients", "optimizer")


def _log_bars(ax, groups: Mapping[str, Mapping[str, float]], ylabel: str) -> None:
    """Bars on a log axis, one group per key, one bar per series; a 0 drawn at the floor as "0"."""
    series = list(dict.fromkeys(k for v in groups.values() for k in v))
    width = 0.8 / len(series)
    for j, name in enumerate(series):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ys = [groups[g].get(name, 0.0) for g in groups]
        ax.bar(xs, [max(y, _FLOOR) for y in ys], width=width, color=colour(j), label=name)
        for x, y in zip(xs, ys):
            ax.text(x, max(y, _FLOOR), "0" if y == 0 else f"{y:.0e}", ha="center", va="bottom",
                    fontsize=SMALL_FONT)
    ax.set_yscale("log")
    top = max([max(v.values(), default=0.0) for v in groups.values()] + [_FLOOR])
    ax.set_ylim(_FLOOR / 3, top * 30)  # room above the tallest bar for its label
    ax.set_xticks(range(len(groups)), list(groups), fontsize=SMALL_FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_framework_losses(losses: Mapping[str, Sequence[float]], references: Mapping[str, Sequence[float]],
                          diffs: Mapping[str, Mapping[str, float]], title: str = "") -> Figure:
    """Left: each framework's loss per step (markers) on its own one-process run (a dashed line of
    the same colour: each framework trains the small model it can hold). Right: the largest
    difference from one process, of any step's loss and of any parameter element
    (``diffs[name] = {"loss": d, "parameters": d}``, e.g. from :func:`dtlib.frameworks.common.compare`),
    on a log axis: equal to one process shows as bars near fp32 rounding (about 1e-7)."""
    if not losses:
        raise ValueError("nothing to plot: losses is empty")
    fig = Figure(figsize=(12.0, 3.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.25]})
    markers = "os^vDP*X"
    for i, (name, ys) in enumerate(losses.items()):
        if name in references:
            ref = references[name]
            left.plot(range(1, len(ref) + 1), ref, "--", lw=1.2, color=colour(i), label=f"{name}: one process")
        left.plot(range(1, len(ys) + 1), ys, markers[i % len(markers)], ms=7, color=colour(i), label=name,
                  linestyle="none", fillstyle="none")
    steps = max(len(ys) for ys in losses.values())
    left.set_xticks(range(1, steps + 1))
    left.set_xlabel("step", fontsize=FONT)
    left.set_ylabel("loss (global mean)", fontsize=FONT)
    left.tick_params(labelsize=SMALL_FONT)
    left.legend(fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    left.set_title("each run on its one-process run", fontsize=FONT)
    _log_bars(right, {_two_lines(name): {"loss": d.get("loss", 0.0), "parameters": d.get("parameters", 0.0)}
                      for name, d in diffs.items()}, "largest |difference| from one process")
    right.set_title("how far from one process", fontsize=FONT)
    if title:
        fig.suptitle(title, fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def plot_framework_memory(measured: Mapping[str, Sequence[Mapping[str, float]]],
                          predicted: Mapping[str, Mapping[str, float]], title: str = "") -> Figure:
    """Model-state bytes each rank of each framework held (stacked parameters / gradients /
    optimizer, one bar per rank) and the prediction of :func:`dtlib.analytic.memory.memory_per_gpu`
    for the same layout (dashed)."""
    return plot_stage_costs({_two_lines(name): [{p: d.get(p, 0) for p in _STATES} for d in ranks]
                             for name, ranks in measured.items()},
                            predicted={_two_lines(name): {p: d.get(p, 0) for p in _STATES} for name, d in predicted.items()},
                            title=title or "model states per rank: measured (bars) vs dtlib.analytic.memory (dashed)")


def plot_framework_collectives(counts: Mapping[str, Mapping[str, float]], ylabel: str = "calls per rank per step",
                               title: str = "") -> Figure:
    """Collectives one rank issued, by operation (``all_reduce``, ``all_gather``, ``reduce_scatter``,
    ``send``, ...), one bar per framework: ``counts[framework][op]`` (``ylabel`` says over what)."""
    if not counts:
        raise ValueError("nothing to plot: counts is empty")
    ops = sorted({op for c in counts.values() for op in c})
    return plot_grouped_bars({op: {name: c.get(op, 0) for name, c in counts.items()} for op in ops},
                             ylabel, title=title or "the collectives each framework issued",
                             fmt="{:g}")


def plot_silent_defaults(cases: Mapping[str, Mapping[str, float]], title: str = "") -> Figure:
    """One group per pitfall (e.g. ``"DeepSpeed gradient_clipping"``): the largest parameter
    difference from one process with the framework's default and with the setting fixed
    (``cases[pitfall] = {"default": d, "fixed": d}``), on a log axis."""
    if not cases:
        raise ValueError("nothing to plot: cases is empty")
    fig = Figure(figsize=(max(7.5, 2.2 * len(cases) + 2.5), 3.8))
    ax = fig.add_subplot()
    _log_bars(ax, cases, "largest |parameter difference|\nfrom one process")
    ax.tick_params(axis="x", labelsize=SMALL_FONT)
    ax.set_title(title or "defaults that silently change the result", fontsize=FONT + 1)
    fig.tight_layout()
    return fig


def plot_emitted(predicted: Mapping[str, float], texts: Mapping[str, str],
                 unsupported: Mapping[str, Sequence[str]], title: str = "",
                 notes: Mapping[str, Sequence[str]] | None = None, max_lines: int = 18) -> Figure:
    """What ``dtlib plan --emit`` writes for one layout. Left: the predicted model-state bytes per
    rank (``predicted`` with ``parameters``, ``gradients``, ``optimizer``). Right: one panel per
    framework with its emitted text (``texts[framework]``, its first ``max_lines`` lines and then
    how many more there are), in red the lines it cannot express (``unsupported[framework]``), and
    in grey its caveats (``notes[framework]``: the emitter's notes and re-timed lines)."""
    if not texts:
        raise ValueError("nothing to plot: texts is empty")
    names = list(texts)
    # each caveat in at most two lines of the panel's width, "..." where shortened
    caveats = {name: [w for m in (notes or {}).get(name, [])
                      for w in textwrap.wrap(textwrap.shorten(m, 84, placeholder=" ..."), 42, subsequent_indent="  ")]
               for name in names}
    below = max((len(c) for c in caveats.values()), default=0)
    height = 4.6 + 0.13 * below
    fig = Figure(figsize=(12.5, height))
    grid = fig.add_gridspec(1, 1 + len(names), width_ratios=[0.7] + [1.25] * len(names))
    ax = fig.add_subplot(grid[0, 0])
    scale, unit = binary_unit(max(sum(predicted.get(p, 0) for p in _STATES), 1))
    bottom = 0.0
    for part in _STATES:
        h = predicted.get(part, 0) / scale
        ax.bar(0, h, bottom=bottom, color=PART_COLORS[part], width=0.6)
        bottom += h
    ax.set_xticks([0], [f"{bottom:.3g} {unit}"], fontsize=SMALL_FONT)
    ax.set_xlim(-0.6, 0.6)
    ax.set_ylim(0, 1.15 * bottom)
    ax.set_ylabel(f"{unit} per rank (model states)", fontsize=FONT)
    ax.tick_params(labelsize=SMALL_FONT)
    ax.legend([Rectangle((0, 0), 1, 1, color=PART_COLORS[p]) for p in _STATES], list(_STATES),
              fontsize=SMALL_FONT, loc="upper left", bbox_to_anchor=(0.0, -0.08))
    ax.set_title("predicted", fontsize=FONT)
    for i, name in enumerate(names):
        panel = fig.add_subplot(grid[0, 1 + i])
        panel.axis("off")
        lines = _wrap(texts[name], 34)
        if len(lines) > max_lines:  # say what is cut, never cut silently
            lines = lines[:max_lines - 1] + [f"... {len(lines) - max_lines + 1} more lines not shown"]
        missing = [f"cannot express: {m}" for m in unsupported.get(name, [])]
        panel.set_title(name, fontsize=FONT)
        panel.text(0.0, 1.0, "\n".join(lines), va="top", ha="left", family="monospace", fontsize=SMALL_FONT,
                   transform=panel.transAxes)
        if missing:
            panel.text(0.0, 0.0, "\n".join(w for m in missing for w in textwrap.wrap(m, 38, subsequent_indent="  ")),
                       va="bottom", ha="left",
                       color="#c0392b", fontsize=SMALL_FONT, transform=panel.transAxes)
        if caveats[name]:
            panel.text(0.0, -0.02, "\n".join(caveats[name]), va="top", ha="left", color="#555555", fontsize=SMALL_FONT,
                       transform=panel.transAxes)
    if title:
        fig.suptitle(title, fontsize=FONT + 1)
    fig.subplots_adjust(left=0.06, right=0.99, top=1 - 0.64 / height, bottom=(0.92 + 0.13 * below) / height,
                        wspace=0.35)
    return fig


def plot_fullsize_terms(terms: Mapping[str, Mapping[str, float]], title: str = "") -> Figure:
    """Peak memory of one rank by term (``terms[term] = {"tracker": bytes, "dtlib": bytes}``, any
    series names): PyTorch's memory tracker at the peak beside ``dtlib memory``, grouped bars in GiB,
    one group per term and one for their total."""
    if not terms:
        raise ValueError("nothing to plot: terms is empty")
    series = list(dict.fromkeys(k for v in terms.values() for k in v))
    values = dict(terms) | {"total": {s: sum(v.get(s, 0) for v in terms.values()) for s in series}}
    fig = plot_grouped_bars(values, ylabel="GiB on rank 0", scale=GiB,
                            title=title or "full size: PyTorch's memory tracker vs dtlib memory, term by term")
    return fig


def _two_lines(name: str) -> str:
    """``"DeepSpeed ZeRO-2"`` as framework over layout, so that neighbouring labels never touch."""
    return name.replace(" ", "\n", 1)


def _wrap(text: str, width: int) -> list[str]:
    """Lines of at most ``width`` characters (long ones broken, continued with an indent)."""
    out = []
    for line in text.splitlines():
        while len(line) > width:
            out.append(line[:width])
            line = "  " + line[width:]
        out.append(line)
    return out
