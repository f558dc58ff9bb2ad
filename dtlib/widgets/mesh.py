"""Rank-grid explorer ``"rank_grid"``: a layout and a cluster shape -> where every rank sits, which
group each kind of traffic uses and over which link, and the memory per GPU of a Llama model."""
from __future__ import annotations

from typing import Any

import ipywidgets as W

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.units import GiB
from dtlib.parallel.mesh import ParallelLayout
from dtlib.viz.mesh import group_links, plot_rank_grid
from dtlib.widgets.base import Explorer, register

__all__ = ["rank_grid_explorer", "rank_grid"]


def rank_grid(tp: int, pp: int, dp: int, cp: int, gpus_per_node: int, color_by: str,
              model: str) -> dict[str, Any]:
    """The layout, each group kind's link, and ``model``'s memory per GPU (bf16 mixed precision,
    AdamW, ZeRO-1 over dp x cp, sequence parallelism with tp > 1, 8 micro-batches with a pipeline)."""
    layout = ParallelLayout(dp=dp, tp=tp, pp=pp, cp=cp)
    memory = memory_per_gpu(model, Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, zero=1 if dp * cp > 1 else 0,
                                               sequence_parallel=tp > 1, num_microbatches=8 if pp > 1 else 1,
                                               recompute="selective"), gpu="h100-sxm")
    return {"layout": layout, "links": group_links(layout, gpus_per_node), "gpus_per_node": gpus_per_node,
            "color_by": color_by, "model": model, "memory_gib": memory.total / GiB, "fits": memory.fits}


def _plot(result: dict[str, Any]):
    links = ", ".join(f"{k} {v}" for k, v in result["links"].items() if k in ("tp", "cp", "dp", "pp") and v != "none")
    note = (f"links: {links or 'none (one rank)'}; {result['model']}: {result['memory_gib']:.1f} GiB per GPU "
            f"({'fits' if result['fits'] else 'does NOT fit'} an 80 GiB H100)")
    return plot_rank_grid(result["layout"], result["gpus_per_node"], result["color_by"], note=note)


@register("rank_grid")
def rank_grid_explorer() -> Explorer:
    """Layout (tp, pp, dp, cp) and GPUs per node -> the drawing coloured by one group kind, each
    kind's link, and the memory per GPU of a Llama 3 model under that layout."""
    sizes = [1, 2, 4, 8]
    return Explorer(
        {"tp": W.Dropdown(options=sizes, value=4, description="tp"),
         "pp": W.Dropdown(options=sizes, value=2, description="pp"),
         "dp": W.Dropdown(options=sizes, value=2, description="dp"),
         "cp": W.Dropdown(options=sizes, value=1, description="cp"),
         "gpus_per_node": W.Dropdown(options=[4, 8], value=8, description="GPUs/node"),
         "color_by": W.Dropdown(options=["tp", "cp", "dp", "pp", "dp_cp"], value="tp", description="colour"),
         "model": W.Dropdown(options=["llama3-8b", "llama3-70b"], value="llama3-70b", description="model")},
        compute=rank_grid, plot=_plot,
        title="The rank grid: Megatron-LM's order (tp fastest, then cp, dp, pp) on a cluster")
