"""An error band on every prediction: how far the planner missed comparable published runs it never saw.

Each published run of the validation (:mod:`dtlib.plan.published`) is predicted by the model fitted
without its source (leave-one-source-out, :func:`dtlib.plan.validation.leave_one_source_out`); its
signed residual is ``r = log(published step time / predicted step time)`` (> 0: the run was slower
than predicted). :mod:`dtlib.plan.residuals` computes them and stores them with each run's regime in
``dtlib/plan/data/residuals.json``; this module only reads that table.

A prediction's **regime** (:class:`Regime`) is its software stack, its GPU family
(:data:`GPU_FAMILIES`), dense or mixture-of-experts, and its work per GPU: model FLOPs per GPU per
step (tokens per GPU per step x FLOPs per token), bucketed by decade. Its band comes from the
residuals of the comparable runs, the **narrowest** of these groups holding at least ``min_runs``
runs (:data:`LEVELS`, narrowest first):

1. same stack, family, dense/MoE and decade of work per GPU;
2. same stack, family and dense/MoE;
3. same family and dense/MoE;
4. same dense/MoE, any family (the family itself must still have validated runs, and the band is
   widened to contain their own residuals where they fall outside it: a family with a few runs, AMD's
   two, keeps its misses; the regime's words say "widened to" them, or "holding" them when the pooled
   band already did).

The band is the empirical 10th and 90th percentiles of those residuals (``method="quantile"``,
``coverage=0.8``; numpy's linear interpolation, Hyndman & Fan 1996 type 7) or their minimum and
maximum (``method="range"``), widened to contain the point prediction itself
(``include_point=True``). This is split-conformal prediction's recipe, empirical quantiles of
held-out residuals (Vovk, Gammerman & Shafer 2005, *Algorithmic Learning in a Random World*, ch. 2;
Angelopoulos & Bates 2021, "A Gentle Introduction to Conformal Prediction", Sec. 1): if a new run were
exchangeable with the ``n`` comparable ones, it would fall inside their range with probability
``(n - 1) / (n + 1)``. Published runs of one source are not exchangeable with a user's job, so the band
is a *held-out residual range of comparable published runs*, not a probability guarantee.

A prediction outside what the validation covers gets ``covered=False`` and the reason instead of a
band: a GPU family without published runs (a new part), a matmul precision or a fine-tuning method
no run used, work per GPU outside the family's validated range, or a step model the fit did not
produce (``--efficiency``, fitted efficiencies overridden); ``Regime.unvalidated`` carries those
reasons; a calibrated plan may replace :func:`band` by its own function of the regime
(``search(..., band_of=...)``). Like a matmul precision, the fine-tuning method is not a level of the
groups: with published LoRA runs in the table (NeMo 24.07's on H100, Megatron-Bridge 26.06's on GB300,
GB200 and H100), a LoRA plan takes the band of its stack, family, dense/MoE and work, as a full-training
plan does (docs/validation.md, "The error band": the LoRA runs miss by as much as the SFT runs of the
same table, not more).
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.flops import step_flops
from dtlib.analytic.hardware import Cluster
from dtlib.analytic.stacks import get_stack
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY

__all__ = ["Regime", "Band", "GPU_FAMILIES", "LEVELS", "METHODS", "RESIDUALS_PATH", "gpu_family", "work_per_gpu",
           "regime_of", "band", "BandOf", "load_residuals", "band_fields", "rescale", "percent_band"]

RESIDUALS_PATH = Path(__file__).with_name("data") / "residuals.json"
# GPU name prefix -> family; a name that matches none is its own family (no validated run: not covered)
GPU_FAMILIES = {"a100": "ampere", "h100": "hopper", "h200": "hopper", "h800": "hopper", "h20": "hopper",
                "b200": "blackwell", "b300": "blackwell", "gb200": "blackwell-rack", "gb300": "blackwell-rack",
                "mi300": "amd", "mi325": "amd", "mi350": "amd", "mi355": "amd"}
# the regime keys compared, narrowest first (see the module docstring)
LEVELS = (("stack", "family", "moe", "work_decade"), ("stack", "family", "moe"), ("family", "moe"), ("moe",))
METHODS = ("quantile", "range")


def gpu_family(gpu: str) -> str:
    """The family of a GPU name (:data:`GPU_FAMILIES`, longest matching prefix), else the name itself."""
    matches = [prefix for prefix in GPU_FAMILIES if gpu.startswith(prefix)]
    return GPU_FAMILIES[max(matches, key=len)] if matches else gpu


def work_per_gpu(model: TransformerConfig, global_batch: int, gpus: int) -> float:
    """Model FLOPs per GPU per step: 3 x the forward FLOPs of ``global_batch`` sequences of ``model.seq``
    tokens (dtlib's default ``full`` attention count, :func:`dtlib.analytic.flops.step_flops`) / ``gpus``.
    It depends on the job, not on its layout."""
    validate.integer("global_batch", global_batch)
    validate.integer("gpus", gpus)
    return float(step_flops(global_batch * model.seq, **model.numbers())["model"]) / gpus


@dataclass(frozen=True)
class Regime:
    """What makes runs comparable: ``stack``, GPU ``family``, ``moe``, ``work`` (model FLOPs per GPU per
    step), ``dtype`` (matmul precision), ``finetune`` (:data:`dtlib.analytic.finetune.FINETUNE`) and
    ``unvalidated``: why the step model is not the validated one (empty when it is)."""
    stack: str
    family: str
    moe: bool
    work: float
    dtype: str = "bf16"
    finetune: str = "full"
    unvalidated: tuple[str, ...] = ()

    @property
    def work_decade(self) -> int:
        return math.floor(math.log10(self.work))


@dataclass(frozen=True)
class Band:
    """The band of a prediction as factors on the step time: the real step is ``low`` to ``high`` x the
    predicted one (None when not ``covered``, with the ``reason``); ``count`` comparable runs (their
    names: ``runs``, with the family's own where the band pooled every family), the ``regime`` they
    share (words) and the ``method``."""
    covered: bool
    low: float | None
    high: float | None
    count: int
    regime: str
    method: str
    reason: str = ""
    runs: tuple[str, ...] = field(default=(), repr=False)


# a band's source: the stored residuals (band) or, for a calibrated plan, the calibration's own fit
BandOf = Callable[[Regime], Band]


def regime_of(model: TransformerConfig, cluster: Cluster, global_batch: int, options: Any,
              finetune: str = "full") -> Regime:
    """The regime of a plan of ``model`` on ``cluster`` at ``global_batch`` with
    :class:`~dtlib.plan.steptime.StepOptions` ``options`` (its stack, dtype and efficiencies) and
    ``finetune`` (:data:`dtlib.analytic.finetune.FINETUNE`: ``full`` trains every weight, as
    pre-training; ``lora`` adapters on frozen weights, validated by the published LoRA runs)."""
    unvalidated = []
    if options.efficiency is not None:
        unvalidated.append(f"the flat compute model (efficiency {options.efficiency:g}) replaces the fitted one")
    if options.gemm_efficiency not in (None, GEMM_EFFICIENCY):
        unvalidated.append(f"GEMM efficiency {options.gemm_efficiency:g} instead of the fitted {GEMM_EFFICIENCY:g}")
    fitted = ATTENTION_EFFICIENCY * get_stack(options.stack).attention_scale(cluster.gpu)  # as the validation runs
    if options.attention_efficiency is not None and not math.isclose(options.attention_efficiency, fitted):
        unvalidated.append(f"attention efficiency {options.attention_efficiency:g} instead of the fitted "
                           f"{fitted:.3g}")
    return Regime(stack=options.stack, family=gpu_family(cluster.gpu.name), moe=model.moe_experts > 0,
                  work=work_per_gpu(model, global_batch, cluster.world_size), dtype=options.dtype,
                  finetune=finetune, unvalidated=tuple(unvalidated))


@functools.lru_cache(maxsize=4)
def load_residuals(path: str | Path = RESIDUALS_PATH) -> tuple[dict[str, Any], ...]:
    """The stored residual table (:mod:`dtlib.plan.residuals` writes it): one dict per published run;
    empty when there is none yet (the table is computed by searches that call :func:`band`)."""
    path = Path(path)
    return tuple(json.loads(path.read_text())["rows"]) if path.exists() else ()


def _words(regime: Regime, keys: Sequence[str]) -> str:
    """The regime a band was taken from, in words: ``megatron, hopper, dense, 1e15-1e16 FLOP/GPU``."""
    parts = {"stack": regime.stack, "family": regime.family, "moe": "MoE" if regime.moe else "dense",
             "work_decade": f"1e{regime.work_decade}-1e{regime.work_decade + 1} FLOP/GPU"}
    return ", ".join(parts[k] for k in keys) + ("" if "family" in keys else ", any GPU family")


def _row_key(row: dict[str, Any], key: str) -> Any:
    return math.floor(math.log10(row["work"])) if key == "work_decade" else row[key]


def band(regime: Regime, rows: Sequence[dict[str, Any]] | None = None, *, min_runs: int = 8,
         coverage: float = 0.8, method: str = "quantile", include_point: bool = True) -> Band:
    """The band of a prediction in ``regime`` from the held-out residuals ``rows`` (default: the stored
    table, :func:`load_residuals`): the narrowest group of :data:`LEVELS` with at least ``min_runs``
    runs, its ``(1 - coverage) / 2`` and ``(1 + coverage) / 2`` quantiles (``method="quantile"``) or its
    minimum and maximum (``"range"``); see the module docstring."""
    validate.integer("min_runs", min_runs)
    validate.number("coverage", coverage, maximum=1)
    validate.one_of("method", method, METHODS)
    rows = load_residuals() if rows is None else rows
    name = (f"{50 * (1 - coverage):g}th-{50 * (1 + coverage):g}th percentiles" if method == "quantile"
            else "min-max")

    def uncovered(reason: str, count: int = 0) -> Band:
        return Band(False, None, None, count, _words(regime, LEVELS[0]), name, reason)

    if not rows:
        return uncovered(f"no residual table ({RESIDUALS_PATH.name}): run python -m dtlib.plan.residuals --write")
    if regime.unvalidated:
        return uncovered("not validated: " + "; ".join(regime.unvalidated))
    family = [r for r in rows if r["family"] == regime.family]
    if not family:
        return uncovered(f"no published run on {regime.family} GPUs in the validation set")
    if regime.dtype not in {r["dtype"] for r in rows}:
        return uncovered(f"no published run with {regime.dtype} matmuls in the validation set")
    if regime.finetune not in {r["finetune"] for r in rows}:
        return uncovered(f"no published {regime.finetune} fine-tuning run in the validation set")
    low, high = min(r["work"] for r in family), max(r["work"] for r in family)
    if not low <= regime.work <= high:
        return uncovered(f"work per GPU {regime.work:.2g} FLOP per step is outside the {low:.2g}..{high:.2g} of "
                         f"the {len(family)} validated {regime.family} runs", len(family))
    for keys in LEVELS:
        mine = [r for r in rows if all(_row_key(r, k) == getattr(regime, k) for k in keys)]
        if len(mine) >= min_runs:
            break
    else:
        return uncovered(f"fewer than {min_runs} comparable runs even over every GPU family ({len(mine)})", len(mine))
    residuals = np.array([r["residual"] for r in mine])
    if method == "quantile":
        lo, hi = np.quantile(residuals, [(1 - coverage) / 2, (1 + coverage) / 2])
    else:
        lo, hi = residuals.min(), residuals.max()
    words = _words(regime, keys)
    used = mine
    if "family" not in keys:
        # pooled over every family: never narrower than the misses of the family's own few runs
        own = [r["residual"] for r in family]
        widened = min(own) < lo or max(own) > hi
        lo, hi = min(lo, min(own)), max(hi, max(own))
        runs = "run's" if len(own) == 1 else "runs'"
        words += f", {'widened to' if widened else 'holding'} the {len(own)} {regime.family} {runs} own misses"
        used = mine + [r for r in family if r not in mine]
    if include_point:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    return Band(True, math.exp(lo), math.exp(hi), len(mine), words, name,
                runs=tuple(r["name"] for r in used))


def band_fields(b: Band, step_time_s: float, tokens_per_s: float) -> dict[str, dict[str, Any]]:
    """A search row's ``band``: for ``step_time_s`` and ``tokens_per_s``, ``{low, high, count, regime,
    covered, reason, method}`` in the quantity's own unit (``low``/``high`` None when not covered)."""
    common = {"count": b.count, "regime": b.regime, "covered": b.covered, "reason": b.reason, "method": b.method}
    if not b.covered:
        return {k: {"low": None, "high": None} | common for k in ("step_time_s", "tokens_per_s")}
    return {"step_time_s": {"low": step_time_s * b.low, "high": step_time_s * b.high} | common,
            "tokens_per_s": {"low": tokens_per_s / b.high, "high": tokens_per_s / b.low} | common}


def rescale(fields: dict[str, dict[str, Any]], timed_step_s: float, step_time_s: float,
            tokens_per_s: float) -> dict[str, dict[str, Any]]:
    """A search row's ``band`` (:func:`band_fields`, of a step timed ``timed_step_s``) moved to the same
    row re-timed (``step_time_s``, ``tokens_per_s``): the same factors, whatever gave them."""
    s = fields["step_time_s"]
    if not s["covered"]:
        return fields
    b = Band(True, s["low"] / timed_step_s, s["high"] / timed_step_s, s["count"], s["regime"], s["method"])
    return band_fields(b, step_time_s, tokens_per_s)


def percent_band(band_of_quantity: dict[str, Any], value: float) -> str:
    """``-8% .. +12%, 14 runs: megatron, hopper, dense`` (or ``not covered: why``) for one quantity's band."""
    b = band_of_quantity
    if not b["covered"]:
        return f"not covered: {b['reason']}"
    return (f"{100 * (b['low'] / value - 1):+.0f}% .. {100 * (b['high'] / value - 1):+.0f}%, "
            f"{b['count']} runs: {b['regime']}")

