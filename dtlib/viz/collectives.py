"""Draw a collective: each rank's buffer before and after, values coloured by the rank they came from."""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlib.viz.style import FONT, colour

_MIXED = "#bbbbbb"  # a value that combines several ranks (a reduction)
_REDUCTIONS = ("all_reduce", "reduce_scatter")


def _draw_buffers(ax, buffers, world_size: int, title: str, reduced: bool) -> None:
    for rank, buf in enumerate(buffers):
        y = world_size - 1 - rank
        for i, v in enumerate(buf.tolist()):
            # inputs are 10*rank + i, so a non-reduced value names its origin rank
            color = _MIXED if reduced else colour(int(v) // 10)
            ax.add_patch(Rectangle((i, y + 0.1), 0.9, 0.8, facecolor=color, edgecolor="black", lw=0.6))
            ax.text(i + 0.45, y + 0.5, f"{v:g}", ha="center", va="center", fontsize=FONT)
        ax.text(-0.2, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=FONT)
    ax.set_xlim(-1.3, world_size)
    ax.set_ylim(0, world_size)
    ax.set_title(title)
    ax.axis("off")


def plot_collective(result: dict) -> Figure:
    """``result`` from :func:`dtlib.primitives.run_collective`: before (left) and after (right)."""
    n = result["world_size"]
    fig = Figure(figsize=(8, 0.6 * n + 1.2))
    left, right = fig.subplots(1, 2)
    _draw_buffers(left, result["before"], n, "before", reduced=False)
    _draw_buffers(right, result["after"], n, f"after {result['name']}",
                  reduced=result["name"] in _REDUCTIONS)
    fig.suptitle("colour = the rank a value came from; grey = a sum over all ranks", fontsize=FONT)
    fig.tight_layout()
    return fig
