"""One look for every plot: the palette, the colour of each memory component, font sizes and the
log axes of the sweeps. Plotting modules take their colours and sizes from here."""
from __future__ import annotations

__all__ = ["PALETTE", "PART_COLORS", "PROFILE_COLORS", "FONT", "SMALL_FONT", "set_log_axes", "colour"]

# Tableau 10 (matplotlib's default cycle), so dtlib's figures match a user's own.
PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
           "#ff9da7", "#9c755f", "#bab0ac"]
# One colour per memory component, the same in every figure that stacks them.
PART_COLORS = {
    "parameters": "#4e79a7", "working weights": "#4e79a7",
    "gradients": "#59a14f",
    "fp32 master weights": "#f28e2b", "fp32 gradient copy": "#9c755f",
    "optimizer": "#e15759", "optimizer states": "#e15759",
    "activations": "#b07aa1", "temporary buffers": "#edc948", "framework overhead": "#bab0ac",
}
# One colour per part of a profiled step (dtlib.profile.PARTS), the same in every profile figure.
PROFILE_COLORS = {"compute": "#4e79a7", "exposed_comm": "#e15759", "bubble": "#b07aa1",
                  "data": "#f28e2b", "optimizer": "#59a14f", "other": "#bab0ac",
                  "comm_in_flight": "#ff9da7"}
FONT = 9          # axis labels, legends, titles
SMALL_FONT = 8    # annotations inside the axes; nothing is drawn smaller


def colour(i: int) -> str:
    """The ``i``-th palette colour (it repeats after ten)."""
    return PALETTE[i % len(PALETTE)]


def set_log_axes(ax, x, logx: bool, logy: bool) -> None:
    """Log scales shared by the sweep plots: base-2 x with the swept values as tick labels."""
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(x), [f"{v:g}" for v in x])
        ax.minorticks_off()
    if logy:
        ax.set_yscale("log")
