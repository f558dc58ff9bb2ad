"""Checks for the capstone exercise (design a training run before it runs).

* q1 :func:`check_layout_is_the_job`, :func:`check_layout_is_feasible`, :func:`check_layout_is_fast`
  -- a layout for the 10B model on 16 x 8 H100 through the reviewer's checks of
  :func:`dtlib.plan.design.check_design`;
* q2 :func:`check_teaching_cases`, :func:`check_exposed_time` -- DDP's exposed all-reduce with
  buckets, against :func:`dtlib.plan.finetune.bucket_exposed_time`;
* q3 :func:`check_report_consistent`, :func:`check_report_matches_dtlib` -- the 10,000-GPU report:
  its numbers agree with each other (Young's interval, goodput, cost = GPU-hours x price, ...)
  and with :func:`dtlib.plan.design.system_report`.
"""
from __future__ import annotations

import math
import random
from functools import lru_cache
from typing import Any, Callable

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.analytic.reliability import LLAMA3_GPU_MTBF_HOURS
from dtlib.plan.design import check_design, system_report
from dtlib.plan.finetune import bucket_exposed_time

__all__ = ["JOB", "SYSTEM", "REPORT_KEYS", "HINT_FORBIDDEN", "check_layout_is_the_job", "check_layout_is_feasible",
           "check_layout_is_fast", "check_teaching_cases", "check_exposed_time", "check_report_consistent",
           "check_report_matches_dtlib", "reference_exposed_time", "reference_report"]

JOB = dict(model="capstone-10b", nodes=16, gpus_per_node=8, gpu="h100-sxm", global_batch=1024)
SYSTEM = dict(model="llama3-405b", gpus=10240, global_batch=2048, tokens=15e12, price_per_gpu_hour=2.5,
              checkpoint_cost_s=60.0, restart_s=600.0)
REPORT_KEYS = ("switches", "days", "gpu_hours", "cost_usd", "failures_per_day", "checkpoint_interval_min", "goodput")
_REL = 0.01
# The answers, spelled other than in the master's solution (dtlib.grading.hint_policy, rule 3):
# Q2's formula, Q1's best layout.
HINT_FORBIDDEN = (r"max\(\s*n\b", r"\bn\s*[*x]\s*t\(", r"best layout is", r"\bdp\s*=\s*\d+,?\s+tp\s*=\s*\d+")


# ---- q1 ------------------------------------------------------------------------------------------
def _design(layout: Any) -> dict[str, Any]:
    if not isinstance(layout, Parallelism):
        raise AssertionError(f"my_layout must be a dtlib.analytic.layout.Parallelism, e.g. Parallelism(dp=..., "
                             f"tp=..., ...), got {layout!r}")
    model = get_preset(JOB["model"])
    cl = cluster(JOB["gpu"], JOB["nodes"], JOB["gpus_per_node"])
    try:
        return {c.name: c for c in check_design(model, layout, cl, JOB["global_batch"])}
    except ValueError as exc:  # a rule of dtlib.analytic.layout the layout breaks for this model
        raise AssertionError(f"my_layout is not a valid layout of {JOB['model']}: {exc}") from None


