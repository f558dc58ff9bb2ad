"""Checking a training design, and the numbers of a whole-system report (the capstone).

:func:`check_design` runs the checks a reviewer would run on a proposed layout: the global batch
and GPU count it claims, tensor parallelism inside a node, memory fit, the pipeline bubble, and
predicted MFU against the planner's best at the same global batch. Each check says what is wrong
and what would fix it. :func:`system_report` computes the numbers a 10,000-GPU design report
quotes (fabric, best layout, run time, cost, energy, failures, checkpoints, goodput), each from
the dtlib model that owns it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlib.analytic.comm import bubble_fraction
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster, cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.units import GiB
from dtlib.plan.search import search, to_layout
from dtlib.plan.steptime import StepOptions, resolve, step_time
from dtlib.plan.topology import fat_tree
from dtlib.plan.training import DEFAULT_PRICE_PER_GPU_HOUR, training_plan

__all__ = ["DesignCheck", "check_design", "system_report"]


@dataclass(frozen=True)
class DesignCheck:
    name: str
    ok: bool
    why: str


def check_design(model: TransformerConfig, layout: Parallelism, cl: Cluster, global_batch: int, *,
                 options: StepOptions = StepOptions(), headroom: float = 0.9, max_bubble: float = 0.2,
                 mfu_fraction: float = 0.9, dropout: bool | None = None) -> list[DesignCheck]:
    """The reviewer's checks of ``layout`` (see the module docstring); later checks are skipped
    (reported as failed with the reason) when the layout does not describe this job. ``dropout``
    and FlashAttention: the activation convention's unless given (:func:`dtlib.plan.steptime.resolve`)."""
    options, dropout = resolve(options, dropout)
    checks = []
    same_job = True
    ok = layout.global_batch == global_batch
    checks.append(DesignCheck("global batch", ok, f"dp x micro_batch_size x num_microbatches = {layout.dp} x "
                              f"{layout.micro_batch_size} x {layout.num_microbatches} = {layout.global_batch}"
                              + ("" if ok else f", but the job's global batch is {global_batch}: set "
                                 f"num_microbatches = {global_batch} / (dp x micro_batch_size)")))
    same_job &= ok
    ok = layout.gpus == cl.world_size
    checks.append(DesignCheck("uses the cluster", ok, f"dp x tp x pp x cp = {layout.gpus}"
                              + ("" if ok else f", but the cluster has {cl.world_size} GPUs")))
    same_job &= ok
    ok = layout.tp <= cl.gpus_per_node
    checks.append(DesignCheck("TP inside a node", ok, f"tp = {layout.tp}" + (
        f" <= {cl.gpus_per_node} GPUs per node" if ok else f" > {cl.gpus_per_node} GPUs per node: its 4 "
        f"all-reduces per layer would cross the {cl.inter.name} network; use tp <= {cl.gpus_per_node}")))
    mem = memory_per_gpu(model, layout, precision=options.precision, gpu=cl.gpu, dropout=dropout,
                         flash_attention=options.flash_attention, stack=options.stack, dtype=options.dtype).total
    limit = headroom * cl.gpu.memory_bytes
    ok = mem <= limit
    checks.append(DesignCheck("fits memory", ok, f"{mem / GiB:.1f} GiB per GPU " + (
        f"<= {limit / GiB:.1f} GiB" if ok else f"> {limit / GiB:.1f} GiB ({headroom:g} x {cl.gpu.name}): raise "
        f"the ZeRO stage, recompute more, or add pipeline/tensor parallelism")))
    bubble = bubble_fraction(layout.pp, layout.num_microbatches, layout.virtual_stages, layout.schedule)
    ok = bubble < max_bubble
    checks.append(DesignCheck("pipeline bubble", ok, f"(p-1)/(v m) = {bubble:.1%}" + (
        f" < {max_bubble:.0%}" if ok else f" >= {max_bubble:.0%}: use more micro-batches (smaller "
        f"micro_batch_size) or interleaving (virtual_stages)")))
    if not same_job:
        checks.append(DesignCheck("MFU near the best", False, "not compared: the layout is not this job's"))
        return checks
    mine = step_time(model, layout, cl, options=options, dropout=dropout)
    best = search(model, cl, global_batch, options=options, headroom=headroom, dropout=dropout, top=1)
    best_mfu = best.configs[0]["mfu"] if best.configs else 0.0
    ok = mine.mfu >= mfu_fraction * best_mfu
    why = f"predicted MFU {mine.mfu:.1%} vs the planner's best {best_mfu:.1%}"
    if not ok:  # where the time goes, not the best layout: the capstone asks the learner to find it
        worst = max(mine.breakdown, key=lambda k: 0 if k == "compute" else mine.breakdown[k])
        why += (f" (< {mfu_fraction:.0%} of it): the largest cost after compute is {worst} = "
                f"{mine.breakdown[worst]:.3g} s of {mine.step_time:.3g} s: reduce it")
    checks.append(DesignCheck("MFU near the best", ok, why))
    return checks


