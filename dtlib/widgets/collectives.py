"""Collectives explorer: pick a collective and a world size, run it live, see before/after."""
import ipywidgets as W

from dtlib.primitives import COLLECTIVES, run_collective
from dtlib.viz.collectives import plot_collective
from dtlib.widgets.base import Explorer, register


@register("collectives")
def collectives_explorer() -> Explorer:
    return Explorer(
        {"name": W.Dropdown(options=COLLECTIVES, value="all_reduce", description="collective"),
         "world_size": W.IntSlider(value=4, min=2, max=4, description="ranks")},
        compute=lambda name, world_size: run_collective(name, world_size),
        plot=plot_collective, title="Collectives, run live on real ranks")
