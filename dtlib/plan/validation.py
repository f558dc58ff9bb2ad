"""The planner against published runs (:mod:`dtlib.plan.published`): its prediction for each, the
fit of the two global efficiencies and their leave-one-source-out cross-validation.

For every row the planner times the published layout; knobs a source does not state are left to
it (it picks the fastest setting, as ``dtlib plan`` does with the published flags). Layout keys
the planner cannot pin yet (``etp``, ``recompute_layers`` until issue 26's branches land) are
reported per row as ``ignored``, never dropped silently. For every row the planner also searches
the layouts the same software could run (same recomputation, sequence parallelism and ZeRO stage
as published, no context parallelism, any tp/pp/dp/micro-batch/interleaving) and reports where
the published layout ranks.

The compute model has two global fitted numbers (:mod:`dtlib.plan.calibration`). :func:`fit`
finds them by grid search, minimising the mean over *sources* of each source's mean absolute
log error (each source weighs the same, however many rows it has); :func:`leave_one_source_out`
refits on every source but one and predicts that one. :func:`error_grid` evaluates the whole
grid with one step-time pass per row: the row's candidate layouts are enumerated once and
repeated for every grid point, the efficiencies passed as arrays (only the compute term depends
on them). ``python -m dtlib.plan.validation`` prints both tables (``docs/validation.md``).
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import replace
from typing import Any, Sequence

import numpy as np

from dtlib.analytic.units import GiB
from dtlib.analytic.vectorised import layout_arrays
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY
from dtlib.plan.published import METRIC_UNITS, PUBLISHED, SOURCES, PublishedRun
from dtlib.plan.search import FIXABLE, GIVEN_OPTIONS, SPLIT, search
from dtlib.analytic.stacks import get_stack
from dtlib.plan.steptime import StepOptions, resolve, step_time_arrays, with_finetune, with_packing

__all__ = ["PublishedRun", "PUBLISHED", "SOURCES", "METRIC_UNITS", "predict", "validation_table",
           "mean_absolute_error", "errors_by_kind", "fit", "leave_one_source_out", "error_grid", "ignored", "GEMM_GRID",
           "ATTENTION_GRID", "held_out_errors", "errors_by_family", "GOALS"]

# issue 37's goals for the held-out errors: the mean over sources, the worst source, the worst GPU family
GOALS = {"mean_over_sources": 0.08, "source": 0.15, "family": 0.12}


def _metric(config: dict[str, Any], run: PublishedRun) -> float:
    if run.metric == "tokens_per_gpu_s":
        return config["tokens_per_s"] / run.cluster.world_size
    return config[run.metric]


def _options(run: PublishedRun, gemm: Any = None, attention: Any = None) -> StepOptions:
    """The run's stack with the knobs the row overrides; ``gemm`` / ``attention``: efficiencies to
    try (None: the fitted ones), the attention one scaled by the stack's kernel on this GPU."""
    attention = ATTENTION_EFFICIENCY if attention is None else attention
    scale = get_stack(run.stack).attention_scale(run.cluster.gpu)
    return StepOptions(stack=run.stack, convention=run.convention, dtype=run.dtype,
                       flash_attention=run.flash_attention, power_limit_w=run.power_limit_w,
                       gemm_efficiency=GEMM_EFFICIENCY if gemm is None else gemm,
                       attention_efficiency=attention * scale, tp_overlap=run.tp_overlap,
                       fused_elementwise=run.fused_elementwise, precision=run.precision,
                       ep_overlap=run.ep_overlap, fp8_recipe=run.fp8_recipe or None,
                       moe_dispatcher=run.moe_dispatcher)


def _fixed(run: PublishedRun) -> dict[str, Any]:
    """The published knobs the planner can pin (:data:`dtlib.plan.search.FIXABLE`)."""
    return {k: v for k, v in run.layout.items() if k in FIXABLE}


def ignored(run: PublishedRun) -> list[str]:
    """The published knobs the planner cannot pin yet (reported in every table row)."""
    return sorted(set(run.layout) - set(FIXABLE))


def _unlimited(run: PublishedRun):
    """The run's cluster with the memory limit lifted, to time a layout dtlib's memory model rejects."""
    return replace(run.cluster, gpu=replace(run.cluster.gpu, memory_bytes=2 ** 60))


