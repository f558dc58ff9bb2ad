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
import dataclasses
from dataclasses import replace
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.flops import attention_flops_per_token
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import KERNEL_LAUNCH_S, Cluster, Link
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.measured import MeasuredAccelerator, MeasuredLink
from dtlib.plan.gemm import FLASH_BACKWARD
from dtlib.plan.steptime import StepOptions, step_time

__all__ = ["FORMAT", "load_profile", "calibrated_cluster", "attention_efficiency", "profile_sources",
           "memory_bound_bandwidth", "counted_forward_kernels", "counted_zero3_kernels"]

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
        check_figures(profile)
        calibrated_cluster(profile)
        attention_efficiency(profile)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ValueError(f"--calibration {path}: a figure is missing or malformed ({exc})") from None
    except ValueError as exc:
        raise ValueError(f"--calibration {path}: {exc}".replace("\n", " ")) from None
    return profile


# The measured figures a plan divides by or scales with, by section: sizes are integers >= 1, rates
# and times finite and > 0 (a hand-edited or damaged profile gave NaN plans or ZeroDivisionError).
_SIZES_OF = {"gemm": ("m", "n", "k", "batch"), "attention": ("micro_batch_size", "heads", "seq", "head_dim"),
             "rows": ("bytes",)}
_RATES_OF = {"gemm": ("seconds", "flops_per_s"), "attention": ("seconds",), "elementwise": ("bytes_per_s",),
             "rows": ("busbw_bytes_per_s",), "kernel": ("seconds_per_kernel",),
             "step": ("forward_backward_seconds", "optimizer_seconds", "bytes_per_s", "optimizer_bytes_per_s")}
_COUNTS_OF = {"step": ("layer_forward_kernels", "zero3_layer_kernels")}


def check_figures(profile: dict[str, Any]) -> None:
    """Raise a one-line ValueError naming the first measured figure that is not a size >= 1, a
    finite positive rate or time, or a count >= 0 (``gemm[2].flops_per_s must be ...``); the
    step's figures may be absent or None (not measured)."""
    def check(name: str, row: dict[str, Any], where: str, optional: bool = False) -> None:
        for key in _SIZES_OF.get(name, ()):
            validate.integer(f"{where}.{key}", row[key])
        for key in _RATES_OF.get(name, ()):
            if not (optional and row.get(key) is None):
                validate.number(f"{where}.{key}", row[key])
        for key in _COUNTS_OF.get(name, ()):
            if row.get(key) is not None:
                validate.integer(f"{where}.{key}", row[key], minimum=0)

    for i, row in enumerate(profile["gemm"]):
        check("gemm", row, f"gemm[{i}]")
    check("attention", profile["attention"], "attention")
    check("elementwise", profile["elementwise"], "elementwise")
    for section in ("intra", "inter"):
        for i, row in enumerate((profile.get(section) or {}).get("rows", ())):
            check("rows", row, f"{section}.rows[{i}]")
    if profile.get("kernel"):
        check("kernel", profile["kernel"], "kernel")
    if profile.get("step"):
        check("step", profile["step"], "step", optional=True)


def _gemm_rows(rows: list[dict[str, Any]]) -> tuple[tuple[float, float, float, float, float], ...]:
    return tuple((r["m"], r["n"], r["k"], r["batch"], r["seconds"]) for r in rows)


def memory_bound_bandwidth(model: TransformerConfig, options: StepOptions, step: dict[str, Any],
                           gemm: list[dict[str, Any]], seconds_per_kernel: float) -> dict[str, Any]:
    """The bandwidths at which the planner's memory-bound terms take what a measured one-rank step
    (``step``: :func:`dtlib.plan.calibrate` ``_one_rank_step``'s figures) spends on them: ``elementwise``
    what its forward + backward leaves after the planner's GEMMs (timed from ``gemm``, the profile's
    rows) and kernel costs (``seconds_per_kernel`` x the layer's counted kernels); ``optimizer`` its
    optimizer step. Returns ``{"planned_gemm_seconds", "planned_launch_seconds",
    "planned_elementwise_bytes", "planned_optimizer_bytes", "bytes_per_s", "optimizer_bytes_per_s"}``;
    a bandwidth is None where the planner's other terms take the whole time."""
    probe = MeasuredAccelerator("probe", {"bf16": 1.0}, 2 ** 62, 1.0, "1 B/s: the terms in bytes",
                                kernel_launch_s=seconds_per_kernel, gemms=_gemm_rows(gemm))
    link = Link("none", 1.0, 0.0, "one rank: no collective")
    options = replace(options, forward_kernels=step.get("layer_forward_kernels"))
    t = step_time(model, Parallelism(micro_batch_size=step["micro_batch_size"]), Cluster(probe, 1, 1, link, link),
                  options=options).breakdown
    left = step["forward_backward_seconds"] - t["compute"] - t["launch"]
    return {"planned_gemm_seconds": t["compute"], "planned_launch_seconds": t["launch"],
            "planned_elementwise_bytes": t["elementwise"], "planned_optimizer_bytes": t["optimizer"],  # seconds at 1 B/s
            "bytes_per_s": t["elementwise"] / left if left > 0 else None,
            "optimizer_bytes_per_s": t["optimizer"] / step["optimizer_seconds"]}


