"""The memory calculator: model, layout and GPU controls -> :func:`dtlib.analytic.memory.memory_per_gpu`
-> :func:`dtlib.viz.memory.plot_memory_breakdown`.

An impossible combination raises dtlib's ``ValueError``, which the :class:`Explorer` shows as text
in place of the figure. The pipeline controls move together so that the schedule never
contradicts them (Megatron-LM interleaves only with ``virtual_pipeline_model_parallel_size > 1``
and ``pipeline_model_parallel_size > 1``; see :data:`dtlib.analytic.layout.RULES`):

* picking ``interleaved`` raises ``virtual`` to 2 and ``PP`` to 2 where they are 1;
* picking another schedule sets ``virtual`` back to 1;
* picking ``virtual`` >= 2 selects ``interleaved`` (and ``PP`` >= 2), ``virtual`` = 1 leaves it
  for ``1f1b``;
* picking ``PP`` = 1 while interleaved falls back to ``1f1b`` with ``virtual`` = 1.

Each change still recomputes exactly once, with the controls already consistent.
"""
from __future__ import annotations

from typing import Any

import ipywidgets as W
from matplotlib.figure import Figure

from dtlib.analytic.hardware import ACCELERATORS
from dtlib.analytic.memory import GiB, MemoryBreakdown, memory_per_gpu
from dtlib.analytic.layout import RECOMPUTE, SCHEDULES, Parallelism
from dtlib.viz.memory import plot_memory_breakdown
from dtlib.widgets.base import Explorer, register

__all__ = ["memory_calculator", "calculator_compute", "calculator_plot", "pipeline_controls", "MODELS"]

MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")


def calculator_compute(model: str, gpu: str, dp: int, tp: int, pp: int, cp: int, zero: int,
                       recompute: str, schedule: str, virtual_stages: int, micro_batch_size: int,
                       num_microbatches: int, sequence_parallel: bool,
                       overhead_gib: float) -> MemoryBreakdown:
    """The breakdown; an impossible configuration raises ValueError saying what is wrong."""
    layout = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, recompute=recompute,
                         schedule=schedule, virtual_stages=virtual_stages,
                         micro_batch_size=micro_batch_size, num_microbatches=num_microbatches,
                         sequence_parallel=sequence_parallel)
    return memory_per_gpu(model, layout, precision="megatron-bf16", gpu=gpu, dropout=False,
                          overhead_bytes=overhead_gib * GiB)


def calculator_plot(result: MemoryBreakdown) -> Figure:
    title = f"{result.total / GiB:.1f} GiB on the most loaded GPU (stage {result.stage})"
    return plot_memory_breakdown(result, title=title)


def pipeline_controls(changed: str, schedule: str, virtual_stages: int, pp: int) -> dict[str, Any]:
    """The (schedule, virtual_stages, pp) the calculator moves to after the user set ``changed``
    (one of those three names): the user's choice stays, the other two follow it."""
    s, v, p = schedule, virtual_stages, pp
    # (the pp choices are 1 and powers of 2: DualPipe's even pp >= 2 is pp >= 2 here)
    if changed == "schedule":
        v, p = ((max(v, 2), max(p, 2)) if s == "interleaved" else (2, max(p, 2)) if s == "dualpipev"
                else (1, max(p, 2) if s == "dualpipe" else p))
    elif changed == "virtual_stages":
        keep = s == "dualpipev" and v == 2  # DualPipeV's V is two chunks a rank
        s, p = (s, p) if keep else ("interleaved", max(p, 2)) if v >= 2 else (
            "1f1b" if s in ("interleaved", "dualpipev") else s, p)
    elif changed == "pp":
        s, v = ("1f1b", 1) if p < 2 and s in ("interleaved", "dualpipe", "dualpipev") else (s, v)
    else:
        raise ValueError(f"changed must be 'schedule', 'virtual_stages' or 'pp', got {changed!r}")
    return {"schedule": s, "virtual_stages": v, "pp": p}


class _CoupledExplorer(Explorer):
    """An :class:`Explorer` whose ``update`` is held while the pipeline controls are made
    consistent, so that a user's change redraws once, with every control already in place."""
    held = False

    def update(self) -> None:
        if not self.held:
            super().update()


def _couple(controls: dict[str, W.ValueWidget], holder: list[_CoupledExplorer]) -> None:
    """Observe the pipeline controls; registered before the Explorer's own observers, so the
    correction happens (without a redraw) before the Explorer's one redraw."""
    names = ("schedule", "virtual_stages", "pp")

    def follow(changed: str) -> None:
        if not holder or holder[0].held:  # building, or our own correction
            return
        target = pipeline_controls(changed, *(controls[n].value for n in names))
        holder[0].held = True
        try:
            for name, value in target.items():
                controls[name].value = value
        finally:
            holder[0].held = False

    for name in names:
        controls[name].observe(lambda _change, name=name: follow(name), names="value")


@register("memory_calculator")
def memory_calculator() -> Explorer:
    """Llama-3 8B..405B, bf16 with fp32 gradients and Adam (Megatron's 18 bytes/param), no dropout."""
    def ints(options, value, description):
        return W.Dropdown(options=options, value=value, description=description)

    powers = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    controls = {
        "model": W.Dropdown(options=MODELS, value="llama3-8b", description="model"),
        "gpu": W.Dropdown(options=list(ACCELERATORS), value="h100-sxm", description="GPU"),
        # TP up to 8: every listed Llama-3 has 8 KV heads, which TP must divide (Megatron-LM's check).
        "dp": ints(powers, 8, "DP"), "tp": ints(powers[:4], 1, "TP"), "pp": ints(powers[:6], 1, "PP"),
        "cp": ints(powers[:5], 1, "CP"),
        "zero": ints([0, 1, 2, 3], 1, "ZeRO"),
        "recompute": W.Dropdown(options=RECOMPUTE, value="selective", description="recompute"),
        "schedule": W.Dropdown(options=SCHEDULES, value="1f1b", description="schedule"),
        "virtual_stages": ints([1, 2, 4, 8], 1, "virtual"),
        "micro_batch_size": W.IntSlider(value=1, min=1, max=16, description="micro-batch"),
        "num_microbatches": W.IntSlider(value=8, min=1, max=64, description="micro-batches"),
        "sequence_parallel": W.Checkbox(value=False, description="sequence parallel"),
        "overhead_gib": W.FloatSlider(value=0.0, min=0.0, max=8.0, step=0.5, description="overhead GiB"),
    }
    holder: list[_CoupledExplorer] = []
    _couple(controls, holder)  # before the Explorer observes them: correct first, then redraw
    holder.append(_CoupledExplorer(controls, calculator_compute, calculator_plot,
                                   title="Memory per GPU: where it goes, and does it fit?"))
    return holder[0]