def _published_layout(run: PublishedRun, options: StepOptions, fit: bool = True, top: int = 1):
    """The planner constrained to the published flags (headroom 1: the run did fit its GPUs);
    ``fit=False`` lifts the memory limit."""
    return search(run.model, run.cluster if fit else _unlimited(run), run.global_batch, options=options,
                  fixed=_fixed(run), headroom=1.0, dropout=run.dropout, top=top, finetune=run.fine_tuning,
                  packed_doc_length=run.packed_doc_length)


def _timed_layouts(run: PublishedRun, options: StepOptions, top: int = 1, fitting: Any = None):
    """The layouts the validation times for ``run``: those of the published flags that fit its GPUs,
    or, when dtlib's memory model fits none, the same flags with the memory limit lifted. The table
    (:func:`predict`) and the fits (:func:`error_grid`) both time these, so that a row's error in the
    table is the error the leave-one-source-out fit sees. ``fitting``: that first search, when already run."""
    mine = _published_layout(run, options, top=top) if fitting is None else fitting
    if mine.configs:
        return mine
    found = _published_layout(run, options, fit=False, top=top)
    if not found.configs:
        raise ValueError(f"run {run.name!r}: no layout of its published flags {_fixed(run)} is valid for "
                         f"{run.cluster.world_size} GPUs and global batch {run.global_batch}: {found.why}")
    return found


def _prediction(run: PublishedRun, gemm: float | None = None, attention: float | None = None) -> float:
    """The planner's value of the run's metric for the published layout (:func:`_timed_layouts`): one
    search; :func:`error_grid` gives the same numbers for a whole grid at once."""
    return _metric(_timed_layouts(run, _options(run, gemm, attention)).configs[0], run)


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
    best = _timed_layouts(run, options, fitting=mine).configs[0]
    predicted = _metric(best, run)
    out = {"name": run.name, "source": run.source, "family": run.family, "metric": run.metric,
           "unit": METRIC_UNITS[run.metric], "published": run.published,
           "predicted": predicted, "error": (predicted - run.published) / run.published, "fits": fits,
           "why": mine.why, "memory_gib": best["memory_per_gpu_bytes"] / GiB, "config": best,
           "stack": run.stack, "ignored": ignored(run)}
    if rank:
        # CP and EP only where published
        same_software = {k: run.layout[k] for k in ("recompute", "sequence_parallel", "zero") if k in run.layout}
        ranked = search(run.model, run.cluster, run.global_batch, options=options,
                        fixed=same_software | {"cp": run.layout.get("cp", 1), "ep": run.layout.get("ep", 1)},
                        headroom=1.0, dropout=run.dropout, top=10_000, finetune=run.fine_tuning,
                        packed_doc_length=run.packed_doc_length)
        times = [c["step_time_s"] for c in ranked.configs] or [best["step_time_s"]]
        out["rank"] = 1 + sum(t < best["step_time_s"] * (1 - 1e-9) for t in times)
        out["gap_to_best"] = best["step_time_s"] / min(times) - 1
    return out


def validation_table(gemm: float | None = None, attention: float | None = None,
                     rank: bool = True) -> list[dict[str, Any]]:
    """:func:`predict` on every row of :data:`PUBLISHED` (default: the fitted efficiencies)."""
    return [predict(run, gemm, attention, rank) for run in PUBLISHED]


def mean_absolute_error(rows: list[dict[str, Any]]) -> float:
    """Mean of ``|relative error|`` over ``rows``."""
    return float(np.mean([abs(r["error"]) for r in rows]))


