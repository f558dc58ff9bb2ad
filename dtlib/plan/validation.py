"""Published training runs, the planner's prediction for each, the fit and its cross-validation.

Each :class:`PublishedRun` gives the model, the cluster, the published layout, precision and
power limit, and the published throughput, with its source and link. Knobs a source does not
state (micro-batch size, interleaving, and for Megatron-Bridge the recompute and sequence
parallelism) are left to the planner, which picks the fastest setting that fits: that is what
``dtlib plan`` does with the published flags. For every row the planner also searches the layouts
the same software could run (same recomputation, sequence parallelism and ZeRO stage as
published, no context parallelism, any tp/pp/dp/micro-batch/interleaving) and reports where the
published layout ranks.

The compute model has two global fitted numbers (:mod:`dtlib.plan.calibration`). :func:`fit`
finds them by grid search, minimising the mean over *sources* of each source's mean absolute
log error (each source weighs the same, however many rows it has); :func:`leave_one_source_out`
refits on every source but one and predicts that one. ``python -m dtlib.plan.validation``
prints both tables (``docs/plan.md``).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster, Link, cluster, get_gpu
from dtlib.analytic.presets import get_preset
from dtlib.analytic.units import GiB
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, FA2_ON_HOPPER, GEMM_EFFICIENCY
from dtlib.plan.search import search
from dtlib.plan.steptime import StepOptions

__all__ = ["PublishedRun", "PUBLISHED", "SOURCES", "METRIC_UNITS", "predict", "validation_table", "mean_absolute_error",
           "fit", "leave_one_source_out", "error_grid", "GEMM_GRID", "ATTENTION_GRID"]

_NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters "
              "Using Megatron-LM', Table 1 (A100 80GB, seq 2048, V 51200, full recomputation; "
              "TFLOP/s per GPU counted with eq. 3, i.e. hardware FLOPs) https://arxiv.org/abs/2104.04473")
_KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer "
                "Models', Table 3 (configurations: seq 2048, V 51200, tp 8, dp 1) and Table 5 (iteration "
                "time, sequence parallelism + selective recompute) https://arxiv.org/abs/2205.05198")
_BLOOM = ("BigScience 2022, 'BLOOM', engineering section (384 A100 80GB, 48 nodes, 4 x 100 Gb/s Omni-Path "
          "per node, tp 4 x pp 12 x dp 8, bf16, ZeRO-1 equivalent BF16Optimizer; 156 TFLOP/s per GPU in the "
          "fastest configuration) https://arxiv.org/abs/2211.05100, the same 156 TFLOP/s sustained per GENCI "
          "https://www.genci.fr/en/news/bloom-one-largest-open-multilingual-nlp-models-awarded-best-hpc-"
          "collaboration-hpc-wire-readers, and train/tr11-176B-ml/tr11-176B-ml.slurm (MBS 2, GBS 2048, "
          "activation checkpointing) https://github.com/bigscience-workshop/bigscience")
_TITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e at 500 W, 400 Gb/s "
          "per GPU, bf16, eager) https://github.com/pytorch/torchtitan/blob/main/benchmarks/"
          "llama3_h100_202412_torchtitan.md")
_BRIDGE = ("NVIDIA Megatron-Bridge performance summary, 25.11 NeMo container, DGX-H100 and DGX-B200, FP8-CS, seq 8192 "
           "https://github.com/NVIDIA-NeMo/Megatron-Bridge/blob/main/docs/performance-summary.md")

# torchtitan's hosts: H100 with 96 GB HBM2e and 2.4 TB/s, SXM tensor cores and SMs, run at 500 W
TITAN_H100 = replace(get_gpu("h100-sxm"), name="h100-96gb", memory_bytes=96 * GiB,
                     memory_bandwidth=2.4e12, source=_TITAN + ": hardware section")
# Jean Zay's A100 nodes: 4 Omni-Path 100 Gb/s links per node of 8 GPUs (BLOOM Sec. 3.4)
OMNI_PATH = Link("omni-path-100", 12.5e9, 14e-6, "Intel Omni-Path 100 Gb/s per link; NCCL Net latency")


# the unit each published metric is quoted in (every row of the table carries its own)
METRIC_UNITS = {"hardware_tflops_per_gpu": "TFLOP/s/GPU", "step_time_s": "s/step",
                "tokens_per_gpu_s": "tokens/s/GPU"}


@dataclass(frozen=True)
class PublishedRun:
    """One published run: ``metric`` is ``"hardware_tflops_per_gpu"``, ``"step_time_s"`` or
    ``"tokens_per_gpu_s"``; ``layout`` the published knobs (:data:`dtlib.plan.search.FIXABLE`);
    ``source`` the short name cross-validation leaves out; ``reference`` the citation and link;
    ``dtype`` the matmul precision; ``power_limit_w`` the GPUs' power cap (None: TDP);
    ``fused_elementwise`` False for eager PyTorch; ``attention_scale`` the attention kernel's
    utilization relative to FlashAttention-3 class kernels (:data:`FA2_ON_HOPPER` for PyTorch
    SDPA's FlashAttention-2 on H100); ``tp_overlap`` the TP communication the software hides."""
    name: str
    model: TransformerConfig
    cluster: Cluster
    global_batch: int
    layout: dict[str, Any]
    metric: str
    published: float
    family: str
    source: str
    reference: str
    dropout: bool = True
    flash_attention: bool = False
    dtype: str = "bf16"
    power_limit_w: float | None = None
    fused_elementwise: bool = True
    attention_scale: float = 1.0
    tp_overlap: float = 0.0
    note: str = field(default="")


def _gpt(name: str, layers: int, hidden: int, heads: int, source: str) -> TransformerConfig:
    return TransformerConfig(name=name, layers=layers, hidden=hidden, heads=heads, vocab=51200,
                             seq=2048, tied_embeddings=True, source=source)


# (billions, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU) -- Table 1, in order
_TABLE1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]

