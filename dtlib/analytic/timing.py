"""How the repeats of one measurement become one figure: a named statistic, stated with the figure.

Load on a shared machine only ever adds time (a descheduled rank, a core taken by another job), so
the fastest repeat is the least disturbed one: ``min``, the estimator Chen & Revels 2016 argue for
("Robust benchmarking in noisy environments", arXiv:1608.04295). nccl-tests, on dedicated GPUs,
reports the mean (``mean``); ``median`` is between, robust to a few disturbed repeats either way.
The minimum is a lower bound of what the same call costs inside real work (docs/plan.md, "The
statistic of a calibrated figure": plans from minimum figures were reproducible but fast).
Lesson 02's all-reduce timings take the minimum (:func:`dtlib.experiments.time_all_reduce`),
``dtlib calibrate`` the median unless told otherwise (:func:`dtlib.plan.calibrate.calibrate`).
"""
from __future__ import annotations

import statistics
from typing import Sequence

from dtlib.analytic import validate

__all__ = ["STATISTICS", "summarise"]

STATISTICS = {"min": min, "median": statistics.median, "mean": statistics.fmean}


def summarise(times: Sequence[float], statistic: str = "min") -> float:
    """One time from repeated ``times`` by ``statistic`` (a key of :data:`STATISTICS`)."""
    validate.one_of("statistic", statistic, STATISTICS)
    if not len(times):
        raise ValueError("times must hold at least one measurement")
    return float(STATISTICS[statistic](list(times)))