def _require(checks: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if not checks[name].ok:
            raise AssertionError(f"{name}: {checks[name].why}")


def check_layout_is_the_job(layout: Any) -> None:
    """The layout uses the 128 GPUs and the global batch of 1,024 sequences."""
    _require(_design(layout), ("uses the cluster", "global batch"))


def check_layout_is_feasible(layout: Any) -> None:
    """It fits in 90% of an H100, keeps TP inside a node and its bubble under 20%."""
    _require(_design(layout), ("uses the cluster", "global batch", "TP inside a node", "fits memory",
                               "pipeline bubble"))


def check_layout_is_fast(layout: Any) -> None:
    """Its predicted MFU is at least 90% of the planner's best."""
    _require(_design(layout), ("uses the cluster", "global batch", "MFU near the best"))


# ---- q2 ------------------------------------------------------------------------------------------
def reference_exposed_time(grad_bytes: float, bucket_bytes: float, backward: float,
                           all_reduce_time: Callable[[float], float]) -> float:
    """The answer to q2, written with dtlib."""
    return bucket_exposed_time(grad_bytes, bucket_bytes, backward, all_reduce_time)


def _alpha_beta(latency: float, bandwidth: float) -> Callable[[float], float]:
    return lambda nbytes: latency + nbytes / bandwidth


def _compare(fn: Callable, case: tuple, why: str) -> None:
    grad_bytes, bucket_bytes, backward, (latency, bandwidth) = case
    timer = _alpha_beta(latency, bandwidth)
    want = reference_exposed_time(grad_bytes, bucket_bytes, backward, timer)
    call = f"exposed_time({grad_bytes:g}, {bucket_bytes:g}, backward={backward:g}, t)"
    try:
        got = fn(grad_bytes, bucket_bytes, backward, timer)
    except Exception as exc:  # the learner's code: say what it raised, on which case
        raise AssertionError(f"{call} raised {type(exc).__name__}: {exc}") from None
    if got is None or isinstance(got, bool) or not isinstance(got, (int, float)):
        raise AssertionError(f"{call} returned {got!r}: fill in exposed_time and return the exposed seconds "
                             "(a number)")
    if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
        # the verdict first; the case in full (the link, the buckets) on the next line
        raise AssertionError(f"{why}: {call} returned {got!r}, expected {want:.6g} s\n"
                             f"t(bytes) = {latency:g} s + bytes / {bandwidth:g} B/s; "
                             f"{math.ceil(grad_bytes / bucket_bytes)} buckets")


# Each verdict names the mistake and the bullet of the question to re-read, never the formula.
_ANY_MISTAKE = "re-read the three bullets of Q2 (the buckets, one all-reduce each, the last one after backward)"


def check_teaching_cases(fn: Callable) -> None:
    """Three cases that each catch one classic mistake."""
    cases = [
        (1e9, 25e6, 1.0, (1e-4, 1e10), "with a long backward the last bucket is still exposed (bullet 3), not 0"),
        (1e9, 1e6, 0.0, (1e-3, 1e10), "each of the 1,000 buckets pays the latency (bullet 2), not one all-reduce "
                                      "of all the bytes"),
        (1e9, 3e8, 0.01, (1e-2, 1e9), "1e9 bytes in 3e8-byte buckets is 4 buckets (bullet 1: round up)"),
    ]
    for *case, why in cases:
        _compare(fn, tuple(case), why)


def check_exposed_time(fn: Callable, n: int = 300, seed: int = 0) -> None:
    """Random gradient sizes, bucket sizes, backward times and links."""
    rng = random.Random(seed)
    for _ in range(n):
        case = (rng.uniform(1e6, 1e11), rng.choice([1e5, 1e6, 25 * 2 ** 20, 1e8, 1e9]), rng.uniform(0, 2.0),
                (rng.choice([0.0, 5e-6, 5e-5]), rng.choice([2.5e10, 5e10, 4.5e11])))
        _compare(fn, case, _ANY_MISTAKE)


# ---- q3 ------------------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def reference_report() -> dict[str, Any]:
    """The numbers of q3, from dtlib."""
    s = SYSTEM
    return system_report(get_preset(s["model"]), s["gpus"], s["global_batch"], s["tokens"],
                         price_per_gpu_hour=s["price_per_gpu_hour"], checkpoint_cost_s=s["checkpoint_cost_s"])


def _numbers(report: Any) -> dict[str, float]:
    if not isinstance(report, dict):
        raise AssertionError(f"report must be a dict with keys {', '.join(REPORT_KEYS)}, got {report!r}")
    missing = [k for k in REPORT_KEYS if k not in report]
    if missing:
        raise AssertionError(f"report lacks {', '.join(missing)}; fill every key of {', '.join(REPORT_KEYS)}")
    bad = [k for k in REPORT_KEYS if isinstance(report[k], bool) or not isinstance(report[k], (int, float))
           or not math.isfinite(report[k]) or report[k] < 0]
    if bad:
        raise AssertionError(f"report[{bad[0]!r}] must be a number >= 0 computed with dtlib, got {report[bad[0]]!r}")
    return {k: float(report[k]) for k in REPORT_KEYS}


def _close(name: str, got: float, want: float, where: str) -> None:
    """The hint names the quantity that disagrees and where to look, never the formula or value."""
    if not math.isclose(got, want, rel_tol=_REL):
        raise AssertionError(f"{name} = {got:.6g} does not agree with the report's other numbers: {where}")


def check_report_consistent(report: Any) -> None:
    """The numbers agree with each other: GPU-hours, cost, failures, Young's interval, goodput."""
    r, s = _numbers(report), SYSTEM
    _close("gpu_hours", r["gpu_hours"], r["days"] * 24 * s["gpus"],
           "GPU-hours count every GPU of SYSTEM for the run's days")
    _close("cost_usd", r["cost_usd"], r["gpu_hours"] * s["price_per_gpu_hour"],
           "the cost is what SYSTEM's price charges for the GPU-hours")
    mtbf_h = LLAMA3_GPU_MTBF_HOURS / s["gpus"]
    _close("failures_per_day", r["failures_per_day"], 24 / mtbf_h,
           "failures per day come from the job's MTBF (dtlib.analytic.reliability.job_mtbf)")
    mtbf_s, c = mtbf_h * 3600, s["checkpoint_cost_s"]
    tau = math.sqrt(2 * c * mtbf_s)
    _close("checkpoint_interval_min", r["checkpoint_interval_min"], tau / 60,
           "Young's interval from SYSTEM's checkpoint cost and the job's MTBF, in minutes "
           "(dtlib.analytic.reliability.young_interval)")
    _close("goodput", r["goodput"], 1 - c / tau - (tau / 2 + s["restart_s"]) / mtbf_s,
           "goodput at that interval, with SYSTEM's checkpoint and restart times "
           "(dtlib.analytic.reliability.goodput)")


def check_report_matches_dtlib(report: Any) -> None:
    """The fabric and the run time are dtlib's: fat_tree(10240, 64) and the planner's best layout."""
    r, want = _numbers(report), reference_report()
    if int(r["switches"]) != want["switches"]:
        raise AssertionError(f"switches = {r['switches']:g} is not dtlib's fat-tree of 64-port switches for "
                             f"{SYSTEM['gpus']:,} NICs: take it from dtlib.plan.topology.fat_tree")
    if not math.isclose(r["days"], want["days"], rel_tol=_REL):
        raise AssertionError(f"days = {r['days']:.6g} is not the run time of the planner's best layout: take "
                             "search's best step time into dtlib.plan.training.training_plan")