# (name, heads, hidden, layers, pp, gpus, global batch, seconds per iteration) -- Tables 3 and 5
_TABLE5 = [("22B", 64, 6144, 48, 1, 8, 4, 1.10), ("175B", 96, 12288, 96, 8, 64, 64, 13.75),
           ("530B", 128, 20480, 105, 35, 280, 280, 37.83), ("1T", 160, 25600, 128, 64, 512, 512, 71.49)]

# (GPU, model, gpus, global batch, layout, tokens/s/GPU) -- the DGX-H100 and DGX-B200 Llama rows of
# the 25.11 table (FP8-CS); recompute as the recipes (llama3/llama31_workload_base_configs.py) set it;
# "FSDP 0" rows use Megatron's distributed optimizer (ZeRO-1), the recipes' optimizer default
_BRIDGE_ROWS = [
    ("h100-sxm", "llama3-8b", 8, 128, dict(tp=1, pp=1, cp=1, zero=3, virtual_stages=1, recompute="none",
                                           micro_batch_size=1), 14451),
    ("h100-sxm", "llama3-70b", 64, 128, dict(tp=4, pp=8, cp=1, zero=1, virtual_stages=5, recompute="none",
                                             sequence_parallel=1, micro_batch_size=1), 1602),
    ("h100-sxm", "llama3-405b", 1024, 512, dict(tp=8, pp=8, cp=2, zero=1, virtual_stages=8, recompute="none",
                                                sequence_parallel=1, micro_batch_size=1), 292),
    ("b200", "llama3-8b", 8, 128, dict(tp=1, pp=1, cp=1, zero=1, virtual_stages=1, recompute="none",
                                       micro_batch_size=2), 30624),
    ("b200", "llama3-405b", 128, 64, dict(tp=4, pp=8, cp=2, zero=1, virtual_stages=8, recompute="none",
                                          sequence_parallel=1, micro_batch_size=1), 661)]


