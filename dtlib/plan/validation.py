"""Published training runs, and the planner's prediction for each (the table in ``docs/plan.md``).

Each :class:`PublishedRun` gives the model, the cluster, the published layout and the published
throughput, with its source. Knobs a paper does not state (micro-batch size, interleaving) are
left to the planner, which picks the fastest setting that fits: that is what ``dtlib plan`` does
with the published flags. For every row the planner also searches the layouts the same software
could run (same recomputation, sequence parallelism and ZeRO stage as published, no context
parallelism, any tp/pp/dp/micro-batch/interleaving) and reports where the published layout ranks.

The achievable fraction of peak is fitted once per device family (:func:`calibrate`, the mean
absolute error minimised over a grid of 0.01) on these rows only; :mod:`dtlib.plan.calibration`
holds the rounded result.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster, cluster, get_gpu
from dtlib.analytic.presets import get_preset
from dtlib.analytic.units import GiB
from dtlib.plan.calibration import A100_FRACTION, H100_FRACTION
from dtlib.plan.search import search
from dtlib.plan.steptime import StepOptions

__all__ = ["PublishedRun", "PUBLISHED", "predict", "validation_table", "calibrate", "mean_absolute_error",
           "FAMILY_FRACTION"]

FAMILY_FRACTION = {"a100": A100_FRACTION, "h100": H100_FRACTION}

_NARAYANAN = ("Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters "
              "Using Megatron-LM', Table 1 (A100 80GB, seq 2048, V 51200, full recomputation; "
              "TFLOP/s per GPU counted with eq. 3, i.e. hardware FLOPs)")
_KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer "
                "Models', Table 5, 22B row: sequence parallelism + selective recompute, 1.10 s per "
                "step, MFU 41.5%")
_TITAN = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e at 500 W, 400 Gb/s "
          "per GPU, bf16, eager)")

# torchtitan's hosts: H100 with 96 GB HBM2e and 2.4 TB/s; the peak of the SXM part (their note:
# the real peak lies between SXM and NVL, unknown) -- the calibration absorbs the difference.
TITAN_H100 = replace(get_gpu("h100-sxm"), name="h100-96gb-500w", memory_bytes=96 * GiB,
                     memory_bandwidth=2.4e12, source=_TITAN + ": hardware section")


@dataclass(frozen=True)
class PublishedRun:
    """One published run: ``metric`` is ``"hardware_tflops_per_gpu"``, ``"step_time_s"`` or
    ``"tokens_per_gpu_s"``; ``layout`` the published knobs (:data:`dtlib.plan.search.FIXABLE`)."""
    name: str
    model: TransformerConfig
    cluster: Cluster
    global_batch: int
    layout: dict[str, Any]
    metric: str
    published: float
    family: str
    source: str
    dropout: bool = True
    flash_attention: bool = False


def _gpt(name: str, layers: int, hidden: int, heads: int) -> TransformerConfig:
    return TransformerConfig(name=name, layers=layers, hidden=hidden, heads=heads, vocab=51200,
                             seq=2048, tied_embeddings=True, source=_NARAYANAN)


# (billions, heads, hidden, layers, tp, pp, gpus, batch, TFLOP/s per GPU) -- Table 1, in order
_TABLE1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
           (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
           (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
           (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
           (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]


def _published() -> list[PublishedRun]:
    rows = []
    megatron = dict(zero=0, sequence_parallel=0, recompute="full")  # Megatron-LM of 2021
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in _TABLE1:
        rows.append(PublishedRun(
            name=f"GPT {billions:g}B (Narayanan T1)", model=_gpt(f"gpt-{billions:g}b", layers, hidden, heads),
            cluster=cluster("a100-80gb", gpus // 8, 8, "nvlink3", "ib-hdr"), global_batch=batch,
            layout=dict(megatron, tp=tp, pp=pp, dp=gpus // (tp * pp)), metric="hardware_tflops_per_gpu",
            published=tflops, family="a100", source=_NARAYANAN))
    rows.append(PublishedRun(
        name="GPT 22B, SP + selective (Korthikanti T5)", model=get_preset("megatron-22b"),
        cluster=cluster("a100-80gb", 1, 8, "nvlink3", "ib-hdr"), global_batch=4,
        layout=dict(tp=8, pp=1, dp=1, zero=0, sequence_parallel=1, recompute="selective"),
        metric="step_time_s", published=1.10, family="a100", source=_KORTHIKANTI))
    titan = dict(zero=3, sequence_parallel=0, recompute="selective", tp=1, pp=1, micro_batch_size=2)
    for gpus, tps, table in ((8, 5762, 1), (128, 5605, 3)):
        rows.append(PublishedRun(
            name=f"Llama 3.1 8B, FSDP {gpus} (torchtitan T{table})", model=get_preset("llama3-8b"),
            cluster=Cluster(TITAN_H100, gpus // 8, 8, cluster().intra, cluster(inter="roce-400g").inter),
            global_batch=2 * gpus, layout=dict(titan, dp=gpus), metric="tokens_per_gpu_s", published=tps,
            family="h100", source=_TITAN + f", Table {table}: local batch 2, selective AC, FSDP",
            dropout=False, flash_attention=True))
    rows.append(PublishedRun(
        name="Llama 3.1 70B, FSDP 32 x TP 8 (torchtitan)", model=get_preset("llama3-70b"),
        cluster=Cluster(TITAN_H100, 32, 8, cluster().intra, cluster(inter="roce-400g").inter),
        global_batch=512, layout=dict(dp=32, tp=8, pp=1, zero=3, sequence_parallel=1, recompute="full",
                                      micro_batch_size=16),
        metric="tokens_per_gpu_s", published=597, family="h100", dropout=False, flash_attention=True,
        source=_TITAN + ", Table 4 layout (local batch 16, full AC); 597 tokens/s/GPU for plain "
                        "bf16 as cited by dtlib issue 15 (the current file lists 829 with "
                        "torch.compile + Float8)"))
    return rows


PUBLISHED: list[PublishedRun] = _published()


def _metric(config: dict[str, Any], run: PublishedRun) -> float:
    if run.metric == "tokens_per_gpu_s":
        return config["tokens_per_s"] / run.cluster.world_size
    return config[run.metric]


def _options(run: PublishedRun, efficiency: float | None) -> StepOptions:
    return StepOptions(efficiency=FAMILY_FRACTION[run.family] if efficiency is None else efficiency,
                       flash_attention=run.flash_attention)


def _published_layout(run: PublishedRun, options: StepOptions, fit: bool = True):
    """The planner constrained to the published flags (headroom 1: the run did fit its GPUs);
    ``fit=False`` lifts the memory limit, to time a layout dtlib's memory model rejects."""
    cl = run.cluster if fit else replace(run.cluster, gpu=replace(run.cluster.gpu, memory_bytes=2 ** 60))
    return search(run.model, cl, run.global_batch, options=options, fixed=run.layout,
                  headroom=1.0, dropout=run.dropout, top=1)


