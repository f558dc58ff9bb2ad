"""Search every valid layout of a model on a cluster and rank them by step time (equal global batch).

The candidates are the product of a few options per knob (tensor, pipeline, context, expert and
expert-tensor sizes, micro-batch size, virtual stages, ZeRO stage, sequence parallelism;
recomputation and schedule are categorical, so one vectorised pass runs per pair). For an MoE
model ``ep`` runs over the divisors of the expert count and ``etp`` over those of the node size
that divide the expert FFN width, kept where ``ep x etp`` divides ``tp x cp x dp`` (Megatron-Core's
expert grid, :mod:`dtlib.plan.moe`), sequence-parallel whenever ``tp > 1`` (Megatron-Core's
``MoELayer`` refuses TP without it). ``dp`` and the number of
micro-batches follow from the GPU count and the global batch. Each candidate must pass
:data:`dtlib.analytic.layout.RULES` (through :func:`dtlib.analytic.vectorised.layout_arrays`) and
fit in ``headroom`` x the GPU's memory by :func:`dtlib.analytic.memory.per_gpu_bytes`; tensor
parallelism stays inside a node unless ``tp_within_node=False``. GPipe is not searched: it has
1F1B's bubble with more activations in flight (Narayanan et al. 2021, Sec. 2.2).

Everything runs on numpy arrays: the whole search for a 10B model on 10,000 GPUs is one pass per
(schedule, recompute) pair; ``benchmarks/bench_plan_search.py`` times it and DeepSeek-V3's on 2,048
GPUs against the issue's budgets (1 s and 5 s).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster
from dtlib.analytic.layout import RECOMPUTE, RECOMPUTE_OPTIONS, SCHEDULES, Parallelism, pipeline_split
from dtlib.analytic.stages import distinct_rows
from dtlib.analytic.memory import per_gpu_bytes
from dtlib.analytic.precision import get_precision
from dtlib.analytic.units import GiB
from dtlib.analytic.vectorised import layout_arrays
from dtlib.analytic.finetune import FineTuning
from dtlib.analytic.pipeline_layout import PipelineLayout, check_alone, layout_numbers
from dtlib.plan.steptime import (TERMS, StepOptions, memory_kwargs, resolve, step_time_arrays, with_finetune,
                                 with_packing)
from dtlib.plan.uncertainty import BandOf, band, band_fields, regime_of

__all__ = ["SearchResult", "search", "FIXABLE", "GIVEN_OPTIONS", "SPLIT", "MICRO_BATCHES", "VIRTUAL_STAGES"]

MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
CONTEXT_SIZES = (1, 2, 4, 8)
# knobs a caller may pin (the command line's layout flags); the rest are searched
FIXABLE = ("dp", "tp", "pp", "cp", "ep", "etp", "virtual_stages", "micro_batch_size", "zero", "recompute", "schedule",
           "sequence_parallel", "recompute_layers", "account_for_embedding_and_loss", "activation_offload_layers",
           "offload", "recompute_modules", "first_stage_layers", "last_stage_layers", "pipeline_layout")
# the pipeline split: given, or chosen per (pp, virtual_stages) by dtlib.analytic.layout.pipeline_split
SPLIT = ("first_stage_layers", "last_stage_layers", "pipeline_layout")
# GIVEN_OPTIONS: the layout options the search never varies, only takes as given (from ``fixed``,
# else these defaults, Parallelism's): each candidate row carries them unchanged, so callers that
# compare rows by their searched knobs leave these out (dtlib.plan.validation). Offload moves
# optimizer/parameter shards to CPU memory; the step time does not time CPU Adam.
GIVEN_OPTIONS = {"recompute_layers": None, "account_for_embedding_and_loss": False, "activation_offload_layers": None,
                 "offload": "none", "recompute_modules": ()}


@dataclass
class SearchResult:
    """The ``configs`` that fit, fastest first (at most ``top``), how many valid layouts were
    ``searched`` and how many ``fitting`` (each x the recompute options), the search's wall-clock
    ``seconds``, ``why`` when nothing fits (or nothing is valid), and ``candidates``: the layouts
    of the grid that divide the GPUs and the global batch, before the model's rules."""
    configs: list[dict[str, Any]]
    searched: int
    fitting: int
    seconds: float
    capacity: float
    why: str | None = None
    notes: list[str] = field(default_factory=list)
    candidates: int = 0


