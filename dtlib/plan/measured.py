"""A calibration profile (``dtlib calibrate``'s JSON) read back as the planner's device and links.

:func:`load_profile` checks a profile file (one-line errors naming the file and the field);
:func:`calibrated_cluster` turns it into a :class:`~dtlib.analytic.hardware.Cluster` whose device
is a :class:`~dtlib.analytic.measured.MeasuredAccelerator` (GEMM seconds by shape, elementwise
bandwidth) and whose links are :class:`~dtlib.analytic.measured.MeasuredLink` s (busbw per
collective and message size, within a node and, if measured, across nodes);
:func:`attention_efficiency` turns the measured attention into the planner's FlashAttention
efficiency; :func:`profile_sources` says which of the plan's figures came from the profile.
No torch: ``dtlib plan --calibration`` runs where the profile was copied to.
"""
from __future__ import annotations

import json
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.flops import attention_flops_per_token
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster, Link
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.measured import MeasuredAccelerator, MeasuredLink
from dtlib.plan.gemm import FLASH_BACKWARD
from dtlib.plan.steptime import StepOptions, step_time

__all__ = ["FORMAT", "load_profile", "calibrated_cluster", "attention_efficiency", "profile_sources",
           "memory_bound_bandwidth"]

FORMAT = "dtlib-calibration/1"
_SECTIONS = ("machine", "versions", "date", "dtype", "gemm", "attention", "elementwise", "intra")


def load_profile(path: str) -> dict[str, Any]:
    """The profile in ``path``, checked: its format, sections and every figure positive."""
    try:
        with open(path) as f:
            profile = json.load(f)
    except OSError as exc:
        raise ValueError(f"--calibration {path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--calibration {path}: not JSON ({exc.msg}, line {exc.lineno}); "
                         "write one with dtlib calibrate") from None
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        raise ValueError(f"--calibration {path}: not a {FORMAT} profile; write one with dtlib calibrate")
    missing = [s for s in _SECTIONS if not profile.get(s)]
    if missing:
        raise ValueError(f"--calibration {path}: no {missing[0]!r} section; write it again with dtlib calibrate")
    try:
        calibrated_cluster(profile)
        attention_efficiency(profile)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"--calibration {path}: a figure is missing or malformed ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"--calibration {path}: {exc}".replace("\n", " ")) from None
    return profile


def _gemm_rows(rows: list[dict[str, Any]]) -> tuple[tuple[float, float, float, float, float], ...]:
    return tuple((r["m"], r["n"], r["k"], r["batch"], r["seconds"]) for r in rows)


def memory_bound_bandwidth(model: TransformerConfig, options: StepOptions, micro_batch: int, seconds: float,
                           gemm: list[dict[str, Any]]) -> dict[str, Any]:
    """The bandwidth at which the planner's memory-bound terms (``elementwise`` and ``optimizer``)
    take what a measured one-rank step of ``micro_batch`` sequences (``seconds``) leaves after the
    planner's GEMMs, timed from ``gemm`` (the profile's rows): ``{"planned_gemm_seconds",
    "planned_memory_bytes", "bytes_per_s"}``; ``bytes_per_s`` None where the GEMMs take the whole step."""
    probe = MeasuredAccelerator("probe", {"bf16": 1.0}, 2 ** 62, 1.0, "1 B/s: the terms in bytes", gemms=_gemm_rows(gemm))
    link = Link("none", 1.0, 0.0, "one rank: no collective")
    t = step_time(model, Parallelism(micro_batch_size=micro_batch), Cluster(probe, 1, 1, link, link), options=options)
    planned_bytes = t.breakdown["elementwise"] + t.breakdown["optimizer"]  # seconds at 1 B/s
    left = seconds - t.breakdown["compute"]
    return {"planned_gemm_seconds": t.breakdown["compute"], "planned_memory_bytes": planned_bytes,
            "bytes_per_s": planned_bytes / left if left > 0 else None}


def _link(section: dict[str, Any], where: str, host: str) -> MeasuredLink:
    rows = tuple((r["op"], float(r["bytes"]), float(r["busbw_bytes_per_s"])) for r in section["rows"])
    # one rank per node: no collective measured; the planner then times none (one rank takes no time)
    largest = max(rows, key=lambda r: r[1])[2] if rows else float("inf")
    smallest = min((r for r in rows if r[0] == "all_reduce"), key=lambda r: r[1], default=None)
    n = section["ranks"]
    latency = 0.0
    if smallest is not None and n > 1:  # its time over a ring's 2(n-1) steps
        latency = smallest[1] * 2 * (n - 1) / n / smallest[2] / (2 * (n - 1))
    return MeasuredLink(f"measured-{where}", largest, latency,
                        f"measured by dtlib calibrate on {host} ({section['ranks']} ranks {where})", busbw=rows)


