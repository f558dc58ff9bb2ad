"""Tensor parallelism drawn: which rank holds which block of the weights of a column-parallel and
a row-parallel linear layer, and where the f and g operators communicate (Shoeybi et al. 2019,
Sec. 3, Fig. 3)."""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlib.viz.style import FONT, SMALL_FONT, colour

__all__ = ["plot_column_row_split"]


def _matrix(ax, x0: float, width: float, height: float, tp: int, by: str, label: str) -> None:
    """A weight matrix as ``tp`` coloured blocks, split by columns or by rows."""
    for r in range(tp):
        if by == "columns":
            box = (x0 + r * width / tp, 0.0, width / tp, height)
        else:
            box = (x0, height - (r + 1) * height / tp, width, height / tp)
        ax.add_patch(Rectangle(box[:2], box[2], box[3], facecolor=colour(r), edgecolor="white",
                               lw=1.5, alpha=0.85, label=f"rank {r}" if by == "columns" else None))
        ax.text(box[0] + box[2] / 2, box[1] + box[3] / 2, f"r{r}", ha="center", va="center",
                fontsize=SMALL_FONT, color="white")
    ax.text(x0 + width / 2, -0.12, label, ha="center", va="top", fontsize=FONT)


def plot_column_row_split(tp: int = 2) -> Figure:
    """``X -> f -> [X A_r] -> GELU -> [Y_r B_r] -> g -> Z``: the MLP of Megatron-LM on ``tp`` ranks.

    ``A`` (``h x 4h``) is split by columns (:class:`~dtlib.parallel.tensor.ColumnParallelLinear`):
    rank ``r`` computes ``Y_r = GELU(X A_r)`` with no communication. ``B`` (``4h x h``) is split by
    rows (:class:`~dtlib.parallel.tensor.RowParallelLinear`): rank ``r`` computes a partial
    ``Y_r B_r`` and ``g`` all-reduces the partial sums. ``f`` is the identity forward and
    all-reduces the input's gradient in backward.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 8:
        raise ValueError(f"tp must be an integer in 1..8 (ranks to draw), got {tp!r}")
    fig = Figure(figsize=(8.0, 3.0))
    ax = fig.add_subplot()
    ax.set_xlim(-0.6, 6.2)
    ax.set_ylim(-0.55, 1.35)
    ax.set_axis_off()
    ax.add_patch(Rectangle((-0.5, 0.25), 0.35, 0.5, facecolor="#bab0ac", edgecolor="white"))
    ax.text(-0.325, 0.5, "X", ha="center", va="center", fontsize=FONT)
    ax.text(-0.325, -0.12, "input,\nreplicated", ha="center", va="top", fontsize=SMALL_FONT)
    ax.annotate("f", (0.35, 0.5), (-0.1, 0.5), fontsize=FONT, ha="center", va="bottom",
                arrowprops=dict(arrowstyle="->"))
    _matrix(ax, 0.4, 2.4, 1.0, tp, "columns", "A (h x 4h): column-parallel\nrank r keeps columns r")
    ax.annotate("", (3.3, 0.5), (2.85, 0.5), arrowprops=dict(arrowstyle="->"))
    ax.text(3.07, 0.56, "GELU,\nno comm", ha="center", va="bottom", fontsize=SMALL_FONT)
    _matrix(ax, 3.35, 1.2, 1.0, tp, "rows", "B (4h x h): row-parallel\nrank r keeps rows r")
    ax.annotate("g", (5.45, 0.5), (4.6, 0.5), fontsize=FONT, ha="center", va="bottom",
                arrowprops=dict(arrowstyle="->"))
    ax.add_patch(Rectangle((5.5, 0.25), 0.35, 0.5, facecolor="#bab0ac", edgecolor="white"))
    ax.text(5.675, 0.5, "Z", ha="center", va="center", fontsize=FONT)
    ax.text(5.675, -0.12, "sum of the\npartials", ha="center", va="top", fontsize=SMALL_FONT)
    ax.text(2.85, 1.3, f"f: identity forward, all-reduce backward  |  g: all-reduce forward, "
            f"identity backward  ({tp} ranks)", ha="center", va="top", fontsize=FONT)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=SMALL_FONT, frameon=False)
    return fig
