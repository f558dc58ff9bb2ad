"""How often to checkpoint: Young/Daly's interval, and a Monte-Carlo run with random failures that
checks it.

The formulas live in :mod:`dtlib.analytic.reliability` (Young 1974; Daly 2006). This module adds
what they are checked against: a simulation of a long run in which failures arrive as a Poisson
process (the job's MTBF ``M`` = per-GPU MTBF / GPUs) at any moment - while computing, while
writing a checkpoint, and while restarting. The run computes in segments of ``interval`` seconds,
each followed by a checkpoint of ``checkpoint_cost`` seconds (its blocking time if it is
asynchronous); a failure loses the segment in progress and costs a restart of ``restart``
seconds. The expected wall time of one segment in this model is Daly's (2006, eq. 5 with the
restart also exposed to failures) ``M e^{R/M} (e^{(tau+C)/M} - 1)``, so the expected goodput is
``tau / (M e^{R/M} (e^{(tau+C)/M} - 1))`` (:func:`expected_goodput`); Young's first-order
``1 - C/tau - (tau/2 + R)/M`` is its expansion for ``tau + C, R << M``.

The simulation draws, for ``segments`` segments, the number of failed attempts (negative
binomial: each attempt of ``tau + C`` seconds survives with probability ``e^{-(tau+C)/M}``), the
time each failed attempt lasted (an exponential truncated to the attempt), and the same for the
restarts; no event-by-event loop, so 10^5 segments take milliseconds.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.reliability import daly_interval, goodput, job_mtbf, young_interval

__all__ = ["expected_goodput", "simulate_goodput", "interval_study", "checkpoint_cost"]


def checkpoint_cost(checkpoint_bytes: float, bandwidth: float, blocking_seconds: float | None = None) -> float:
    """Seconds a checkpoint stops training: ``bytes / storage bandwidth`` when synchronous, or the
    measured blocking time of an asynchronous save (``Checkpointer.blocking_seconds``)."""
    if blocking_seconds is not None:
        return validate.number("blocking_seconds", blocking_seconds)
    validate.number("checkpoint_bytes", checkpoint_bytes)
    validate.number("bandwidth", bandwidth)
    return checkpoint_bytes / bandwidth


def expected_goodput(interval: Any, checkpoint_cost: float, mtbf: float, restart: float = 0.0) -> Any:
    """Daly's (2006) exact expectation for this failure model: ``tau / (M e^{R/M} (e^{(tau+C)/M} - 1))``."""
    validate.array("interval", interval)
    tau = np.asarray(interval, dtype=float)
    c = validate.number("checkpoint_cost", checkpoint_cost, exclusive=False)
    m = validate.number("mtbf", mtbf)
    r = validate.number("restart", restart, exclusive=False)
    return tau / (m * np.exp(r / m) * np.expm1((tau + c) / m))


def _truncated_exponential(rng: np.random.Generator, n: int, mean: float, limit: float) -> np.ndarray:
    """``n`` failure times of rate ``1/mean`` given that they fall before ``limit`` (inverse CDF)."""
    u = rng.random(n)
    return -mean * np.log1p(-u * -np.expm1(-limit / mean))


def simulate_goodput(interval: float, checkpoint_cost: float, mtbf: float, restart: float = 0.0,
                     segments: int = 10_000, runs: int = 20, seed: int = 0) -> np.ndarray:
    """Goodput of ``runs`` simulated runs of ``segments`` checkpointed segments each (see the module
    docstring): useful compute time / wall time, one value per run."""
    tau = validate.number("interval", interval)
    c = validate.number("checkpoint_cost", checkpoint_cost, exclusive=False)
    m = validate.number("mtbf", mtbf)
    r = validate.number("restart", restart, exclusive=False)
    validate.integer("segments", segments)
    validate.integer("runs", runs)
    rng = np.random.default_rng(seed)
    attempt = tau + c
    out = np.empty(runs)
    for i in range(runs):
        failures = rng.negative_binomial(segments, np.exp(-attempt / m))
        lost = _truncated_exponential(rng, failures, m, attempt).sum()
        restart_failures = rng.negative_binomial(failures, np.exp(-r / m)) if failures and r else 0
        lost_restarting = _truncated_exponential(rng, restart_failures, m, r).sum() if restart_failures else 0.0
        wall = segments * attempt + lost + failures * r + lost_restarting
        out[i] = segments * tau / wall
    return out


def interval_study(gpus: int, gpu_mtbf_hours: float, checkpoint_seconds: float, restart_seconds: float,
                   points: int = 40, segments: int = 2000, runs: int = 8, seed: int = 0) -> dict[str, Any]:
    """Goodput against the checkpoint interval for a cluster: Young's first-order curve, Daly's
    exact expectation, the simulation (mean per interval), and where each is best."""
    validate.integer("gpus", gpus)
    validate.integer("points", points, minimum=3)
    m = float(job_mtbf(gpu_mtbf_hours * 3600.0, gpus))
    c, r = float(checkpoint_seconds), float(restart_seconds)
    young, daly = float(young_interval(c, m)), float(daly_interval(c, m))
    intervals = np.geomspace(young / 8, young * 8, points)
    simulated = np.array([simulate_goodput(t, c, m, r, segments, runs, seed).mean() for t in intervals])
    return {"mtbf_seconds": m, "intervals": intervals, "first_order": goodput(intervals, c, m, r),
            "expected": expected_goodput(intervals, c, m, r), "simulated": simulated,
            "young": young, "daly": daly, "simulated_best": float(intervals[np.argmax(simulated)]),
            "goodput_at_daly": float(expected_goodput(daly, c, m, r))}