def _error(run: PublishedRun, efficiency: float) -> float:
    configs = _published_layout(run, _options(run, efficiency), fit=False).configs
    return abs(_metric(configs[0], run) - run.published) / run.published


def predict(run: PublishedRun, efficiency: float | None = None) -> dict[str, Any]:
    """The planner on one published run: ``predicted`` (same metric as ``published``),
    ``error`` (relative, signed), ``fits``, ``memory_gib``, and the published layout's ``rank``
    among the layouts with the same recompute / sequence parallelism / ZeRO choice, with
    ``gap_to_best`` (relative step-time gap to the best of them)."""
    options = _options(run, efficiency)
    mine = _published_layout(run, options)
    fits = bool(mine.configs)
    best = (mine if fits else _published_layout(run, options, fit=False)).configs[0]
    # none of these runs used context or expert parallelism
    same_software = {k: run.layout[k] for k in ("recompute", "sequence_parallel", "zero")} | {"cp": 1, "ep": 1}
    ranked = search(run.model, run.cluster, run.global_batch, options=options, fixed=same_software,
                    headroom=1.0, dropout=run.dropout, top=10_000)
    times = [c["step_time_s"] for c in ranked.configs] or [best["step_time_s"]]
    rank = 1 + sum(t < best["step_time_s"] * (1 - 1e-9) for t in times)
    predicted = _metric(best, run)
    return {"name": run.name, "published": run.published, "predicted": predicted,
            "error": (predicted - run.published) / run.published, "fits": fits, "why": mine.why,
            "memory_gib": best["memory_per_gpu_bytes"] / GiB, "rank": rank,
            "gap_to_best": best["step_time_s"] / min(times) - 1, "config": best}


def validation_table(efficiencies: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """:func:`predict` on every row of :data:`PUBLISHED` (fractions per family, default the calibrated)."""
    efficiencies = efficiencies or {}
    return [predict(run, efficiencies.get(run.family)) for run in PUBLISHED]


def mean_absolute_error(rows: list[dict[str, Any]]) -> float:
    """Mean of |relative error| over ``rows``."""
    return float(np.mean([abs(r["error"]) for r in rows]))


def calibrate(family: str, grid: np.ndarray = np.arange(0.30, 0.81, 0.01)) -> tuple[float, float]:
    """The fraction of peak on ``grid`` minimising the family's mean absolute error, and that error."""
    runs = [r for r in PUBLISHED if r.family == family]
    if not runs:
        raise ValueError(f"no published runs for family {family!r}; valid: {sorted(FAMILY_FRACTION)}")
    best = min(((float(f), float(np.mean([_error(r, float(f)) for r in runs]))) for f in grid),
               key=lambda x: x[1])
    return round(best[0], 2), best[1]
