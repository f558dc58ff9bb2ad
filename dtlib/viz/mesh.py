"""The rank grid drawn on a cluster: nodes x GPUs per node, one cell per rank, coloured by group.

Takes a :class:`dtlib.parallel.mesh.ParallelLayout` and returns a ``Figure`` built with
``Figure()`` (no pyplot).
"""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlib.parallel.mesh import AXES, ParallelLayout
from dtlib.viz.style import FONT, SMALL_FONT, colour

__all__ = ["plot_rank_grid", "group_links"]


def group_links(layout: ParallelLayout, gpus_per_node: int) -> dict[str, str]:
    """For each group kind, the slowest link its members talk over: ``"intra-node"`` when every
    group sits inside one node (NVLink), ``"inter-node"`` otherwise (InfiniBand/RoCE), ``"none"``
    when the groups are single ranks."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    out = {}
    for kind, groups in layout.groups.items():
        if all(len(g) == 1 for g in groups):
            out[kind] = "none"
        elif all(len({r // gpus_per_node for r in g}) == 1 for g in groups):
            out[kind] = "intra-node"
        else:
            out[kind] = "inter-node"
    return out


def plot_rank_grid(layout: ParallelLayout, gpus_per_node: int = 8, color_by: str = "tp",
                   note: str = "") -> Figure:
    """One row per node, one cell per GPU: the rank, its (dp, tp, pp, cp) coordinates, and a
    colour per ``color_by`` group (ranks of one group share a colour). The title says over which
    link that kind of group talks (:func:`group_links`); ``note`` is a second title line."""
    if color_by not in AXES:
        raise ValueError(f"color_by must be one of {AXES}, got {color_by!r}")
    links = group_links(layout, gpus_per_node)
    n = layout.world_size
    nodes = -(-n // gpus_per_node)
    group_index = {r: i for i, g in enumerate(layout.groups[color_by]) for r in g}
    fig = Figure(figsize=(1.2 * gpus_per_node + 1.4, 0.95 * nodes + 1.0))
    ax = fig.add_subplot()
    for r in range(n):
        node, gpu = divmod(r, gpus_per_node)
        y = nodes - 1 - node
        c = layout.coordinates(r)
        ax.add_patch(Rectangle((gpu, y + 0.08), 0.92, 0.84, facecolor=colour(group_index[r]),
                               alpha=0.75, edgecolor="black", lw=0.6, label=f"rank {r}"))
        ax.text(gpu + 0.46, y + 0.64, f"rank {r}", ha="center", va="center", fontsize=SMALL_FONT,
                fontweight="bold")
        ax.text(gpu + 0.46, y + 0.3, f"d{c['dp']} t{c['tp']}\np{c['pp']} c{c['cp']}", ha="center",
                va="center", fontsize=SMALL_FONT)
    for node in range(nodes):
        ax.text(-0.1, nodes - 1 - node + 0.5, f"node {node}", ha="right", va="center", fontsize=FONT)
    ax.set_xlim(-1.2, gpus_per_node)
    ax.set_ylim(0, nodes)
    ax.set_title(f"{layout.describe()} on {nodes} node(s) x {gpus_per_node} GPUs: colour = "
                 f"{color_by} group ({len(layout.groups[color_by])} groups, {links[color_by]})"
                 + (f"\n{note}" if note else ""), fontsize=FONT)
    ax.axis("off")
    fig.tight_layout()
    return fig
