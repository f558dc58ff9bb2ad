"""ZeRO explorer ``"zero_memory"``: world size and model width -> bytes per rank for every
ZeRO stage, measured, against the prediction."""
from __future__ import annotations

import ipywidgets as W

from dtlib.experiments.zero import measure_zero_stages
from dtlib.models import tiny_gpt_config
from dtlib.viz.zero import plot_zero_stages
from dtlib.widgets.base import Explorer, register

__all__ = ["zero_memory_explorer"]


# ---- explorer --------------------------------------------------------------------------------------
def _zero_memory(world_size: int, hidden: int) -> dict[int, dict]:
    cfg = tiny_gpt_config(layers=2, hidden=hidden, heads=4)
    return measure_zero_stages(world_size, cfg=cfg, steps=1, batch=4)


def _zero_memory_plot(result: dict[int, dict]):
    n = len(next(iter(result.values()))["per_rank"])
    return plot_zero_stages(result, title=f"TinyGPT on {n} ranks, fp32 AdamW: measured per rank "
                                          "(bars) vs dtlib.analytic.memory (dashes)")


@register("zero_memory")
def zero_memory_explorer() -> Explorer:
    """World size and model width -> model-state bytes on every rank under DDP, ZeRO-1, ZeRO-2 and
    the toy FSDP (measured), against :mod:`dtlib.analytic.memory`, and the bytes each rank sends."""
    return Explorer(
        {"world_size": W.IntSlider(value=2, min=2, max=4, description="ranks"),
         "hidden": W.Dropdown(options=[64, 128, 256], value=128, description="hidden")},
        compute=_zero_memory, plot=_zero_memory_plot,
        title="ZeRO stages, measured on real ranks: what each rank holds and sends")