def _grid(cfg: TransformerConfig, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
          tp_within_node: bool, interleaved: bool, balanced: bool = False) -> dict[str, np.ndarray]:
    """The candidate product for one schedule, as flat integer arrays.

    The model-parallel sizes are combined and filtered first (they must divide the GPUs; ``ep x
    etp`` must divide the ``tp x cp x dp`` ranks of a stage, Megatron-Core's expert grid), then
    crossed with the batch and memory knobs, so the product stays small for a 2,048-GPU MoE."""
    gpus, g = cluster.world_size, cluster.gpus_per_node
    within = validate.divisors_of(g) if tp_within_node else validate.divisors_of(gpus)
    moe = cfg.moe_experts > 0
    parallel = {
        "tp": within,
        "pp": [p for p in validate.divisors_of(gpus) if p <= cfg.layers],
        "cp": [c for c in CONTEXT_SIZES if gpus % c == 0],
        "ep": validate.divisors_of(cfg.moe_experts) if moe else [1],
        # expert tensor parallelism (Megatron-Core --expert-tensor-parallel-size) inside a node
        "etp": [t for t in validate.divisors_of(g) if cfg.moe_ffn % t == 0] if moe else [1],
    }
    batch = {
        "micro_batch_size": list(MICRO_BATCHES),
        "virtual_stages": list(VIRTUAL_STAGES) if interleaved else [1],
        "zero": [0, 1, 2, 3],
        "sequence_parallel": [0, 1],
    }
    for options in (parallel, batch):
        for name, value in fixed.items():
            if name in options:
                options[name] = [int(value)]
    a = _product(parallel)
    model_parallel = a["tp"] * a["pp"] * a["cp"]
    keep = gpus % model_parallel == 0
    dp = np.where(keep, gpus // np.maximum(model_parallel, 1), 1)
    keep &= (dp * a["tp"] * a["cp"]) % (a["ep"] * a["etp"]) == 0
    if "dp" in fixed:
        keep &= dp == fixed["dp"]
    a = {k: v[keep] for k, v in a.items()}
    a["dp"] = dp[keep]
    rest = _product(batch)
    a = {k: np.repeat(v, len(rest["zero"])) for k, v in a.items()} | \
        {k: np.tile(v, len(a["dp"])) for k, v in rest.items()}
    keep = global_batch % (a["dp"] * a["micro_batch_size"]) == 0
    keep &= (a["tp"] > 1) | (a["sequence_parallel"] == 0)   # SP means nothing without TP
    if moe:  # Megatron-Core's MoELayer runs with TP only sequence-parallel (it raises otherwise)
        keep &= (a["tp"] == 1) | (a["sequence_parallel"] == 1)
    a = {k: v[keep] for k, v in a.items()}
    a["num_microbatches"] = global_batch // (a["dp"] * a["micro_batch_size"])
    a["gpus"] = np.full(a["dp"].shape, gpus)
    return _with_split(a, cfg.layers, fixed, balanced)


def _with_split(a: dict[str, np.ndarray], layers: int, fixed: dict[str, Any], balanced: bool) -> dict[str, np.ndarray]:
    """``a`` with the pipeline split of every row: the pinned one, else the planner's
    (:func:`~dtlib.analytic.layout.pipeline_split`; rows without a valid split are dropped), so
    every layout searched is one Megatron-LM builds and an emitter can write."""
    if any(fixed.get(k) for k in SPLIT) or not len(a["pp"]):  # pinned, or no layout to split
        for k in SPLIT:
            a[k] = np.full(a["dp"].shape, int(fixed.get(k) or 0))
        return a
    first, row = distinct_rows([a["pp"], a["virtual_stages"]])
    splits = [pipeline_split(layers, int(a["pp"][i]), int(a["virtual_stages"][i]), balanced) for i in first]
    keep = np.array([s is not None for s in splits], dtype=bool)[row]
    a = {k: v[keep] for k, v in a.items()}
    for k in SPLIT:
        a[k] = np.array([s[k] if s else 0 for s in splits], dtype=np.int64)[row[keep]]
    return a


def _take(arrays: dict[str, Any], keep: np.ndarray) -> dict[str, Any]:
    """The rows ``keep`` of every array of ``arrays`` (None stays None)."""
    return {k: v if v is None or isinstance(v, tuple) else v[keep] for k, v in arrays.items()}


def _product(options: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Every combination of ``options``' values, one flat integer array per name."""
    cols = np.array(list(itertools.product(*options.values())), dtype=np.int64).reshape(-1, len(options))
    return dict(zip(options, cols.T))


def _explicit_layout(model: TransformerConfig, fixed: dict[str, Any]) -> PipelineLayout | None:
    """A pinned layout string (``fixed["pipeline_layout"]``), checked against the model and ``fixed["pp"]``
    (needed); it pins ``virtual_stages`` to chunks / pp and marks the split as given (2)."""
    text = fixed.get("pipeline_layout")
    if not isinstance(text, str):
        return None
    if fixed.get("pp") is None:
        raise validate.InvalidArgument("pp", "given with a pipeline layout string (its chunks are pp x "
                                             "virtual_stages; Megatron-LM reads it with --pipeline-model-parallel-size)", None)
    explicit = PipelineLayout(text)
    v = explicit.check(int(fixed["pp"]), model.layers, model.mtp_layers)
    check_alone(**{k: fixed.get(k) for k in ("first_stage_layers", "last_stage_layers", "account_for_embedding_and_loss")})
    if fixed.setdefault("virtual_stages", v) != v:
        raise validate.InvalidArgument("virtual_stages", f"{v} (the pipeline layout's chunks / pp)", fixed["virtual_stages"])
    fixed["pipeline_layout"] = 2
    return explicit


def _row(a: dict[str, np.ndarray], r: dict[str, np.ndarray], mem: np.ndarray, stage: np.ndarray, i: int,
         schedule: str, recompute: str, peak: float, given: dict[str, Any],
         explicit: PipelineLayout | None = None) -> dict[str, Any]:
    """One layout as the command line's JSON names it (the issue's keys: micro_batch, microbatches);
    ``memory_stage``: the pipeline rank whose memory is ``memory_per_gpu_bytes`` (the heaviest)."""
    t = float(r["step_time"][i])
    gpus = int(r["gpus"][i])
    return {"dp": int(a["dp"][i]), "tp": int(a["tp"][i]), "pp": int(a["pp"][i]), "cp": int(a["cp"][i]),
            "ep": int(a["ep"][i]), "etp": int(a["etp"][i]), "virtual_stages": int(a["virtual_stages"][i]),
            "micro_batch": int(a["micro_batch_size"][i]), "microbatches": int(a["num_microbatches"][i]),
            "zero": int(a["zero"][i]), "schedule": schedule, "recompute": recompute, **given,
            "first_stage_layers": int(a["first_stage_layers"][i]) or None,
            "last_stage_layers": int(a["last_stage_layers"][i]) or None,
            "pipeline_layout": explicit.text if explicit is not None else bool(a["pipeline_layout"][i]),
            "sequence_parallel": bool(a["sequence_parallel"][i]), "step_time_s": t,
            "tokens_per_s": float(r["tokens"][i]) / t,
            "model_tflops_per_gpu": float(r["model_flops"][i]) / (t * gpus) / 1e12,
            "hardware_tflops_per_gpu": float(r["hardware_flops"][i]) / (t * gpus) / 1e12,
            "mfu": float(r["model_flops"][i]) / (t * gpus * peak),
            "memory_per_gpu_bytes": float(mem[i]), "memory_stage": int(stage[i]),
            "breakdown": {k: float(r[k][i]) for k in TERMS},
            "compute_split": {"gemm": float(r["compute_gemm"][i]), "attention": float(r["compute_attention"][i])}}


def to_layout(config: dict[str, Any]) -> Parallelism:
    """The :class:`Parallelism` of one row of :attr:`SearchResult.configs`."""
    return Parallelism(dp=config["dp"], tp=config["tp"], pp=config["pp"], cp=config["cp"], ep=config["ep"],
                       etp=config.get("etp", 1),
                       zero=config["zero"], sequence_parallel=config["sequence_parallel"],
                       schedule=config.get("schedule", "interleaved" if config["virtual_stages"] > 1 else "1f1b"),
                       virtual_stages=config["virtual_stages"], micro_batch_size=config["micro_batch"],
                       num_microbatches=config["microbatches"], recompute=config["recompute"],
                       first_stage_layers=config.get("first_stage_layers"),
                       last_stage_layers=config.get("last_stage_layers"),
                       pipeline_layout=config.get("pipeline_layout", False),
                       **{k: config.get(k, v) for k, v in GIVEN_OPTIONS.items()})


def search(model: TransformerConfig, cluster: Cluster, global_batch: int, *,
           options: StepOptions = StepOptions(), fixed: dict[str, Any] | None = None,
           headroom: float = 0.9, tp_within_node: bool = True, dropout: bool | None = None,
           top: int = 5, band_of: BandOf = band, finetune: FineTuning | None = None,
           packed_doc_length: int | None = None) -> SearchResult:
    """Rank every valid, fitting layout of ``model`` on ``cluster`` at ``global_batch`` sequences.

    ``fixed`` pins knobs (names in :data:`FIXABLE`; giving all of them evaluates one layout).
    ``headroom``: fraction of the GPU's memory a layout may use (the rest: CUDA context, NCCL
    buffers, fragmentation). ``options`` are filled from their stack and ``dropout`` from the
    activation convention (:func:`dtlib.plan.steptime.resolve`); memory is counted with the same
    conventions as :func:`dtlib.analytic.memory.memory_per_gpu` (:func:`dtlib.plan.steptime.memory_kwargs`).
    Each row's ``band`` is its step time's and throughput's error band (:mod:`dtlib.plan.uncertainty`)
    from ``band_of`` of the job's regime (default: the held-out residuals of comparable published runs).
    ``finetune``: full (default) or LoRA fine-tuning (:mod:`dtlib.analytic.finetune`), in memory and time alike.
    ``packed_doc_length``: sequences packed from documents of that many tokens (1..seq; None: not packed),
    attention timed within each (:func:`dtlib.plan.steptime.with_packing`; memory does not change: no s x s
    scores are kept with FlashAttention, and an explicit mask computes them whole).
    """
    start = time.perf_counter()
    if not isinstance(model, TransformerConfig):
        raise ValueError(f"model must be a TransformerConfig, got {model!r}")
    validate.integer("global_batch", global_batch)
    validate.number("headroom", headroom, maximum=1)
    validate.integer("top", top)
    fixed = dict(fixed or {})
    unknown = set(fixed) - set(FIXABLE)
    if unknown:
        raise ValueError(f"cannot fix {sorted(unknown)}; fixable: {', '.join(FIXABLE)}")
    options, dropout = resolve(options, dropout)
    explicit = _explicit_layout(model, fixed)
    given = {k: fixed.pop(k, v) for k, v in GIVEN_OPTIONS.items()}
    checked = Parallelism(zero=fixed.get("zero", 3), **given)  # checks the given options (ranges, types)
    given["recompute_modules"] = checked.recompute_modules
    prec = get_precision(options.precision)
    capacity = headroom * cluster.gpu.memory_bytes
    peak = cluster.gpu.peak("bf16")
    recomputes = [fixed.pop("recompute")] if "recompute" in fixed else list(RECOMPUTE)
    for r in recomputes:
        if r not in RECOMPUTE_OPTIONS:
            raise ValueError(f"recompute must be one of {RECOMPUTE_OPTIONS}, got {r!r}")
        if r == "full" and (given["recompute_layers"] is not None or given["recompute_modules"]):
            Parallelism(recompute=r, recompute_layers=given["recompute_layers"],
                        recompute_modules=given["recompute_modules"])  # says why not
    v = fixed.get("virtual_stages")
    schedules = ["1f1b"] if v == 1 else ["interleaved"] if v is not None else ["1f1b", "interleaved"]
    if "schedule" in fixed:  # gpipe, DualPipe(V) only when asked for: the search proposes 1F1B or interleaving
        schedules = [validate.one_of("schedule", fixed.pop("schedule"), SCHEDULES)]
    rows: list[tuple[float, float, dict[str, Any]]] = []
    searched = fitting = candidates = 0
    smallest: tuple[float, dict[str, Any]] | None = None
    broken: str | None = None  # the rule a pinned layout breaks, if every candidate breaks one
    for schedule in schedules:
        balanced = given["account_for_embedding_and_loss"]
        grid = _grid(model, cluster, global_batch, fixed, tp_within_node, schedule in ("interleaved", "dualpipev"),
                     balanced)
        candidates += grid["dp"].size
        if grid["dp"].size == 0:
            continue
        n, valid = layout_arrays(model, grid, schedule, given["offload"], on_invalid="nan", balanced=balanced)
        if not valid.any():
            try:
                layout_arrays(model, {k: v[:1] for k, v in grid.items()}, schedule, given["offload"],
                              on_invalid="raise", balanced=balanced)
            except ValueError as exc:
                broken = broken or str(exc).split(": ", 1)[-1]
            continue
        # only valid layouts go on: the formulas are never evaluated on the placeholder rows
        n, grid = _take(n, valid), _take(grid, valid)
        n = dict(with_packing(with_finetune(n, finetune, model), packed_doc_length), **layout_numbers(explicit))
        for recompute in recomputes:
            if recompute == "full" and (given["recompute_layers"] is not None or given["recompute_modules"]):
                continue  # partial and per-module recompute describe the other recompute settings
            held = per_gpu_bytes(n, prec, recompute=recompute, schedule=schedule, **given,
                                 **memory_kwargs(options, dropout))
            mem, stage = held["total"], held["stage"]
            fits = mem <= capacity
            searched += int(mem.size)
            fitting += int(fits.sum())
            i = int(np.argmin(mem))
            if smallest is None or mem[i] < smallest[0]:
                smallest = (float(mem[i]), {k: int(x[i]) for k, x in grid.items()} | {"recompute": recompute})
            if not fits.any():
                continue
            # step times of the fitting layouts only
            here, mem_here, stage_here = _take(grid, fits), mem[fits], np.broadcast_to(stage, mem.shape)[fits]
            t = step_time_arrays(_take(n, fits), cluster, recompute=recompute, schedule=schedule,
                                 options=options, dropout=dropout, recompute_layers=given["recompute_layers"],
                                 recompute_modules=given["recompute_modules"],
                                 account_for_embedding_and_loss=given["account_for_embedding_and_loss"])
            times = t["step_time"]
            # fastest first, equal times by memory (as the rows below): a top-1 search must pick
            # the same layout as the first of a top-5 one
            best = np.lexsort((mem_here, times))[:top]
            rows += [(float(times[i]), float(mem_here[i]),
                      _row(here, t, mem_here, stage_here, int(i), schedule, recompute, peak, given, explicit))
                     for i in best]
    rows.sort(key=lambda x: x[:2])  # fastest first; among equals, the one with memory to spare
    configs = [row for *_, row in rows[:top]]
    if configs:  # the regime is the job's (stack, GPUs, model, work per GPU): one band for every layout
        error = band_of(regime_of(model, cluster, global_batch, options, (finetune or FineTuning()).method))
        for c in configs:
            c["band"] = band_fields(error, c["step_time_s"], c["tokens_per_s"])
    why = None if configs else _why_not(model, cluster, global_batch, fixed, smallest, capacity, headroom,
                                        broken)
    return SearchResult(configs=configs, searched=searched, fitting=fitting,
                        seconds=time.perf_counter() - start, capacity=capacity, why=why,
                        candidates=candidates)


def _why_not(model: TransformerConfig, cluster: Cluster, global_batch: int, fixed: dict[str, Any],
             smallest: tuple[float, dict[str, Any]] | None, capacity: float, headroom: float,
             broken: str | None) -> str:
    """One paragraph: no valid layout at all (and the rule in the way), or the smallest memory
    found and what would make it fit."""
    if smallest is None:
        pinned = ", ".join(f"{k}={v}" for k, v in fixed.items()) or "none"
        gpus = cluster.world_size
        pinned_mp = fixed.get("tp", 1) * fixed.get("pp", 1) * fixed.get("cp", 1)
        ep, etp = fixed.get("ep", 1), fixed.get("etp", 1)
        stage = gpus // fixed.get("pp", 1)
        reason = broken or (
            f"tp x pp x cp = {pinned_mp} must divide the {gpus} GPUs" if gpus % pinned_mp else
            f"ep x etp = {ep}x{etp} must divide the {stage} GPUs of a pipeline stage (tp x cp x dp; "
            f"Megatron-Core's expert grid)" if stage % (ep * etp) else
            f"the global batch {global_batch} must be a multiple of dp x micro-batch, with "
            f"dp = {gpus} / (tp x pp x cp)")
        return (f"no valid layout of {model.name} on {cluster.world_size} GPUs at global batch "
                f"{global_batch} (pinned: {pinned}): {reason}")
    nbytes, layout = smallest
    used = ", ".join(f"{k}={layout[k]}" for k in ("dp", "tp", "pp", "cp", "zero", "micro_batch_size")) \
        + f", recompute={layout['recompute']}"
    return (f"nothing fits: the smallest memory per GPU found is {nbytes / GiB:.1f} GiB ({used}) but "
            f"{headroom:g} x {cluster.gpu.memory_bytes / GiB:.0f} GiB = {capacity / GiB:.1f} GiB is "
            f"available on a {cluster.gpu.name}; use more GPUs (more pipeline or tensor parallelism), "
            f"a GPU with more memory, a shorter sequence, or unpin the layout flags "
            f"(ZeRO-3 and full recompute shrink memory most)")
