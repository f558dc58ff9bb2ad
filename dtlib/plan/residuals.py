"""The held-out residual table behind every prediction's band (:mod:`dtlib.plan.uncertainty`).

For every published run (:data:`dtlib.plan.published.PUBLISHED`) the model is fitted without the run's
source (:func:`dtlib.plan.validation.fit` with ``leave_out``, on one :func:`~dtlib.plan.validation.error_grid`)
and predicts the run; the residual is ``log(published step time / predicted step time)``: the grid's
``log(predicted / published)`` of a throughput metric, its negative for a metric in seconds per step.
Each row carries the run's regime (stack, GPU family, dense/MoE, work per GPU, matmul dtype, fine-tuning).

``python -m dtlib.plan.residuals --write`` regenerates ``dtlib/plan/data/residuals.json`` (a few seconds
of CPU; rerun it after any change to the step-time model or to the published runs);
``--check`` exits 1 when the stored table differs from what the model computes now
(``tests/test_uncertainty.py`` checks the same); ``--table`` prints the residuals by regime
(``docs/validation.md``, "The error band").
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from dtlib.plan.published import PUBLISHED
from dtlib.plan.uncertainty import (LEVELS, METHODS, RESIDUALS_PATH, Regime, band, gpu_family, load_residuals,
                                    work_per_gpu)
from dtlib.plan.validation import ATTENTION_GRID, GEMM_GRID, error_grid, fit

__all__ = ["residual_rows", "write", "differences", "band_coverage", "markdown"]

COMMAND = "python -m dtlib.plan.residuals --write"


def residual_rows(errors: np.ndarray | None = None) -> list[dict[str, Any]]:
    """One dict per published run: ``name``, ``source``, ``stack``, ``gpu``, ``family``, ``moe``, ``dtype``,
    ``finetune``, ``work`` (:func:`~dtlib.plan.uncertainty.work_per_gpu`), the efficiencies fitted without its source
    (``gemm``, ``attention``) and the held-out ``residual``. ``errors``: :func:`error_grid` (computed if None)."""
    errors = error_grid() if errors is None else errors
    folds = {}
    rows = []
    for r, run in enumerate(PUBLISHED):
        if run.source not in folds:
            folds[run.source] = fit(errors, leave_out=run.source)
        g, a = folds[run.source]
        error = float(errors[GEMM_GRID.index(g), ATTENTION_GRID.index(a), r])
        rows.append({"name": run.name, "source": run.source, "stack": run.stack, "gpu": run.cluster.gpu.name,
                     "family": gpu_family(run.cluster.gpu.name), "moe": run.model.moe_experts > 0,
                     "dtype": run.dtype, "finetune": run.finetune,
                     "work": work_per_gpu(run.model, run.global_batch, run.cluster.world_size),
                     "gemm": g, "attention": a, "residual": -error if run.metric == "step_time_s" else error})
    return rows


def write(path: str | Path = RESIDUALS_PATH, rows: list[dict[str, Any]] | None = None) -> Path:
    """Write the table (:func:`residual_rows`) as JSON to ``path``."""
    rows = residual_rows() if rows is None else rows
    doc = {"generated_by": COMMAND, "residual": "log(published step time / predicted step time), each run predicted "
           "by the model fitted without its source (docs/validation.md, 'The error band')", "rows": rows}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    load_residuals.cache_clear()
    return path


def differences(stored: Sequence[dict[str, Any]], now: Sequence[dict[str, Any]], tol: float = 1e-9) -> list[str]:
    """What differs between two tables: a run missing from one, or a field (numbers beyond ``tol``)."""
    old, new = {r["name"]: r for r in stored}, {r["name"]: r for r in now}
    out = [f"{name}: only in {'the stored table' if name in old else 'the model now'}" for name in sorted(set(old) ^ set(new))]
    for name in sorted(set(old) & set(new)):
        for key in sorted(set(old[name]) | set(new[name])):
            a, b = old[name].get(key), new[name].get(key)
            same = (abs(a - b) <= tol * max(1.0, abs(a), abs(b)) if isinstance(a, float) and isinstance(b, float)
                    else a == b)
            if not same:
                out.append(f"{name}: {key} stored {a!r}, now {b!r}")
    return out


def band_coverage(rows: Sequence[dict[str, Any]], **options: Any) -> dict[str, Any]:
    """How often the band holds what it claims, held out by source: each run's band is taken from the
    runs of the *other* sources (:func:`~dtlib.plan.uncertainty.band` with ``options``); ``inside`` of
    the ``covered`` runs fall in it, ``uncovered`` get no band once their source is out."""
    inside = covered = 0
    for r in rows:
        regime = Regime(r["stack"], r["family"], r["moe"], r["work"], r["dtype"], r["finetune"])
        b = band(regime, [o for o in rows if o["source"] != r["source"]], **options)
        if b.covered:
            covered += 1
            inside += int(b.low <= math.exp(r["residual"]) <= b.high)  # as factors: exp(quantile) is exact at a run
    return {"inside": inside, "covered": covered, "uncovered": len(rows) - covered}


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The stored residuals by regime (:data:`~dtlib.plan.uncertainty.LEVELS` 2-4) as a markdown table:
    runs, 10th and 90th percentiles and the extremes of ``published / predicted step time - 1``."""
    lines = ["| regime | runs | 10th percentile | 90th percentile | min | max |", "|---|---|---|---|---|---|"]
    for keys in LEVELS[1:]:
        groups: dict[tuple, list[float]] = {}
        for r in rows:
            groups.setdefault(tuple(r[k] for k in keys), []).append(r["residual"])
        for group, residuals in sorted(groups.items(), key=lambda g: (-len(g[1]), str(g[0]))):
            words = ", ".join("MoE" if v is True else "dense" if v is False else str(v) for v in group)
            lo, hi = np.quantile(residuals, [0.1, 0.9])
            cells = [f"{100 * np.expm1(x):+.0f}%" for x in (lo, hi, min(residuals), max(residuals))]
            lines.append(f"| {words} | {len(residuals)} | " + " | ".join(cells) + " |")
    lines.append("")
    for method in METHODS:
        c = band_coverage(rows, method=method)
        lines.append(f"Band by {method}, each run's from the other sources' runs: {c['inside']} of the {c['covered']} "
                     f"runs it covers inside ({100 * c['inside'] / c['covered']:.0f}%), {c['uncovered']} not covered.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dtlib.plan.residuals --write | --check | --table``."""
    ap = argparse.ArgumentParser(description="the held-out residual table behind the planner's error bands")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help=f"regenerate {RESIDUALS_PATH.name}")
    mode.add_argument("--check", action="store_true", help="exit 1 if the stored table is stale")
    mode.add_argument("--table", action="store_true", help="print the stored residuals by regime (markdown)")
    args = ap.parse_args(argv)
    if args.table:
        print(markdown(load_residuals()))
        return 0
    rows = residual_rows()
    if args.write:
        print(f"wrote {len(rows)} runs to {write(rows=rows)}")
        return 0
    diff = differences(load_residuals(), rows)
    for line in diff[:20]:
        print(line, file=sys.stderr)
    print(f"{RESIDUALS_PATH.name}: {'stale, ' + str(len(diff)) + ' differences; run ' + COMMAND if diff else 'up to date'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
