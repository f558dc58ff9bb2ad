"""The memory calculator: model, layout and GPU controls -> :func:`dtlib.memory.memory_per_gpu`
-> :func:`dtlib.viz.memory.plot_memory_breakdown`. Impossible combinations show the error text."""
from __future__ import annotations

import ipywidgets as W
from matplotlib.figure import Figure

from dtlib.hardware import ACCELERATORS
from dtlib.memory import GiB, MemoryBreakdown, memory_per_gpu
from dtlib.parallelism import RECOMPUTE, SCHEDULES, Parallelism
from dtlib.viz.memory import plot_memory_breakdown, plot_message
from dtlib.widgets.base import Explorer, register

__all__ = ["memory_calculator", "calculator_compute", "calculator_plot", "MODELS"]

MODELS = ("llama3-8b", "llama3-70b", "llama3-405b")


def calculator_compute(model: str, gpu: str, dp: int, tp: int, pp: int, cp: int, zero: int,
                       recompute: str, schedule: str, virtual_stages: int, micro_batch: int,
                       microbatches: int, sequence_parallel: bool,
                       overhead_gib: float) -> "MemoryBreakdown | str":
    """The breakdown, or the error message of an impossible configuration."""
    try:
        layout = Parallelism(dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, recompute=recompute,
                             schedule=schedule, virtual_stages=virtual_stages,
                             micro_batch=micro_batch, microbatches=microbatches,
                             sequence_parallel=sequence_parallel)
        return memory_per_gpu(model, layout, precision="megatron-bf16", gpu=gpu, dropout=False,
                              overhead_bytes=overhead_gib * GiB)
    except ValueError as exc:
        return f"Impossible configuration: {exc}"


def calculator_plot(result: "MemoryBreakdown | str") -> Figure:
    if isinstance(result, str):
        return plot_message(result)
    title = f"{result.total / GiB:.1f} GiB on the most loaded GPU (stage {result.stage})"
    return plot_memory_breakdown(result, title=title)


@register("memory_calculator")
def memory_calculator() -> Explorer:
    """Llama-3 8B..405B, bf16 with fp32 gradients and Adam (Megatron's 18 bytes/param), no dropout."""
    def ints(options, value, description):
        return W.Dropdown(options=options, value=value, description=description)

    powers = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    controls = {
        "model": W.Dropdown(options=MODELS, value="llama3-8b", description="model"),
        "gpu": W.Dropdown(options=list(ACCELERATORS), value="h100-sxm", description="GPU"),
        "dp": ints(powers, 8, "DP"), "tp": ints(powers[:5], 1, "TP"), "pp": ints(powers[:6], 1, "PP"),
        "cp": ints(powers[:5], 1, "CP"),
        "zero": ints([0, 1, 2, 3], 1, "ZeRO"),
        "recompute": W.Dropdown(options=RECOMPUTE, value="selective", description="recompute"),
        "schedule": W.Dropdown(options=SCHEDULES, value="1f1b", description="schedule"),
        "virtual_stages": ints([1, 2, 4, 8], 1, "virtual"),
        "micro_batch": W.IntSlider(value=1, min=1, max=16, description="micro-batch"),
        "microbatches": W.IntSlider(value=8, min=1, max=64, description="micro-batches"),
        "sequence_parallel": W.Checkbox(value=False, description="sequence parallel"),
        "overhead_gib": W.FloatSlider(value=0.0, min=0.0, max=8.0, step=0.5, description="overhead GiB"),
    }
    return Explorer(controls, calculator_compute, calculator_plot,
                    title="Memory per GPU: where it goes, and does it fit?")
