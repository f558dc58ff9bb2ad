"""Capture: run a training step under ``torch.profiler`` on each rank and write its Chrome trace.

A step function marks its phases with :func:`phase` (``record_function`` ranges named
``dtlib/<phase>``: ``data``, ``forward``, ``backward``, ``optimizer``, and ``comm`` for a
collective the caller waits on synchronously). :func:`profile_steps` runs ``warmup`` unprofiled
steps, counts the FLOPs of the last one with ``torch.utils.flop_counter.FlopCounterMode`` (per
phase, so model FLOPs = 3 x forward and hardware FLOPs = everything counted, recomputation
included), then profiles ``steps`` steps, each inside a ``dtlib/step`` range, exports the trace
(``export_chrome_trace``: it opens in Perfetto or ``chrome://tracing``) and returns the rank's
breakdown parsed back from that trace (:mod:`dtlib.profile.breakdown`), so a live profile and
``dtlib profile DIR`` on the saved traces read the same numbers.

What the breakdown needs beyond the events (FLOPs, the peak, the wall time of each step measured
with ``time.perf_counter`` as an independent check) travels in the trace's own metadata
(``profiler.add_metadata_json``), under the key ``dtlib``.
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

import json
import os
import tempfile
import time
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dtlib.analytic import validate
from dtlib.analytic.hardware import Accelerator
from dtlib.measure import measure_cpu
from dtlib.profile.breakdown import parse_trace

__all__ = ["PHASES", "phase", "count_flops", "profile_steps", "trace_path"]

PHASES = ("data", "forward", "backward", "optimizer", "comm")
_FLOPS: dict[str, Any] = {}  # the active FLOP count: {"mode": FlopCounterMode, "phases": {name: flops}}


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase of the step (a ``record_function`` range ``dtlib/<name>``, one of
    :data:`PHASES`). While :func:`count_flops` runs, the FLOPs done inside are credited to it."""
    if name not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {name!r}")
    mode = _FLOPS.get("mode")
    before = mode.get_total_flops() if mode is not None else 0
    with record_function(f"dtlib/{name}"):
        yield
    if mode is not None:
        phases = _FLOPS["phases"]
        phases[name] = phases.get(name, 0) + mode.get_total_flops() - before


def _sdpa_cpu_formulas() -> dict[Any, Any]:
    """FlopCounterMode has no formula for the CPU flash-attention kernels (it counts 0 FLOPs for
    ``F.scaled_dot_product_attention`` on CPU); reuse torch's own SDPA formulas for them."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    def forward(query, key, value, *args, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


def count_flops(step_fn: Callable[[], Any]) -> dict[str, float]:
    """Run ``step_fn()`` once under ``FlopCounterMode`` and return its FLOPs: ``per_phase``,
    ``hardware`` (all counted, recomputation included) and ``model`` (3 x the forward phase:
    backward = 2 x forward, Kaplan et al. 2020 Sec. 2.1; Chowdhery et al. 2022 App. B)."""
    from torch.utils.flop_counter import FlopCounterMode

    mode = FlopCounterMode(display=False, custom_mapping=_sdpa_cpu_formulas())
    _FLOPS.update(mode=mode, phases={})
    try:
        with mode:
            step_fn()
    finally:
        phases = _FLOPS.pop("phases")
        _FLOPS.pop("mode")
    forward = phases.get("forward", 0)
    return {"per_phase": phases, "hardware": float(mode.get_total_flops()), "model": 3.0 * forward}


def trace_path(trace_dir: str, rank: int) -> str:
    """Where rank ``rank``'s trace goes: ``trace_dir/rank<k>.json``."""
    return os.path.join(trace_dir, f"rank{rank}.json")


def profile_steps(step_fn: Callable[[], Any], steps: int = 3, warmup: int = 1,
                  trace_dir: str | None = None, rank: int | None = None,
                  peak: "Accelerator | float | None" = None, dtype: str = "fp32",
                  model_flops: float | None = None, tokens: int | None = None,
                  record_shapes: bool = False) -> dict[str, Any]:
    """Profile ``steps`` calls of ``step_fn`` after ``warmup`` unprofiled ones, on this rank.

    ``step_fn`` marks its phases with :func:`phase`. Returns this rank's parsed profile
    (:func:`dtlib.profile.breakdown.parse_trace`); the trace is written to
    ``trace_dir/rank<k>.json`` (a temporary file, deleted, when ``trace_dir`` is None).
    ``peak``: the device's dense ``dtype`` peak in FLOP/s or an :class:`Accelerator`; by default
    the GPU's is not guessed and on CPU this process's matmul peak is measured
    (:func:`~dtlib.measure.measure_cpu`, with the threads this rank really has).
    ``model_flops``: the model FLOPs of one step from :mod:`dtlib.analytic.flops` if known
    (otherwise 3 x the forward FLOPs counted). ``tokens``: the tokens this rank adds to the
    global batch per step (for tokens/s; leave None where a rank adds none of its own, e.g. a
    pipeline stage after the first).
    """
    validate.integer("steps", steps)
    validate.integer("warmup", warmup)  # >= 1: FLOPs are counted on the last warm-up step
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for _ in range(warmup - 1):
        step_fn()
    flops = count_flops(step_fn)  # the last warm-up step: first steps may build state (pipelining)
    cuda = torch.cuda.is_available()
    if peak is None and cuda:
        raise ValueError("peak is required on a GPU: pass the catalogue entry, e.g. "
                         "dtlib.analytic.hardware.get_gpu('h100-sxm')")
    if peak is None:
        peak = measure_cpu(n=256, repeats=3, copy_bytes=2 ** 20)
    peak_flops = peak.peak(dtype) if isinstance(peak, Accelerator) else float(peak)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    wall: list[float] = []
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with record_function("dtlib/step"):
                step_fn()
                if cuda:  # the step ends when its kernels do
                    torch.cuda.synchronize()
            wall.append(time.perf_counter() - start)
        meta = {"rank": rank, "steps": steps, "wall_seconds": wall, "peak_flops": peak_flops,
                "tokens": tokens,
                "dtype": dtype, "flops": {"model": model_flops if model_flops else flops["model"],
                                          "hardware": flops["hardware"],
                                          "counted_model": flops["model"],
                                          "per_phase": flops["per_phase"]}}
        prof.add_metadata_json("dtlib", json.dumps(meta))
    context = nullcontext(trace_dir) if trace_dir is not None else tempfile.TemporaryDirectory()
    with context as folder:
        os.makedirs(folder, exist_ok=True)
        path = trace_path(folder, rank)
        prof.export_chrome_trace(path)
        with open(path) as f:
            return parse_trace(json.load(f))
