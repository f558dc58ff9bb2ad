"""Failures, checkpoint interval and goodput of a long training job (scalars or numpy arrays).

A job on ``gpus`` GPUs fails whenever any one of them does: with independent failures at a
per-GPU mean time between failures ``gpu_mtbf``, the job's MTBF is ``gpu_mtbf / gpus``.

Checkpointing every ``tau`` seconds at a cost of ``C`` seconds, the first-order model of Young
(1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9)) gives the
interval ``tau = sqrt(2 C M)`` that minimises the expected waste; Daly (2006, "A higher order
estimate of the optimum checkpoint interval for restart dumps", FGCS 22(3), eq. 20) refines it to
``sqrt(2 C M) (1 + sqrt(C/(2M))/3 + C/(18 M)) - C`` for ``C < 2M`` (``M`` otherwise).

Goodput, the fraction of wall-clock time that advances training, is one minus the waste of
Young's model per unit time: writing checkpoints ``C/tau``, and per failure (``1/M`` per second)
half an interval of lost work on average plus the restart time ``R``:
``goodput = 1 - C/tau - (tau/2 + R)/M`` (Young 1974, Sec. 2; Daly 2006, eq. 3 to first order).

Default per-GPU MTBF, from Llama Team 2024 ("The Llama 3 Herd of Models", Sec. 3.3.4, Table 5):
419 unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs, i.e.
54 x 24 x 16384 / 419 = 50,677 GPU-hours per failure (a job MTBF of about 3 h at that scale).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic import validate

__all__ = ["LLAMA3_GPU_MTBF_HOURS", "job_mtbf", "expected_failures", "young_interval",
           "daly_interval", "goodput", "INTERVALS"]

LLAMA3_GPU_MTBF_HOURS = 54 * 24 * 16384 / 419
INTERVALS = ("young", "daly")


def job_mtbf(gpu_mtbf: Any, gpus: Any) -> Any:
    """Mean time between failures of a job on ``gpus`` GPUs (units of ``gpu_mtbf``)."""
    validate.array("gpu_mtbf", gpu_mtbf)
    validate.array("gpus", gpus)
    return gpu_mtbf / gpus


def expected_failures(duration: Any, mtbf: Any) -> Any:
    """Failures expected in ``duration`` with a job MTBF ``mtbf`` (same units): a Poisson mean."""
    validate.array("mtbf", mtbf)
    validate.array("duration", duration, exclusive=False)
    return duration / mtbf


def young_interval(checkpoint_cost: Any, mtbf: Any) -> Any:
    """Young (1974): ``sqrt(2 C M)``."""
    validate.array("checkpoint_cost", checkpoint_cost)
    validate.array("mtbf", mtbf)
    return np.sqrt(2 * checkpoint_cost * mtbf)


def daly_interval(checkpoint_cost: Any, mtbf: Any) -> Any:
    """Daly (2006), eq. 20: Young's interval with higher-order terms; ``M`` when ``C >= 2M``."""
    c, m = checkpoint_cost, mtbf
    young = young_interval(c, m)
    refined = young * (1 + np.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c
    return np.where(c < 2 * m, refined, m)


def goodput(interval: Any, checkpoint_cost: Any, mtbf: Any, restart: Any = 0.0) -> Any:
    """Fraction of wall-clock time that advances training, ``1 - C/tau - (tau/2 + R)/M``, clipped
    at 0 (a job that fails faster than it can checkpoint makes no progress)."""
    validate.array("interval", interval)
    validate.array("checkpoint_cost", checkpoint_cost)
    validate.array("mtbf", mtbf)
    validate.array("restart", restart, exclusive=False)
    waste = checkpoint_cost / interval + (interval / 2 + restart) / mtbf
    return np.maximum(1 - waste, 0.0)