def _published() -> list[PublishedRun]:
    rows = []
    megatron = dict(zero=0, sequence_parallel=0, recompute="full")  # Megatron-LM of 2021
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in _TABLE1:
        rows.append(PublishedRun(
            name=f"GPT {billions:g}B (Narayanan T1)",
            model=_gpt(f"gpt-{billions:g}b", layers, hidden, heads, _NARAYANAN),
            cluster=cluster("a100-80gb", gpus // 8, 8, "nvlink3", "ib-hdr"), global_batch=batch,
            layout=dict(megatron, tp=tp, pp=pp, dp=gpus // (tp * pp), cp=1), metric="hardware_tflops_per_gpu",
            published=tflops, family="a100", source="Narayanan 2021", reference=_NARAYANAN))
    for size, heads, hidden, layers, pp, gpus, batch, seconds in _TABLE5:
        rows.append(PublishedRun(
            name=f"GPT {size}, SP + selective (Korthikanti T5)",
            model=_gpt(f"gpt-{size.lower()}", layers, hidden, heads, _KORTHIKANTI),
            cluster=cluster("a100-80gb", max(gpus // 8, 1), 8, "nvlink3", "ib-hdr"), global_batch=batch,
            layout=dict(tp=8, pp=pp, dp=1, cp=1, zero=0, sequence_parallel=1, recompute="selective"),
            metric="step_time_s", published=seconds, family="a100", source="Korthikanti 2022",
            reference=_KORTHIKANTI))
    rows.append(PublishedRun(
        name="BLOOM 176B (BigScience)", model=get_preset("bloom-176b"),
        cluster=Cluster(get_gpu("a100-80gb"), 48, 8, cluster(intra="nvlink3").intra, OMNI_PATH, nics_per_node=4),
        global_batch=2048, layout=dict(tp=4, pp=12, dp=8, cp=1, zero=1, sequence_parallel=0, recompute="full",
                                       micro_batch_size=2),
        metric="hardware_tflops_per_gpu", published=156, family="a100", source="BLOOM 2022", reference=_BLOOM,
        dropout=False, note="vocabulary padded to 250,880 as Megatron-DeepSpeed does; dropout 0"))
    titan = dict(zero=3, sequence_parallel=0, recompute="selective", tp=1, pp=1, cp=1, micro_batch_size=2)
    for gpus, table, eager, compiled, float8 in ((8, 1, 5762, 6667, 8532), (128, 3, 5605, 6514, 8380)):
        for label, tps, fused, dtype in (("eager", eager, False, "bf16"), ("compile", compiled, True, "bf16"),
                                         ("compile + Float8", float8, True, "fp8")):
            rows.append(PublishedRun(
                name=f"Llama 3.1 8B, FSDP {gpus}, {label} (torchtitan T{table})", model=get_preset("llama3-8b"),
                cluster=Cluster(TITAN_H100, gpus // 8, 8, cluster().intra, cluster(inter="roce-400g").inter),
                global_batch=2 * gpus, layout=dict(titan, dp=gpus), metric="tokens_per_gpu_s", published=tps,
                family="h100", source="torchtitan",
                reference=_TITAN + f", Table {table}: local batch 2, selective AC, FSDP, {label}",
                dropout=False, flash_attention=True, power_limit_w=500, fused_elementwise=fused, dtype=dtype,
                attention_scale=FA2_ON_HOPPER))
    rows.append(PublishedRun(
        name="Llama 3.1 70B, FSDP 32 x TP 8, compile + Float8 (torchtitan T4)", model=get_preset("llama3-70b"),
        cluster=Cluster(TITAN_H100, 32, 8, cluster().intra, cluster(inter="roce-400g").inter),
        global_batch=512, layout=dict(dp=32, tp=8, pp=1, cp=1, zero=3, sequence_parallel=1, recompute="full",
                                      micro_batch_size=16),
        metric="tokens_per_gpu_s", published=829, family="h100", dropout=False, flash_attention=True,
        power_limit_w=500, dtype="fp8", attention_scale=FA2_ON_HOPPER, source="torchtitan",
        reference=_TITAN + ", Table 4: 2D (FSDP 32, TP 8), local batch 16, full AC, torch.compile + Float8"))
    for gpu, preset, gpus, batch, layout, tps in _BRIDGE_ROWS:
        model = get_preset(preset)
        dp = gpus // (layout["tp"] * layout["pp"] * layout["cp"])
        system = "DGX-H100" if gpu == "h100-sxm" else "DGX-B200"
        rows.append(PublishedRun(
            name=f"{model.name} FP8, {gpus} x {gpu.split('-')[0].upper()} (Megatron-Bridge 25.11)", model=model,
            cluster=cluster(gpu, gpus // 8, 8, "nvlink4" if gpu == "h100-sxm" else "nvlink5", "ib-ndr"),
            global_batch=batch, layout=dict(layout, dp=dp), metric="tokens_per_gpu_s", published=tps,
            family=gpu.split("-")[0], source="Megatron-Bridge", reference=_BRIDGE + f" ({system} table)",
            dropout=False, flash_attention=True, dtype="fp8", tp_overlap=1.0 if layout["tp"] > 1 else 0.0,
            note="recipe: no recompute except the H100 8B, which recomputes 5 of 32 layers (dtlib cannot "
                 "express it: timed with none); distributed optimizer (ZeRO-1) unless FSDP; TP communication "
                 "overlapped (Transformer Engine userbuffers)"))
    return rows


PUBLISHED: list[PublishedRun] = _published()
SOURCES: tuple[str, ...] = tuple(dict.fromkeys(r.source for r in PUBLISHED))


def _metric(config: dict[str, Any], run: PublishedRun) -> float:
    if run.metric == "tokens_per_gpu_s":
        return config["tokens_per_s"] / run.cluster.world_size
    return config[run.metric]


def _options(run: PublishedRun, gemm: float | None, attention: float | None) -> StepOptions:
    attention = ATTENTION_EFFICIENCY if attention is None else attention
    return StepOptions(dtype=run.dtype, flash_attention=run.flash_attention, power_limit_w=run.power_limit_w,
                       gemm_efficiency=GEMM_EFFICIENCY if gemm is None else gemm,
                       attention_efficiency=attention * run.attention_scale, tp_overlap=run.tp_overlap,
                       fused_elementwise=run.fused_elementwise)


def _published_layout(run: PublishedRun, options: StepOptions, fit: bool = True):
    """The planner constrained to the published flags (headroom 1: the run did fit its GPUs);
    ``fit=False`` lifts the memory limit, to time a layout dtlib's memory model rejects."""
    cl = run.cluster if fit else replace(run.cluster, gpu=replace(run.cluster.gpu, memory_bytes=2 ** 60))
    return search(run.model, cl, run.global_batch, options=options, fixed=run.layout,
                  headroom=1.0, dropout=run.dropout, top=1)


def _prediction(run: PublishedRun, gemm: float | None = None, attention: float | None = None) -> float:
    """The planner's value of the run's metric for the published layout (memory limit lifted)."""
    return _metric(_published_layout(run, _options(run, gemm, attention), fit=False).configs[0], run)


def predict(run: PublishedRun, gemm: float | None = None, attention: float | None = None,
            rank: bool = True) -> dict[str, Any]:
    """The planner on one published run: ``predicted`` (same ``metric`` and ``unit`` as ``published``),
    ``error`` (relative, signed), ``fits``, ``memory_gib``, the compute split (``gemm_s``,
    ``attention_s``), and with ``rank`` the published layout's ``rank`` among the layouts with the
    same recompute / sequence parallelism / ZeRO choice, with ``gap_to_best`` (relative step-time
    gap to the best of them)."""
    options = _options(run, gemm, attention)
    mine = _published_layout(run, options)
    fits = bool(mine.configs)
    best = (mine if fits else _published_layout(run, options, fit=False)).configs[0]
    predicted = _metric(best, run)
    out = {"name": run.name, "source": run.source, "family": run.family, "metric": run.metric,
           "unit": METRIC_UNITS[run.metric], "published": run.published,
           "predicted": predicted, "error": (predicted - run.published) / run.published, "fits": fits,
           "why": mine.why, "memory_gib": best["memory_per_gpu_bytes"] / GiB, "config": best}
    if rank:
        # none of these runs used expert parallelism; CP only where published
        same_software = {k: run.layout[k] for k in ("recompute", "sequence_parallel", "zero") if k in run.layout}
        ranked = search(run.model, run.cluster, run.global_batch, options=options,
                        fixed=same_software | {"cp": run.layout.get("cp", 1), "ep": 1},
                        headroom=1.0, dropout=run.dropout, top=10_000)
        times = [c["step_time_s"] for c in ranked.configs] or [best["step_time_s"]]
        out["rank"] = 1 + sum(t < best["step_time_s"] * (1 - 1e-9) for t in times)
        out["gap_to_best"] = best["step_time_s"] / min(times) - 1
    return out


def validation_table(gemm: float | None = None, attention: float | None = None,
                     rank: bool = True) -> list[dict[str, Any]]:
    """:func:`predict` on every row of :data:`PUBLISHED` (default: the fitted efficiencies)."""
    return [predict(run, gemm, attention, rank) for run in PUBLISHED]


def mean_absolute_error(rows: list[dict[str, Any]]) -> float:
    """Mean of |relative error| over ``rows``."""
    return float(np.mean([abs(r["error"]) for r in rows]))


GEMM_GRID = tuple(round(x, 2) for x in np.arange(0.40, 1.001, 0.05))
ATTENTION_GRID = tuple(round(x, 2) for x in np.arange(0.20, 0.801, 0.05))


def error_grid(gemm_grid: Sequence[float] = GEMM_GRID, attention_grid: Sequence[float] = ATTENTION_GRID,
               runs: Sequence[PublishedRun] | None = None) -> np.ndarray:
    """``log(predicted / published)`` for every (GEMM efficiency, attention efficiency, run):
    an array of shape (len(gemm_grid), len(attention_grid), len(runs)), computed once so that every
    fit (in-sample and each leave-one-source-out fold) is an argmin over it."""
    runs = PUBLISHED if runs is None else runs
    for name, grid in (("gemm_grid", gemm_grid), ("attention_grid", attention_grid)):
        if not len(grid) or not all(0 < g <= 1 for g in grid):
            raise ValueError(f"{name} must be a non-empty list of fractions in (0, 1], got {list(grid)!r}")
    out = np.empty((len(gemm_grid), len(attention_grid), len(runs)))
    for i, g in enumerate(gemm_grid):
        for j, a in enumerate(attention_grid):
            out[i, j] = [np.log(_prediction(r, g, a) / r.published) for r in runs]
    return out


def _objective(errors: np.ndarray, sources: Sequence[str], keep: Sequence[str]) -> np.ndarray:
    """Mean over the ``keep`` sources of each source's mean |log error|, per grid point."""
    per_source = [np.abs(errors[..., [s == k for s in sources]]).mean(axis=-1) for k in keep]
    return np.mean(per_source, axis=0)


def fit(errors: np.ndarray | None = None, *, gemm_grid: Sequence[float] = GEMM_GRID,
        attention_grid: Sequence[float] = ATTENTION_GRID, leave_out: str | None = None) -> tuple[float, float]:
    """The (GEMM, attention) efficiencies on the grid minimising the mean over sources of each
    source's mean absolute log error, on every source but ``leave_out``. Ties go to the first grid
    point (deterministic). ``errors``: :func:`error_grid` of the same grids (computed if None)."""
    errors = error_grid(gemm_grid, attention_grid) if errors is None else errors
    sources = [r.source for r in PUBLISHED]
    if leave_out is not None and leave_out not in SOURCES:
        raise ValueError(f"leave_out must be one of {SOURCES}, got {leave_out!r}")
    keep = [s for s in SOURCES if s != leave_out]
    i, j = np.unravel_index(int(np.argmin(_objective(errors, sources, keep))), errors.shape[:2])
    return float(gemm_grid[i]), float(attention_grid[j])


def leave_one_source_out(errors: np.ndarray | None = None, *, gemm_grid: Sequence[float] = GEMM_GRID,
                         attention_grid: Sequence[float] = ATTENTION_GRID) -> dict[str, dict[str, Any]]:
    """For each source: the efficiencies fitted without it and the held-out mean absolute
    relative error of its runs (``loso_error``), next to the in-sample one (``in_sample_error``,
    the fit on every source)."""
    errors = error_grid(gemm_grid, attention_grid) if errors is None else errors
    sources = np.array([r.source for r in PUBLISHED])
    g_all, a_all = fit(errors, gemm_grid=gemm_grid, attention_grid=attention_grid)
    i_all, j_all = gemm_grid.index(g_all), attention_grid.index(a_all)
    out = {}
    for source in SOURCES:
        g, a = fit(errors, gemm_grid=gemm_grid, attention_grid=attention_grid, leave_out=source)
        i, j = gemm_grid.index(g), attention_grid.index(a)
        mine = sources == source
        out[source] = {"runs": int(mine.sum()), "gemm": g, "attention": a,
                       "loso_error": float(np.mean(np.abs(np.expm1(errors[i, j, mine])))),
                       "in_sample_error": float(np.mean(np.abs(np.expm1(errors[i_all, j_all, mine]))))}
    return out


def _num(x: float) -> str:
    """A table number: thousands with separators, smaller ones with 4 significant digits."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _markdown(rows: list[dict[str, Any]], loso: dict[str, dict[str, Any]] | None) -> str:
    unit = METRIC_UNITS
    by_name = {r.name: r for r in PUBLISHED}
    lines = ["| run | GPUs | published layout | metric | published | predicted | error | GEMM s | attention s "
             "| fits (GiB/GPU) | rank | gap to best |", "|---" * 12 + "|"]
    for r in rows:
        run, c = by_name[r["name"]], r["config"]
        layout = (f"tp {c['tp']} pp {c['pp']} cp {c['cp']} dp {c['dp']}, {c['recompute']}"
                  f"{', SP' if c['sequence_parallel'] else ''}{', ZeRO ' + str(c['zero']) if c['zero'] else ''}"
                  f", {run.dtype}{', ' + str(int(run.power_limit_w)) + ' W' if run.power_limit_w else ''}"
                  f" (mb {c['micro_batch']}, v {c['virtual_stages']})")
        lines.append(f"| {r['name']} | {run.cluster.world_size:,} x {run.family.upper()} | {layout} | "
                     f"{unit[run.metric]} | {_num(r['published'])} | {_num(r['predicted'])} | "
                     f"{100 * r['error']:+.1f}% | "
                     f"{c['compute_split']['gemm']:.3g} | {c['compute_split']['attention']:.3g} | "
                     f"{'yes' if r['fits'] else 'NO'} ({r['memory_gib']:.1f}) | {r.get('rank', '-')} | "
                     f"{100 * r.get('gap_to_best', 0):.1f}% |")
    lines.append("")
    lines.append(f"In-sample mean absolute error over the {len(rows)} runs: {100 * mean_absolute_error(rows):.1f}%")
    if loso:
        lines += ["", "| held-out source | runs | GEMM eff. fitted without it | attention eff. | in-sample error "
                  "| leave-one-source-out error |", "|---|---|---|---|---|---|"]
        for s, d in loso.items():
            lines.append(f"| {s} | {d['runs']} | {d['gemm']:.2f} | {d['attention']:.2f} | "
                         f"{100 * d['in_sample_error']:.1f}% | {100 * d['loso_error']:.1f}% |")
        mean_in = np.mean([d["in_sample_error"] for d in loso.values()])
        mean_out = np.mean([d["loso_error"] for d in loso.values()])
        lines.append(f"| **mean over sources** | {len(PUBLISHED)} | | | {100 * mean_in:.1f}% | {100 * mean_out:.1f}% |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dtlib.plan.validation [--no-loso] [--no-rank]``: the tables of ``docs/plan.md``."""
    ap = argparse.ArgumentParser(description="the planner against published runs: fit, table, LOSO")
    ap.add_argument("--no-loso", action="store_true", help="skip the grid (the slow part)")
    ap.add_argument("--no-rank", action="store_true", help="skip ranking the published layouts")
    args = ap.parse_args(argv)
    loso = None
    if not args.no_loso:
        errors = error_grid()
        g, a = fit(errors)
        print(f"fitted on all sources: GEMM efficiency {g:.2f}, attention efficiency {a:.2f} "
              f"(defaults in dtlib.plan.calibration: {GEMM_EFFICIENCY:.2f}, {ATTENTION_EFFICIENCY:.2f})\n")
        loso = leave_one_source_out(errors)
    rows = validation_table(rank=not args.no_rank)
    print(_markdown(rows, loso))


if __name__ == "__main__":
    main()
