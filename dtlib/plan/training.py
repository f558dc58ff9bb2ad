"""A training run's plan from one step: wall-clock days, GPU-hours, cost, energy and failures.

Sourced defaults (each an option):

* price per GPU-hour: $2.5, inside the 2025-26 rental range for an H100 of about $1.5-3.5 at
  specialised clouds and $3-7 on demand at hyperscalers (reserved 30-50% below on demand) --
  dtlib's shared notes (``/work/shared/notes``), public price lists of that period;
* node power: the maximum system power of the matching DGX (DGX H100/H200 10.2 kW, DGX A100
  6.5 kW, DGX B200 14.3 kW: NVIDIA DGX datasheets), scaled to ``gpus_per_node / 8``; other GPUs
  take the DGX H100 figure;
* PUE 1.2: between hyperscale fleets (Google 2023 Environmental Report: 1.10) and the industry
  average (Uptime Institute Global Data Center Survey 2023: 1.58);
* per-GPU MTBF: :data:`dtlib.analytic.reliability.LLAMA3_GPU_MTBF_HOURS` (Llama 3, 50,677 h);
* checkpoint cost 60 s and restart 10 min: round figures, options (Llama 3 reports neither).

The checkpoint interval and goodput come from :mod:`dtlib.analytic.reliability` (Young 1974 /
Daly 2006). Wall-clock time is the ideal compute time divided by goodput.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.reliability import (INTERVALS, LLAMA3_GPU_MTBF_HOURS, daly_interval, expected_failures,
                                        goodput, job_mtbf, young_interval)

__all__ = ["TrainingPlan", "training_plan", "NODE_POWER_KW", "DEFAULT_PRICE_PER_GPU_HOUR",
           "PRICE_RANGE", "DEFAULT_PUE"]

DEFAULT_PRICE_PER_GPU_HOUR = 2.5
PRICE_RANGE = (1.5, 7.0)
DEFAULT_PUE = 1.2
# maximum system power of an 8-GPU DGX, kW (NVIDIA DGX A100 / H100 / H200 / B200 datasheets)
NODE_POWER_KW = {"a100-40gb": 6.5, "a100-80gb": 6.5, "h100-sxm": 10.2, "h200": 10.2, "b200": 14.3}


@dataclass
class TrainingPlan:
    """Everything in SI units or the one stated in the name."""
    tokens: float
    steps: float
    step_time_s: float
    compute_days: float
    days: float
    gpu_hours: float
    cost_usd: float
    price_per_gpu_hour: float
    energy_mwh: float
    node_power_kw: float
    pue: float
    job_mtbf_hours: float
    expected_failures: float
    checkpoint_interval_s: float
    checkpoint_cost_s: float
    restart_s: float
    goodput: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def training_plan(*, tokens: float, tokens_per_step: float, step_time: float, gpus: int,
                  gpus_per_node: int = 8, gpu: str = "h100-sxm",
                  price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR,
                  node_power_kw: float | None = None, pue: float = DEFAULT_PUE,
                  gpu_mtbf_hours: float = LLAMA3_GPU_MTBF_HOURS, checkpoint_cost_s: float = 60.0,
                  restart_s: float = 600.0, interval: str = "young") -> TrainingPlan:
    """Plan a run of ``tokens`` tokens at ``tokens_per_step`` per step of ``step_time`` seconds
    on ``gpus`` GPUs (see the module's sourced defaults). ``interval``: ``young`` or ``daly``."""
    for name, value in (("tokens", tokens), ("tokens_per_step", tokens_per_step), ("step_time", step_time),
                        ("price_per_gpu_hour", price_per_gpu_hour), ("gpu_mtbf_hours", gpu_mtbf_hours),
                        ("checkpoint_cost_s", checkpoint_cost_s)):
        validate.number(name, value)
    validate.integer("gpus", gpus)
    validate.integer("gpus_per_node", gpus_per_node)
    validate.number("pue", pue, minimum=1, exclusive=False)  # facility power / IT power
    validate.one_of("interval", interval, INTERVALS)
    validate.number("restart_s", restart_s, exclusive=False)
    if node_power_kw is None:
        node_power_kw = NODE_POWER_KW.get(gpu, NODE_POWER_KW["h100-sxm"]) * gpus_per_node / 8
    validate.number("node_power_kw", node_power_kw)
    steps = tokens / tokens_per_step
    compute_s = steps * step_time
    mtbf_s = job_mtbf(gpu_mtbf_hours, gpus) * 3600
    tau = (young_interval if interval == "young" else daly_interval)(checkpoint_cost_s, mtbf_s)
    useful = float(goodput(tau, checkpoint_cost_s, mtbf_s, restart_s))
    if useful <= 0:
        raise ValueError(f"no progress: a job MTBF of {mtbf_s / 3600:.2g} h on {gpus} GPUs is too short "
                         f"for a {checkpoint_cost_s:g} s checkpoint and a {restart_s:g} s restart; "
                         f"give a larger gpu_mtbf_hours or cheaper checkpoints")
    wall_s = compute_s / useful
    hours = wall_s / 3600
    gpu_hours = hours * gpus
    nodes = gpus / gpus_per_node
    return TrainingPlan(
        tokens=float(tokens), steps=steps, step_time_s=float(step_time), compute_days=compute_s / 86400,
        days=wall_s / 86400, gpu_hours=gpu_hours, cost_usd=gpu_hours * price_per_gpu_hour,
        price_per_gpu_hour=float(price_per_gpu_hour),
        energy_mwh=nodes * node_power_kw * hours * pue / 1000, node_power_kw=float(node_power_kw),
        pue=float(pue), job_mtbf_hours=mtbf_s / 3600,
        expected_failures=float(expected_failures(wall_s, mtbf_s)), checkpoint_interval_s=float(tau),
        checkpoint_cost_s=float(checkpoint_cost_s), restart_s=float(restart_s), goodput=useful)