def errors_by_kind(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``rows`` (:func:`validation_table`) split into dense and mixture-of-experts runs: for each,
    the ``names`` and their ``mean_absolute_error``."""
    moe = {run.name for run in PUBLISHED if run.model.moe_experts}
    out = {}
    for kind, mine in (("dense", [r for r in rows if r["name"] not in moe]), ("moe", [r for r in rows if r["name"] in moe])):
        out[kind] = {"names": [r["name"] for r in mine], "mean_absolute_error": mean_absolute_error(mine)}
    return out


GEMM_GRID = tuple(round(x, 2) for x in np.arange(0.40, 1.001, 0.05))
ATTENTION_GRID = tuple(round(x, 2) for x in np.arange(0.20, 0.801, 0.05))


def _candidates(run: PublishedRun) -> list[tuple[str, str, dict[str, np.ndarray]]]:
    """Every layout the planner may time for ``run`` (:func:`_timed_layouts`: the published knobs
    pinned, the rest free), as (schedule, recompute, layout arrays) groups: what :func:`search`
    enumerates, independent of the efficiencies (memory does not depend on them)."""
    found = _timed_layouts(run, _options(run, None, None), top=10 ** 9).configs
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for c in found:
        groups[c["schedule"], c["recompute"]].append(c)
    # every integer or boolean knob of a search row is a layout array (any knob search gains is
    # carried too); two are named differently in the rows (the command line's JSON names)
    renamed = {"micro_batch": "micro_batch_size", "microbatches": "num_microbatches"}
    # (the pipeline split's counts are None where not given: 0 in the arrays; memory_stage is a result)
    knobs = [k for k, v in found[0].items() if (isinstance(v, (bool, int)) or k in SPLIT)
             and k not in GIVEN_OPTIONS and k != "memory_stage"]
    return [(schedule, recompute, {renamed.get(k, k): np.array([int(c[k] or 0) for c in rows]) for k in knobs})
            for (schedule, recompute), rows in groups.items()]


def _grid_metric(run: PublishedRun, gemm: np.ndarray, attention: np.ndarray) -> np.ndarray:
    """The run's metric at every (gemm[i], attention[i]) point: the fastest candidate layout at each,
    from one step-time pass per candidate group with the efficiencies as arrays."""
    points = len(gemm)
    options, dropout = resolve(_options(run), run.dropout)
    scale = get_stack(run.stack).attention_scale(run.cluster.gpu)
    best_time = np.full(points, np.inf)
    best_metric = np.full(points, np.nan)
    for schedule, recompute, layouts in _candidates(run):
        k = len(layouts["dp"])
        tiled = {name: np.tile(a, points) for name, a in layouts.items()}
        tiled["gpus"] = tiled["dp"] * tiled["tp"] * tiled["pp"] * tiled["cp"]
        n, _ = layout_arrays(run.model, tiled, schedule, "none", on_invalid="raise",
                             balanced=bool(run.layout.get("account_for_embedding_and_loss")))
        n = with_packing(with_finetune(n, run.fine_tuning, run.model), run.packed_doc_length)
        opts = replace(options, gemm_efficiency=np.repeat(gemm, k),
                       attention_efficiency=np.repeat(attention * scale, k))
        t = step_time_arrays(n, run.cluster, recompute=recompute, schedule=schedule, options=opts,
                             dropout=dropout, recompute_layers=run.layout.get("recompute_layers"),
                             recompute_modules=tuple(run.layout.get("recompute_modules", ())),
                             account_for_embedding_and_loss=bool(run.layout.get("account_for_embedding_and_loss")))
        time = t["step_time"].reshape(points, k)
        per_gpu = {"tokens_per_gpu_s": t["tokens"] / run.cluster.world_size,
                   "hardware_tflops_per_gpu": t["hardware_flops"] / (t["gpus"] * 1e12),
                   "model_tflops_per_gpu": t["model_flops"] / (t["gpus"] * 1e12),
                   "step_time_s": None}[run.metric]
        metric = time if per_gpu is None else per_gpu.reshape(points, k) / time
        j = np.argmin(time, axis=1)
        rows = np.arange(points)
        faster = time[rows, j] < best_time
        best_time = np.where(faster, time[rows, j], best_time)
        best_metric = np.where(faster, metric[rows, j], best_metric)
    return best_metric


def error_grid(gemm_grid: Sequence[float] = GEMM_GRID, attention_grid: Sequence[float] = ATTENTION_GRID,
               runs: Sequence[PublishedRun] | None = None) -> np.ndarray:
    """``log(predicted / published)`` for every (GEMM efficiency, attention efficiency, run):
    an array of shape (len(gemm_grid), len(attention_grid), len(runs)), computed once so that every
    fit (in-sample and each leave-one-source-out fold) is an argmin over it. Each run's candidate
    layouts are enumerated once and timed at every grid point in one pass (the same numbers as
    :func:`_prediction` point by point, tests/test_validation_data.py)."""
    runs = PUBLISHED if runs is None else runs
    for name, grid in (("gemm_grid", gemm_grid), ("attention_grid", attention_grid)):
        if not len(grid) or not all(0 < g <= 1 for g in grid):
            raise ValueError(f"{name} must be a non-empty list of fractions in (0, 1], got {list(grid)!r}")
    gemm, attention = (a.ravel() for a in np.meshgrid(np.asarray(gemm_grid, float),
                                                      np.asarray(attention_grid, float), indexing="ij"))
    out = np.empty((len(gemm_grid), len(attention_grid), len(runs)))
    for r, run in enumerate(runs):
        predicted = _grid_metric(run, gemm, attention)
        out[:, :, r] = np.log(predicted / run.published).reshape(len(gemm_grid), len(attention_grid))
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


def held_out_errors(errors: np.ndarray | None = None, *, gemm_grid: Sequence[float] = GEMM_GRID,
                    attention_grid: Sequence[float] = ATTENTION_GRID) -> np.ndarray:
    """Each run's signed relative error predicted by the fit without its own source (the fold
    :func:`leave_one_source_out` scores it in), in :data:`PUBLISHED` order."""
    errors = error_grid(gemm_grid, attention_grid) if errors is None else errors
    sources = np.array([r.source for r in PUBLISHED])
    out = np.empty(len(PUBLISHED))
    for source in SOURCES:
        g, a = fit(errors, gemm_grid=gemm_grid, attention_grid=attention_grid, leave_out=source)
        mine = sources == source
        out[mine] = np.expm1(errors[gemm_grid.index(g), attention_grid.index(a), mine])
    return out


def errors_by_family(errors: np.ndarray | None = None, *, gemm_grid: Sequence[float] = GEMM_GRID,
                     attention_grid: Sequence[float] = ATTENTION_GRID) -> dict[str, dict[str, Any]]:
    """For each GPU family (``PublishedRun.family``): its ``runs``, the mean absolute relative error
    of the fit on every source (``in_sample_error``) and of each run's own held-out fold
    (``loso_error``, :func:`held_out_errors`)."""
    errors = error_grid(gemm_grid, attention_grid) if errors is None else errors
    g, a = fit(errors, gemm_grid=gemm_grid, attention_grid=attention_grid)
    in_sample = np.expm1(errors[gemm_grid.index(g), attention_grid.index(a)])
    held = held_out_errors(errors, gemm_grid=gemm_grid, attention_grid=attention_grid)
    families = np.array([r.family for r in PUBLISHED])
    return {str(f): {"runs": int((families == f).sum()),
                "in_sample_error": float(np.mean(np.abs(in_sample[families == f]))),
                "loso_error": float(np.mean(np.abs(held[families == f])))}
            for f in sorted(set(families), key=list(families).index)}


def _goal_lines(loso: dict[str, dict[str, Any]], families: dict[str, dict[str, Any]]) -> list[str]:
    """The held-out numbers against :data:`GOALS`, each met or missed by how much."""
    mean = float(np.mean([d["loso_error"] for d in loso.values()]))
    worst_source = max(loso, key=lambda s: loso[s]["loso_error"])
    worst_family = max(families, key=lambda f: families[f]["loso_error"])
    checks = [("mean held out over sources", mean, GOALS["mean_over_sources"]),
              (f"worst source held out ({worst_source})", loso[worst_source]["loso_error"], GOALS["source"]),
              (f"worst GPU family held out ({worst_family.upper()})", families[worst_family]["loso_error"],
               GOALS["family"])]
    return [f"* {name}: {100 * value:.1f}% against <= {100 * goal:.0f}%: "
            + ("met" if value <= goal else f"missed by {100 * (value - goal):.1f} points")
            for name, value, goal in checks]


def _num(x: float) -> str:
    """A table number: thousands with separators, smaller ones with 4 significant digits."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _markdown(rows: list[dict[str, Any]], loso: dict[str, dict[str, Any]] | None,
              families: dict[str, dict[str, Any]] | None = None) -> str:
    unit = METRIC_UNITS
    by_name = {r.name: r for r in PUBLISHED}
    lines = ["| run | GPUs | stack | timed layout | metric | published | predicted | error | GEMM s | attention s "
             "| fits (GiB/GPU) | rank | gap to best |", "|---" * 13 + "|"]
    for r in rows:
        run, c = by_name[r["name"]], r["config"]
        modules = f" ({'+'.join(c['recompute_modules'])})" if c.get("recompute_modules") else ""
        layout = (f"tp {c['tp']} pp {c['pp']} cp {c['cp']} dp {c['dp']}, {c['recompute']}{modules}"
                  f"{', SP' if c['sequence_parallel'] else ''}{', ZeRO ' + str(c['zero']) if c['zero'] else ''}"
                  f", {run.dtype}{', ' + str(int(run.power_limit_w)) + ' W' if run.power_limit_w else ''}"
                  f" (mb {c['micro_batch']}, v {c['virtual_stages']})"
                  f"{'; not timed: ' + ', '.join(r['ignored']) if r['ignored'] else ''}")
        lines.append(f"| {r['name']} | {run.cluster.world_size:,} x {run.family.upper()} | {run.stack} | {layout} | "
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
    if families:
        lines += ["", "| GPU family | runs | in-sample error | held-out error (each run's own fold) |", "|---|---|---|---|"]
        lines += [f"| {f.upper()} | {d['runs']} | {100 * d['in_sample_error']:.1f}% | {100 * d['loso_error']:.1f}% |"
                  for f, d in families.items()]
    if loso and families:
        lines += ["", "Against the goals:"] + _goal_lines(loso, families)
    return "\n".join(lines)


def _pins(rows: list[dict[str, Any]], loso: dict[str, dict[str, Any]], families: dict[str, dict[str, Any]]) -> str:
    """``EXPECTED``, ``LOSO`` and ``FAMILIES`` as ``tests/test_plan_validation.py`` pins them, and the two means."""
    lines = ["EXPECTED = {"] + [f"    {r['name']!r}: ({r['error']:.4f}, {r['fits']}, {r['rank']})," for r in rows]
    lines += ["}", "", "LOSO = {"] + [f"    {s!r}: ({d['gemm']:.2f}, {d['attention']:.2f}, {d['loso_error']:.4f}, "
                                      f"{d['in_sample_error']:.4f})," for s, d in loso.items()]
    lines += ["}", "", "FAMILIES = {"] + [f"    {f!r}: ({d['runs']}, {d['in_sample_error']:.4f}, {d['loso_error']:.4f}),"
                                          for f, d in families.items()]
    lines += ["}", f"# in-sample mean absolute error over the runs: {mean_absolute_error(rows):.4f}",
              f"# leave-one-source-out mean over sources: {np.mean([d['loso_error'] for d in loso.values()]):.4f}"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dtlib.plan.validation [--no-loso] [--no-rank] [--pins]``: the tables of
    ``docs/validation.md``; ``--pins``: the values ``tests/test_plan_validation.py`` pins instead."""
    ap = argparse.ArgumentParser(description="the planner against published runs: fit, table, LOSO")
    ap.add_argument("--no-loso", action="store_true", help="skip the fit and leave-one-source-out")
    ap.add_argument("--no-rank", action="store_true", help="skip ranking the published layouts")
    ap.add_argument("--pins", action="store_true", help="print the test's EXPECTED and LOSO dicts instead")
    args = ap.parse_args(argv)
    if args.pins:
        errors = error_grid()
        print(_pins(validation_table(), leave_one_source_out(errors), errors_by_family(errors)))
        return
    loso = families = None
    if not args.no_loso:
        errors = error_grid()
        g, a = fit(errors)
        print(f"fitted on all sources: GEMM efficiency {g:.2f}, attention efficiency {a:.2f} "
              f"(defaults in dtlib.plan.calibration: {GEMM_EFFICIENCY:.2f}, {ATTENTION_EFFICIENCY:.2f})\n")
        loso, families = leave_one_source_out(errors), errors_by_family(errors)
    rows = validation_table(rank=not args.no_rank)
    print(_markdown(rows, loso, families))


if __name__ == "__main__":
    main()