def _short(config: dict[str, Any]) -> str:
    layout = to_layout(config)
    return (f"dp={layout.dp} tp={layout.tp} pp={layout.pp} cp={layout.cp} v={layout.virtual_stages} "
            f"micro_batch_size={layout.micro_batch_size} zero={layout.zero} recompute={layout.recompute} "
            f"sequence_parallel={layout.sequence_parallel}")


def system_report(model: TransformerConfig, gpus: int, global_batch: int, tokens: float, *,
                  gpu: str = "h100-sxm", gpus_per_node: int = 8, inter: str = "ib-ndr", radix: int = 64,
                  oversubscription: float = 1.0, price_per_gpu_hour: float = DEFAULT_PRICE_PER_GPU_HOUR,
                  checkpoint_cost_s: float = 60.0) -> dict[str, Any]:
    """The numbers of a design report for ``model`` on ``gpus`` GPUs: the fabric (one NIC per GPU),
    the planner's best layout and its MFU, its error ``band`` (the search row's) and the days it spans
    (``days_band``, None where the validation does not cover the plan), and the run's days, GPU-hours,
    cost, energy, failures per day, checkpoint interval and goodput."""
    cl = cluster(gpu, gpus // gpus_per_node, gpus_per_node, inter=inter)
    tree = fat_tree(gpus, radix, cl.inter.bandwidth, oversubscription)
    r = search(model, cl, global_batch, options=StepOptions(oversubscription=oversubscription), top=1)
    if not r.configs:
        raise ValueError(r.why)
    best = r.configs[0]
    plan = training_plan(tokens=tokens, tokens_per_step=global_batch * model.seq, step_time=best["step_time_s"],
                         gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, price_per_gpu_hour=price_per_gpu_hour,
                         checkpoint_cost_s=checkpoint_cost_s)
    band = best["band"]["step_time_s"]  # days scale with the step time: the same band (dtlib.plan.uncertainty)
    days_band = (plan.days * band["low"] / best["step_time_s"], plan.days * band["high"] / best["step_time_s"]) \
        if band["covered"] else None
    return {"tiers": tree.tiers, "switches": tree.switches, "links": tree.links,
            "bisection_tbps": tree.bisection_bandwidth * 8 / 1e12, "layout": _short(best),
            "step_time_s": best["step_time_s"], "mfu": best["mfu"], "tokens_per_s": best["tokens_per_s"],
            "band": best["band"], "days": plan.days, "days_band": days_band, "gpu_hours": plan.gpu_hours,
            "cost_usd": plan.cost_usd,
            "energy_mwh": plan.energy_mwh, "failures_per_day": 24 / plan.job_mtbf_hours,
            "checkpoint_interval_min": plan.checkpoint_interval_s / 60, "goodput": plan.goodput}