# what an operator count does not depend on: the sizes, not the kinds of operators
_SIZES = ("name", "source", "layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab", "seq")


def counted_forward_kernels(profile: dict[str, Any], model: TransformerConfig | None = None) -> int | None:
    """The kernels one layer of the profile's model launches forward, as ``dtlib calibrate`` counted
    them on ``dtlib train``'s TinyGPT; None where not measured (a ``--model`` preset, a GPU profile)
    or where ``model`` is another architecture (other norm, activation, positions, GQA or biases)."""
    return _counted(profile, model, "layer_forward_kernels")


def counted_zero3_kernels(profile: dict[str, Any], model: TransformerConfig | None = None) -> int | None:
    """The operators ``dtlib.parallel.FSDP`` adds to a layer per micro-batch under ZeRO-3, as ``dtlib
    calibrate`` counted them on ``dtlib train``'s TinyGPT (:data:`StepOptions.zero3_kernels`); None as
    :func:`counted_forward_kernels` (and in a profile of one rank, or written before they were counted)."""
    return _counted(profile, model, "zero3_layer_kernels")


def _counted(profile: dict[str, Any], model: TransformerConfig | None, key: str) -> int | None:
    """The step's count ``key`` if ``model`` (None: any) has the profile's architecture."""
    count = (profile.get("step") or {}).get(key)
    if count is None or model is None:
        return count
    measured, planned = profile["model_config"], dataclasses.asdict(model)
    kind = {k: v for k, v in measured.items() if k not in _SIZES}
    same = kind == {k: v for k, v in planned.items() if k in kind}
    same = same and (measured["kv_heads"] < measured["heads"]) == (model.kv_heads < model.heads)
    return count if same else None


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
    optimizer = step.get("optimizer_bytes_per_s")
    memory_bound = (f"elementwise terms at {bandwidth / 1e9:.3g} GB/s (a measured one-rank forward + backward less "
                    f"its GEMMs and kernel costs)" if step.get("bytes_per_s") else f"elementwise {bandwidth / 1e9:.3g} GB/s")
    if optimizer:
        memory_bound += f", the optimizer at {optimizer / 1e9:.3g} GB/s (its step measured)"
    # a profile written before the kernel cost was measured: the catalogue's (a GPU's) figure
    launch = profile["kernel"]["seconds_per_kernel"] if profile.get("kernel") else KERNEL_LAUNCH_S
    device = m["gpu"] or "cpu"
    name = "cpu" if m["device"] == "cpu" else f"{device} (calibrated)"
    source = (f"measured by dtlib calibrate on {host} ({device}, {m['ranks']} ranks at once, {profile['date']}, "
              f"torch {profile['versions']['torch']}, {profile.get('clock', 'wall')} clock, "
              f"{profile.get('statistic', 'median')} of repeats): GEMMs in {dtype} by "
              f"shape, {memory_bound}, {1e6 * launch:.3g} us per kernel; the {dtype} peak stands for every matmul precision")
    peaks = {"fp32": None, "tf32": None, "bf16": best, "fp16": None, "fp8": None, "fp4": None, dtype: best}
    acc = MeasuredAccelerator(name, peaks, int(m["memory_bytes_per_rank"]), bandwidth, source, kernel_launch_s=launch,
                              gemms=gemms, measured_dtype=dtype, optimizer_bytes_per_s=optimizer)
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
    gpu = calibrated_cluster(profile).gpu
    kernels, zero3 = counted_forward_kernels(profile), counted_zero3_kernels(profile)
    return {"gemm": f"GEMM seconds by shape measured in {profile['dtype']}, interpolated between "
                    f"{len(profile['gemm'])} shapes: {where}",
            "attention": f"FlashAttention efficiency {attention_efficiency(profile):.3f} from the measured "
                         f"causal attention: {where}",
            "elementwise": f"memory-bound terms: elementwise at {gpu.memory_bandwidth / 1e9:.3g} GB/s, optimizer at "
                           f"{gpu.optimizer_bandwidth / 1e9:.3g} GB/s: {where}",
            "kernel launch": (f"measured {1e6 * gpu.kernel_launch_s:.3g} us per kernel"
                       + (f", {kernels} kernels per layer forward counted on the model" if kernels else "")
                       + (f", {zero3} operators per layer under ZeRO-3 (dtlib.parallel.FSDP)" if zero3 else "")
                       + f": {where}" if profile.get("kernel") else
                       f"the catalogue's {1e6 * KERNEL_LAUNCH_S:.3g} us per kernel (not in this profile)"),
            "collectives": f"{ops}: busbw per message size within a node"
                           + (" and across nodes" if profile.get("inter") else "") + f": {where}",
            "not measured": "the step-time model's structure (dtlib.plan.steptime.TERMS), overlaps and "
                            "precision conventions are the plan's options, as without a profile"}