def calibrated_cluster(profile: dict[str, Any], nodes: int | None = None,
                       gpus_per_node: int | None = None) -> Cluster:
    """The measured machine as a cluster: ``nodes`` (default the profile's) of ``gpus_per_node``
    ranks (default the profile's ranks per node). Across nodes it needs a profile measured on
    several nodes."""
    m = profile["machine"]
    nodes = m["nodes"] if nodes is None else nodes
    per_node = m["ranks_per_node"] if gpus_per_node is None else gpus_per_node
    validate.integer("nodes", nodes)
    validate.integer("gpus_per_node", per_node)
    if nodes > 1 and not profile.get("inter"):
        raise ValueError(f"the profile was measured on one node ({m['ranks']} ranks of {m['hostname']}): it has "
                         f"no figures across nodes; plan at most {per_node} ranks or calibrate on several nodes")
    host = m["hostname"]
    dtype = profile["dtype"]
    gemms = _gemm_rows(profile["gemm"])
    best = max(r["flops_per_s"] for r in profile["gemm"])
    e = profile["elementwise"]
    step = profile.get("step") or {}
    bandwidth = step.get("bytes_per_s") or e["bytes_per_s"]
    memory_bound = (f"memory-bound terms at {bandwidth / 1e9:.3g} GB/s (a measured one-rank step less its GEMMs)"
                    if step.get("bytes_per_s") else f"elementwise {bandwidth / 1e9:.3g} GB/s")
    device = m["gpu"] or "cpu"
    name = "cpu" if m["device"] == "cpu" else f"{device} (calibrated)"
    source = (f"measured by dtlib calibrate on {host} ({device}, {m['ranks']} ranks at once, {profile['date']}, "
              f"torch {profile['versions']['torch']}, {profile.get('clock', 'wall')} clock): GEMMs in {dtype} by "
              f"shape, {memory_bound}; the {dtype} peak stands for every matmul precision")
    peaks = {"fp32": None, "tf32": None, "bf16": best, "fp16": None, "fp8": None, "fp4": None, dtype: best}
    acc = MeasuredAccelerator(name, peaks, int(m["memory_bytes_per_rank"]), bandwidth, source, gemms=gemms, measured_dtype=dtype)
    intra = _link(profile["intra"], "within a node", host)
    inter = _link(profile["inter"], "across nodes", host) if profile.get("inter") else intra
    return Cluster(acc, nodes, per_node, intra, inter, per_node)


def attention_efficiency(profile: dict[str, Any]) -> float:
    """The measured causal attention's matmul work (forward + FlashAttention's 2.5x backward,
    Dao 2023, Sec. 3.2) at the profile's best GEMM rate, over its measured time, at most 1."""
    a = profile["attention"]
    best = max(r["flops_per_s"] for r in profile["gemm"])
    hidden = a["heads"] * a["head_dim"]
    per_token = attention_flops_per_token(a["seq"], hidden, 1, "causal", heads=a["heads"], head_dim=a["head_dim"])
    work = a["micro_batch_size"] * a["seq"] * per_token
    validate.number("attention seconds", a["seconds"])
    return float(min(1.0, (1 + FLASH_BACKWARD) * work / best / a["seconds"]))


def profile_sources(profile: dict[str, Any], path: str) -> dict[str, str]:
    """Which of a plan's figures came from the profile in ``path``, in words."""
    m = profile["machine"]
    where = f"{path} ({m['hostname']}, {m['ranks']} ranks, {profile['date']})"
    ops = ", ".join(dict.fromkeys(r["op"] for r in profile["intra"]["rows"])) or "no collective (one rank per node)"
    return {"gemm": f"GEMM seconds by shape measured in {profile['dtype']}, interpolated between "
                    f"{len(profile['gemm'])} shapes: {where}",
            "attention": f"FlashAttention efficiency {attention_efficiency(profile):.3f} from the measured "
                         f"causal attention: {where}",
            "elementwise": f"memory-bound terms (elementwise, optimizer) at {calibrated_cluster(profile).gpu.memory_bandwidth / 1e9:.3g} GB/s: {where}",
            "collectives": f"{ops}: busbw per message size within a node"
                           + (" and across nodes" if profile.get("inter") else "") + f": {where}",
            "not measured": "the step-time model's structure (dtlib.plan.steptime.TERMS), overlaps and "
                            "precision conventions are the plan's options, as without a profile"}
