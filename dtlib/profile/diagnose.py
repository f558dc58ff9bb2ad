"""Diagnosis: from the ranks' breakdowns to MFU/HFU and ranked findings, each with its fix.

Every finding estimates the *time lost* per step to its cause, as a share of the job's step
(the slowest rank's), as the median over the profiled steps: findings are ordered by it and their
severity comes from it.

* ``communication``: exposed communication on the rank that waits least (the last to arrive at
  each collective waits only for the transfer itself, not for a slower peer);
* ``input``: data loading, mean over ranks;
* ``bubble``: pipeline stages waiting for their neighbours, mean over ranks;
* ``straggler``: the slowest rank's busy time (step minus exposed communication and bubble)
  above the median of the others', when it is more than ``straggler_skew`` above it;
* ``launch``: host gaps between operators inside forward/backward on the rank with the fewest
  (the host, not the device, sets the pace: Python and operator dispatch between small kernels);
* ``recompute``: compute x (HFU - MFU) / HFU, when HFU / MFU exceeds ``recompute_ratio``.

MFU = model FLOPs / (step time x peak), HFU = hardware FLOPs / (step time x peak) per rank
(Chowdhery et al. 2022, App. B) via :func:`dtlib.analytic.flops.utilization`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from statistics import mean, median
from typing import Any, Sequence

from dtlib.analytic.flops import utilization
from dtlib.analytic.hardware import Accelerator
from dtlib.profile.breakdown import PARTS

__all__ = ["Thresholds", "Finding", "KINDS", "FIXES", "summarize", "diagnose", "format_summary"]

KINDS = ("communication", "input", "bubble", "straggler", "launch", "recompute")
FIXES = {
    "communication": "overlap communication with backward and use larger buckets "
                     "(DDP bucket_cap_mb); else compress gradients or all-reduce hierarchically",
    "input": "load data ahead of the step: DataLoader(num_workers>0, prefetch_factor, pin_memory)",
    "bubble": "more micro-batches per step (bubble (p-1)/m), or an interleaved / zero-bubble schedule",
    "straggler": "find out why that rank is slow (its device, its data shard, a noisy neighbour)",
    "launch": "fewer, larger kernels: bigger micro-batches, fused operators, torch.compile or CUDA graphs",
    "recompute": "recompute selectively (attention only) or not at all if the activations fit",
}


@dataclass(frozen=True)
class Thresholds:
    """Severity cut-offs as a share of the step lost: ``high`` >= 25%, ``medium`` >= 10%,
    reported at all from ``report`` = 5%. A straggler needs its busy time ``straggler_skew`` =
    100% above the others' (ranks sharing 2 cores with other jobs differed by up to 71% with no
    fault injected; on dedicated GPUs 0.1 is a sharper choice); recomputation needs HFU/MFU above ``recompute_ratio`` = 1.1."""
    high: float = 0.25
    medium: float = 0.10
    report: float = 0.05
    straggler_skew: float = 1.0
    recompute_ratio: float = 1.10

    def severity(self, share: float) -> str:
        return "high" if share >= self.high else "medium" if share >= self.medium else "low"


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: str
    seconds_lost: float
    share: float
    evidence: str
    fix: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(ranks: Sequence[dict[str, Any]], peak: "Accelerator | None" = None) -> dict[str, Any]:
    """Combine the ranks' parsed profiles (:func:`~dtlib.profile.breakdown.parse_trace`) into the
    job's profile: ``breakdown`` {rank: {part: seconds}}, ``step_time`` (slowest rank), MFU/HFU
    (the ranks' FLOPs summed over the step time x their peaks summed), achieved model FLOP/s per rank and
    ``tokens_per_second`` (the ranks' ``tokens`` per step over the step; None if none given)."""
    if not ranks:
        raise ValueError("no rank profiles to summarise")
    by_rank = {r["rank"]: r for r in sorted(ranks, key=lambda r: r["rank"])}
    step_time = max(r["breakdown"]["step"] for r in by_rank.values())
    # the job's MFU/HFU: all ranks' FLOPs over all ranks' peak capacity in the step. (A mean of
    # per-rank ratios weighs each rank by its own measured peak: with uneven pipeline stages it
    # could put HFU below MFU although the ranks ran every model FLOP.)
    capacity, model, hardware, achieved = 0.0, 0.0, 0.0, []
    for r in by_rank.values():
        own_peak = peak if peak is not None else r["peak_flops"]
        acc = own_peak if isinstance(own_peak, Accelerator) else _flat_peak(own_peak, r["dtype"])
        capacity += 1.0 / utilization(1.0, step_time, 1, acc, r["dtype"])  # step_time x this rank's peak
        model += r["flops"]["model"]
        hardware += r["flops"]["hardware"]
        achieved.append(r["flops"]["model"] / step_time)
    return {"breakdown": {k: {p: r["breakdown"][p] for p in (*PARTS, "overlapped_comm", "host_gaps", "step")}
                          for k, r in by_rank.items()},
            "steps": {k: r["steps"] for k, r in by_rank.items()},
            "wall": {k: r["wall"] for k, r in by_rank.items()},
            "step_time": step_time, "mfu": model / capacity, "hfu": hardware / capacity,
            "achieved_flops_per_rank": mean(achieved),
            "tokens_per_second": sum(r.get("tokens") or 0 for r in by_rank.values()) / step_time or None,
            "flops": {k: r["flops"] for k, r in by_rank.items()}}


def _flat_peak(flops: float, dtype: str) -> Accelerator:
    return Accelerator("measured", {dtype: flops}, 0, 0.0, "peak recorded in the trace")


def _steps(profile: dict[str, Any]) -> dict[Any, list[dict[str, float]]]:
    """Each rank's parts step by step (a profile without them counts as one mean step)."""
    steps = profile.get("steps")
    return steps if steps else {k: [v] for k, v in profile["breakdown"].items()}


def diagnose(profile: dict[str, Any], thresholds: Thresholds = Thresholds()) -> list[Finding]:
    """Findings of a :func:`summarize` d profile, ordered by time lost (largest first); those
    under ``thresholds.report`` of the step are left out. Each figure is the median over the
    profiled steps of that step's value, so one step disturbed by the machine changes nothing."""
    steps = _steps(profile)
    ranks = sorted(steps)
    count = min(len(v) for v in steps.values())

    def per_step(fn) -> float:
        return median(fn(i) for i in range(count))

    def mean_of(part: str) -> float:
        return per_step(lambda i: mean(steps[k][i][part] for k in ranks))

    step = per_step(lambda i: max(steps[k][i]["step"] for k in ranks))
    candidates: list[tuple[str, float, str]] = []
    comm = per_step(lambda i: min(steps[k][i]["exposed_comm"] for k in ranks))
    overlapped = mean_of("overlapped_comm")
    candidates.append(("communication", comm,
                       f"exposed communication {_ms(comm)} per step even on the rank that waits "
                       f"least (the last to arrive), {_pct(comm / step)} of the step; "
                       f"{_ms(overlapped)} overlapped with compute"))
    data = mean_of("data")
    candidates.append(("input", data, f"data loading {_ms(data)} per step, {_pct(data / step)}"))
    bubble = mean_of("bubble")
    candidates.append(("bubble", bubble, f"stages wait for their neighbours {_ms(bubble)} per "
                                         f"step, {_pct(bubble / step)} (pipeline bubble)"))
    # the rank with the fewest gaps: a straggler's own sleep inside forward is idle time too, and
    # it is the straggler's (counted below), not every rank's launch overhead
    gaps = per_step(lambda i: min(steps[k][i]["host_gaps"] for k in ranks))
    compute = mean_of("compute")
    candidates.append(("launch", gaps, f"host gaps between operators {_ms(gaps)} per step even on "
                                       f"the rank with the fewest, against {_ms(compute)} of operators"))
    if len(ranks) > 1:
        def busy(k: Any, i: int) -> float:
            s = steps[k][i]
            return s["step"] - s["exposed_comm"] - s["bubble"]

        slowest = max(ranks, key=lambda k: per_step(lambda i: busy(k, i)))
        others = per_step(lambda i: median(busy(k, i) for k in ranks if k != slowest))
        lost = per_step(lambda i: busy(slowest, i) - median(busy(k, i) for k in ranks if k != slowest))
        if others > 0 and lost > thresholds.straggler_skew * others:
            candidates.append(("straggler", lost,
                               f"rank {slowest} is busy {_ms(others + lost)} per step against "
                               f"{_ms(others)} for the others (+{_pct(lost / others)}); they "
                               f"wait for it in their collectives"))
    ratio = profile["hfu"] / profile["mfu"] if profile["mfu"] > 0 else 1.0
    if ratio > thresholds.recompute_ratio:
        lost = compute * (1 - 1 / ratio)
        candidates.append(("recompute", lost,
                           f"HFU {_pct(profile['hfu'])} vs MFU {_pct(profile['mfu'])}: "
                           f"{ratio:.2f}x the model FLOPs are computed (recomputation)"))
    findings = [Finding(kind, thresholds.severity(lost / step), lost, lost / step, evidence,
                        FIXES[kind])
                for kind, lost, evidence in candidates if lost / step >= thresholds.report]
    return sorted(findings, key=lambda f: f.seconds_lost, reverse=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _pct(share: float) -> str:
    return f"{share * 100:.0f}%"


def format_summary(profile: dict[str, Any], findings: Sequence[Finding]) -> str:
    """A table per rank (milliseconds per step) and the findings, as ``dtlib train --profile``
    and ``dtlib profile DIR`` print them."""
    cols = (*PARTS, "step")
    lines = ["rank " + " ".join(f"{c:>12}" for c in cols)]
    for rank, parts in profile["breakdown"].items():
        lines.append(f"{rank:>4} " + " ".join(f"{parts[c] * 1e3:>12.2f}" for c in cols))
    lines.append(f"step {profile['step_time'] * 1e3:.2f} ms (slowest rank); "
                 f"MFU {_pct(profile['mfu'])}, HFU {_pct(profile['hfu'])}; "
                 f"{profile['achieved_flops_per_rank'] / 1e9:.2f} GFLOP/s per rank (model FLOPs)"
                 + (f"; {profile['tokens_per_second']:,.0f} tokens/s" if profile.get("tokens_per_second") else ""))
    if not findings:
        lines.append("no bottleneck above the reporting threshold")
    for i, f in enumerate(findings, 1):
        lines.append(f"{i}. [{f.severity}] {f.kind}: {f.evidence}\n   fix: {f.fix}")
    return "\n".join(lines)
