"""Every plotting function, drawn with representative data on the Agg canvas: no text smaller
than ``SMALL_FONT`` and no legend on top of what the figure is about (a reference line such as a
GPU's capacity, a data point, a bar label), measured in display coordinates after layout."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.text import Text
from matplotlib.transforms import Bbox

import dtlib.viz
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.precision import PRECISIONS, get_precision
from dtlib.analytic.presets import get_preset
from dtlib.analytic.units import GiB, MiB
from dtlib.parallel.ddp import SyncRecord
from dtlib.parallel.mesh import ParallelLayout
from dtlib.parallel.schedules import schedule, simulate
from dtlib.analytic.hardware import cluster
from dtlib.plan.search import search
from dtlib.resilience.interval import interval_study
from dtlib.viz import cluster as cluster_viz
from dtlib.viz import frameworks as frameworks_viz
from dtlib.viz import (charts, local_sgd, collectives, comm, memory, mesh, pipeline, plan, profile, resilience, ring,
                       tensor, timeline, training, zero)
from dtlib.viz.style import SMALL_FONT
from dtlib.widgets import REGISTRY
import dtlib.widgets.communication  # noqa: F401  (registers the widgets drawn below)
import dtlib.widgets.frameworks  # noqa: F401
import dtlib.widgets.memory  # noqa: F401
import dtlib.widgets.placement  # noqa: F401

_STATES = {"DDP": [{"parameters": 4 * MiB, "gradients": 4 * MiB, "optimizer": 8 * MiB}] * 2,
           "ZeRO-1": [{"parameters": 4 * MiB, "gradients": 4 * MiB, "optimizer": 4 * MiB}] * 2,
           "FSDP (ZeRO-3)": [{"parameters": 2 * MiB, "gradients": 2 * MiB, "optimizer": 4 * MiB}] * 2}


def _record(start: float, buckets: int, step: float) -> SyncRecord:
    """A DDP iteration: forward, backward, and buckets issued while backward still runs."""
    backward_end = start + 2 + buckets * step
    return SyncRecord(world_size=2, forward_start=start, forward_end=start + 1,
                      backward_end=backward_end, bucket_bytes=[MiB] * buckets,
                      bucket_ready=[start + 1.5 + b * step for b in range(buckets)],
                      bucket_issued=[start + 1.6 + b * step for b in range(buckets)],
                      bucket_done=[backward_end + 0.5 + b * 0.1 for b in range(buckets)])


def _pipeline(name: str, t_forward: float = 1.0):
    """The simulator's timeline of a 4-stage, 8 micro-batch schedule."""
    return simulate(schedule(name, 4, 8), t_forward=t_forward, t_backward=2 * t_forward)


def _collective() -> dict:
    before = [torch.arange(4.0) + 10 * r for r in range(4)]
    return {"world_size": 4, "name": "all_reduce", "before": before,
            "after": [sum(before)] * 4}


# The uncompressed baseline sends the most bytes (right) and, as in a short run, is not the most
# accurate (bottom): where a legend in the lower right corner used to sit.
_COMPRESSION = [{"method": "none (fp32 all-reduce)", "bytes_per_step": 1.7e6, "accuracy": 0.86,
                 "accuracy_std": 0.01},
                {"method": "PowerSGD rank 2", "bytes_per_step": 4.1e4, "accuracy": 0.88,
                 "accuracy_std": 0.02},
                {"method": "top-k 1% + error feedback", "bytes_per_step": 3.4e4, "accuracy": 0.87,
                 "accuracy_std": 0.02}]


def _calculator(**changes):
    explorer = REGISTRY["memory_calculator"]()
    for name, value in changes.items():
        explorer.controls[name].value = value
    return explorer.figure


def _profile() -> dict:
    """Two ranks of a step whose communication is exposed, with the findings of dtlib.profile."""
    from dtlib.profile import diagnose

    parts = {0: {"compute": 0.06, "exposed_comm": 0.03, "bubble": 0.0, "data": 0.01, "optimizer": 0.002,
                 "other": 0.003, "overlapped_comm": 0.01, "host_gaps": 0.002},
             1: {"compute": 0.05, "exposed_comm": 0.04, "bubble": 0.0, "data": 0.01, "optimizer": 0.002,
                 "other": 0.001, "overlapped_comm": 0.01, "host_gaps": 0.001}}
    for row in parts.values():
        row["step"] = sum(row[p] for p in ("compute", "exposed_comm", "bubble", "data", "optimizer", "other"))
    out = {"breakdown": parts, "step_time": max(r["step"] for r in parts.values()), "mfu": 0.31, "hfu": 0.33}
    out["findings"] = diagnose(out)
    return out


_STEP = {"compute": [(0.0, 0.004), (0.005, 0.012)], "exposed_comm": [(0.012, 0.015)],
         "bubble": [], "data": [(0.0, 0.0)], "optimizer": [(0.015, 0.016)], "other": [(0.004, 0.005)],
         "comm_in_flight": [(0.008, 0.015)]}
SIZES = [2 ** k for k in range(10, 27, 2)]
FIGURES = {
    "plot_curves": lambda: charts.plot_curves(
        [1, 2, 4, 8], {"fits": [10, 20, 40, 78], "does not": [20, 40, 80, 160]}, "x", "GiB",
        logx=True, reference=(80, "h100-sxm: 80 GiB")),
    "plot_grouped_bars": lambda: charts.plot_grouped_bars(
        {"parameters": {"dtlib": 2.0, "torch": 2.1}, "peak": {"dtlib": 5.0, "torch": 4.8}}, "MiB",
        errors={"peak": {"dtlib": (4.0, 6.5)}}),
    "plot_collective": lambda: collectives.plot_collective(_collective()),
    "plot_alpha_beta": lambda: comm.plot_alpha_beta(
        SIZES, {"ring": [1e-5 + s / 1e9 for s in SIZES]}, 4,
        measured=[{"impl": "gloo", "bytes": s, "seconds": 2e-5 + s / 5e8} for s in SIZES], mark=2 ** 20),
    "plot_bandwidth": lambda: comm.plot_bandwidth(
        [{"impl": impl, "collective": c, "bytes": s, "busbw": f * s / (1e-5 + s / 1e9), "world_size": 4}
         for impl, f in (("dtlib ring", 0.8), ("gloo", 1.0)) for c in ("all_reduce", "all_gather")
         for s in SIZES]),
    "plot_compression_tradeoff": lambda: comm.plot_compression_tradeoff(_COMPRESSION),
    "plot_memory_breakdown": lambda: memory.plot_memory_breakdown(
        {f"ZeRO-{z}": memory_per_gpu("llama3-8b", Parallelism(dp=8, zero=z), gpu="h100-sxm")
         for z in (0, 1, 2, 3)}),
    "plot_bytes_per_param": lambda: memory.plot_bytes_per_param({p: get_precision(p) for p in PRECISIONS}),
    "plot_memory_curves": lambda: memory.plot_memory_curves(
        [1024, 2048, 4096, 8192], {"no recompute": [20 * GiB, 40 * GiB, 80 * GiB, 160 * GiB],
                                   "selective": [8 * GiB, 16 * GiB, 32 * GiB, 64 * GiB]},
        xlabel="sequence length", gpu_memory=80 * GiB, gpu_name="h100-sxm", logx=True),
    "plot_recompute_tradeoff": lambda: memory.plot_recompute_tradeoff(
        {"none": {"saved_bytes": 40 * MiB, "step_seconds": 0.10},
         "full": {"saved_bytes": 4 * MiB, "step_seconds": 0.13}}),
    "plot_predicted_vs_measured": lambda: memory.plot_predicted_vs_measured(
        {"parameters": 4 * MiB, "activations": 30 * MiB}, {"parameters": 4 * MiB, "activations": 29 * MiB}),
    "plot_column_row_split": lambda: tensor.plot_column_row_split(4),
    "plot_rank_grid": lambda: mesh.plot_rank_grid(ParallelLayout(dp=2, tp=4, pp=2), 8, "tp",
                                                  note="links: tp intra-node, pp inter-node"),
    "plot_gantt": lambda: pipeline.plot_gantt(_pipeline("1f1b"), title="1F1B, p=4, m=8"),
    "plot_measured_vs_ideal": lambda: pipeline.plot_measured_vs_ideal(
        _pipeline("1f1b", t_forward=1.2e-3), _pipeline("1f1b", t_forward=1e-3), title="1F1B"),
    "plot_in_flight": lambda: pipeline.plot_in_flight({"GPipe": _pipeline("gpipe"), "1F1B": _pipeline("1f1b")}),
    "plot_schedule_memory": lambda: pipeline.plot_schedule_memory(
        _pipeline("1f1b"), [8.0, 6.0, 4.0, 2.0], title="1F1B"),
    "plot_goodput_vs_interval": lambda: resilience.plot_goodput_vs_interval(
        interval_study(16384, 50677.0, 80.0, 600.0, points=15, segments=500, runs=2)),
    "plot_breakdown": lambda: profile.plot_breakdown(_profile(), _profile()["findings"]),
    "plot_step_timeline": lambda: profile.plot_step_timeline({0: _STEP, 1: _STEP}),
    "plot_fault_shares": lambda: profile.plot_fault_shares({"communication": _profile(), "healthy": _profile()}),
    "plot_ring_all_reduce": lambda: ring.plot_ring_all_reduce(4, 2),
    "plot_ring_steps": lambda: ring.plot_ring_steps(4),
    "plot_overlap_timeline": lambda: timeline.plot_overlap_timeline(
        {"NaiveDDP": _record(0.0, 2, 1.0), "BucketedDDP 1 MiB": _record(5.0, 6, 0.4)}),
    "plot_scaling": lambda: training.plot_scaling({1: 100.0, 2: 180.0, 4: 300.0},
                                                  {1: 1.0, 2: 0.9, 4: 0.75}),
    "plot_losses": lambda: training.plot_losses(
        {"1 process": list(np.exp(-np.arange(20) / 8)), "4 ranks": list(np.exp(-np.arange(20) / 8))}),
    "plot_lr_schedules": lambda: training.plot_lr_schedules(
        {"warm-up": [min(1, (i + 1) / 5) * 0.4 for i in range(20)]},
        used={"used": [min(1, (i + 1) / 5) * 0.4 for i in range(20)]}),
    "plot_stage_costs": lambda: zero.plot_stage_costs(
        _STATES, predicted={k: v[0] for k, v in _STATES.items()},
        sent={k: {"measured": 1e6, "predicted": 1.1e6} for k in _STATES}, gpu_memory=17 * MiB,
        gpu_name="toy GPU"),
    "plot_zero_stages": lambda: zero.plot_zero_stages(
        {z: {"per_rank": _STATES[k], "predicted": {**_STATES[k][0], "sent": 1.1e6}, "sent": 1e6}
         for z, k in ((0, "DDP"), (1, "ZeRO-1"), (3, "FSDP (ZeRO-3)"))}),
    "plot_side_by_side": lambda: zero.plot_side_by_side(
        {"sharded parameters": {"dtlib FSDP": 2 * MiB, "fully_shard": 2 * MiB}}),
    # the memory calculator's "does it fit?" case, over and under the GPU's capacity
    "calculator, does not fit": _calculator,
    "calculator, fits": lambda: _calculator(zero=3, recompute="full", overhead_gib=4.0),
    "alpha_beta widget": lambda: REGISTRY["alpha_beta"]().figure,
    "plot_loss_vs_time_and_bytes": lambda: local_sgd.plot_loss_vs_time_and_bytes(
        {name: {"loss": [5.5 - 0.05 * i * k for i in range(48)], "time": [0.05 * i * k for i in range(48)],
                "bytes": [1e6 * i / k for i in range(48)]} for name, k in
         (("ddp", 1.0), ("local_sgd", 1.5), ("diloco", 1.6))}),
    "plot_staleness": lambda: local_sgd.plot_staleness(
        {f"s = {s}": {"updates": [{"worker": i % 3, "staleness": (i * 7) % (2 * s + 3)} for i in range(36)]}
         for s in (0, 2)}, bounds={"s = 0": 2, "s = 2": 10}),
    "plot_rank_balance": lambda: local_sgd.plot_rank_balance(
        {"slowdowns": [1, 1, 1, 3],
         "equal": {"sizes": [8, 8, 8, 8], "busy": [0.02, 0.021, 0.02, 0.06], "step_time": 0.07, "throughput": 450},
         "balanced": {"sizes": [9, 10, 9, 4], "busy": [0.02, 0.022, 0.02, 0.03], "step_time": 0.045,
                      "throughput": 660}}),
    "plot_stage_balance": lambda: local_sgd.plot_stage_balance(
        {"slowdowns": [1, 3, 1, 1],
         "even": {"counts": [2, 2, 2, 2], "stage_seconds": [0.009, 0.024, 0.008, 0.009], "step_time": 0.17},
         "balanced": {"counts": [2, 1, 3, 2], "stage_seconds": [0.009, 0.012, 0.012, 0.009], "step_time": 0.12}}),
    "plot_time_and_loss": lambda: local_sgd.plot_time_and_loss(
        {"curves": {"DDP": {"time": [0, 1, 2, 3], "loss": [5.5, 4.0, 3.5, 3.0]},
                    "DiLoCo H=8": {"time": [0, 0.3, 0.6], "loss": [5.5, 4.2, 3.4]}},
         "title": "DiLoCo 5.0x faster than DDP"}),
    "plot_plan": lambda: plan.plot_plan(*_plan()),
    "plot_plan, nothing fits": lambda: plan.plot_plan(
        [], 72 * GiB, why="nothing fits: the smallest memory per GPU found is 857.6 GiB (dp=1, tp=8) but "
                          "0.9 x 80 GiB = 72.0 GiB is available on a h100-sxm; use more GPUs"),
    # lesson 12: the cluster around the job
    "plot_sample_order": lambda: cluster_viz.plot_sample_order(
        {f"{w} ranks": [(i * 7 % 16, p // (4 // w) % w) for p, i in enumerate(range(16))] for w in (1, 2, 4)}),
    "plot_placement_traffic": lambda: _placement(),
    "placement widget": lambda: REGISTRY["placement"]().figure,
    "plot_schedule_gantt": lambda: _gantt(),
    "plot_replica_checksums": lambda: cluster_viz.plot_replica_checksums(
        [{"step": 0}, {"step": 1, "diverged": []}, {"step": 2}, {"step": 3, "diverged": [1]}], 3, flipped=(2, 1)),
    "plot_checkpoint_bytes": lambda: cluster_viz.plot_checkpoint_bytes(
        {"AdamW": [{"step": 1, "kind": "full", "bytes": 380e3}, {"step": 2, "kind": "delta", "bytes": 300e3}],
         "SGD": [{"step": 1, "kind": "full", "bytes": 130e3}, {"step": 2, "kind": "delta", "bytes": 80e3}]}),
    # lesson 13: the real frameworks
    "plot_framework_losses": lambda: frameworks_viz.plot_framework_losses(
        {"dtlib": [4.2, 4.0, 3.8], "DeepSpeed ZeRO-2": [4.2, 4.0, 3.8], "JAX fsdp": [4.1, 3.7, 3.5]},
        {"dtlib": [4.2, 4.0, 3.8], "DeepSpeed ZeRO-2": [4.2, 4.0, 3.8], "JAX fsdp": [4.1, 3.7, 3.5]}, {"dtlib": {"loss": 0.0, "parameters": 3e-8},
                          "DeepSpeed ZeRO-2": {"loss": 1.2e-7, "parameters": 3e-8},
                          "JAX fsdp": {"loss": 2.4e-7, "parameters": 6e-8}}),
    "plot_framework_memory": lambda: frameworks_viz.plot_framework_memory(
        {"dtlib ZeRO-2": _STATES["ZeRO-1"], "DeepSpeed ZeRO-2": _STATES["ZeRO-1"]},
        {"dtlib ZeRO-2": _STATES["ZeRO-1"][0], "DeepSpeed ZeRO-2": _STATES["ZeRO-1"][0]}),
    "plot_framework_collectives": lambda: frameworks_viz.plot_framework_collectives(
        {"dtlib": {"all_reduce": 1, "reduce_scatter": 0}, "DeepSpeed": {"all_reduce": 2, "all_gather": 1},
         "JAX (HLO)": {"all_reduce": 1}}),
    "plot_silent_defaults": lambda: frameworks_viz.plot_silent_defaults(
        {"DeepSpeed\ngradient_clipping": {"default": 1.6e-2, "fixed": 3e-8},
         "Megatron\nbatch_p2p_comm": {"default": 1.4, "fixed": 0.0},
         "shard_map\ngradient sum": {"default": 0.3, "fixed": 1e-7}}),
    "emitted configs widget": lambda: REGISTRY["emitted_configs"]().figure,
    "plot_emitted": lambda: frameworks_viz.plot_emitted(
        {"parameters": 3 * MiB, "gradients": 1.5 * MiB, "optimizer": 6 * MiB},
        {"DeepSpeed": '{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2}\n}',
         "Megatron-LM": "--tensor-model-parallel-size 2\n--micro-batch-size 1",
         "JAX": "mesh {'data': 2, 'model': 2}\nattn.qkv: P(None, 'model')"},
        {"DeepSpeed": ["tensor parallelism (tp 2): DeepSpeed alone has no TP for a GPT"], "JAX": []},
        notes={"Megatron-LM": ["tp_overlap: --tp-comm-overlap needs --sequence-parallel: re-timed"]}),
    "plot_fullsize_terms": lambda: frameworks_viz.plot_fullsize_terms(
        {t: {"PyTorch's tracker": a * 2**30, "dtlib memory": b * 2**30}
         for t, a, b in (("parameters", 0.69, 0.69), ("gradients", 0, 0.69), ("optimizer", 1.38, 1.38),
                         ("activations", 6.61, 6.60), ("temporary", 8.82, 3.91))}),
}


def _placement():
    from dtlib.plan.placement import ClusterSpec, Layout, node_matrix, place, tier_bytes
    layout, c = Layout(dp=4, tp=4), ClusterSpec(nodes=4, gpus_per_node=4, nodes_per_rack=2)
    vol = {"tp": 4e9, "dp": 1e9}
    out = {}
    for how in ("megatron", "naive", "random"):
        gpu = place(layout, c, how)
        per = tier_bytes(layout, c, gpu, vol)
        out[how] = {"matrix": node_matrix(layout, c, gpu, vol),
                    "tiers": {t: sum(per[k][t] for k in per) for t in ("nvlink", "leaf", "spine")}}
    return cluster_viz.plot_placement_traffic(out, 2)


def _gantt():
    from dtlib.plan.placement import ClusterSpec
    from dtlib.plan.scheduler import Job, simulate as gang
    c = ClusterSpec(nodes=2, gpus_per_node=4, nodes_per_rack=2)
    jobs = [Job("A", 1, 10), Job("B", 4, 10), Job("C", 3, 10), Job("D", 2, 5, arrival=3)]
    return cluster_viz.plot_schedule_gantt({p: gang(jobs, c, p) for p in ("first-fit", "topology")}, 8, 4)


def _plan():
    r = search(get_preset("llama3-8b"), cluster("h100-sxm", 2, 8), 64, top=5)
    return r.configs, r.capacity


def _points(line) -> np.ndarray:
    """Display coordinates along a line: its vertices and 20 points on each segment."""
    xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
    if len(xy) < 2 or line.get_linestyle() in ("None", "none", "", " "):
        return xy
    t = np.linspace(0, 1, 20)[:, None, None]
    return (xy[:-1] + t * (xy[1:] - xy[:-1])).reshape(-1, 2)


def _segments(coll: LineCollection) -> list[np.ndarray]:
    t = np.linspace(0, 1, 20)[:, None]
    out = []
    for path in coll.get_paths():
        xy = coll.get_transform().transform(path.vertices)
        out += [a + t * (b - a) for a, b in zip(xy[:-1], xy[1:])]
    return out


def _within(points: np.ndarray, box: Bbox) -> np.ndarray:
    pts = np.asarray(points).reshape(-1, 2)
    return (pts[:, 0] > box.x0) & (pts[:, 0] < box.x1) & (pts[:, 1] > box.y0) & (pts[:, 1] < box.y1)


def _inside(points: np.ndarray, box: Bbox) -> bool:
    return bool(np.any(_within(points, box)))


def _drawn(fig):
    FigureCanvasAgg(fig).draw()  # final layout, so extents are what the PNG shows
    return fig.canvas.get_renderer()


def _what_legends_hide(fig, renderer) -> list[str]:
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    hidden = []
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            visible = ax.get_window_extent(renderer)  # what lies outside the axes is not drawn
            for line in ax.lines:
                pts = _points(line)
                if len(pts) and _inside(pts[_within(pts, visible.expanded(1.001, 1.001))], box):
                    hidden.append(f"line {line.get_label()!r}")
            for coll in ax.collections:
                if isinstance(coll, LineCollection) and any(_inside(s, box) for s in _segments(coll)):
                    hidden.append(f"lines {coll.get_label()!r}")
            for text in ax.texts:
                if text.get_text().strip() and text.get_window_extent(renderer).overlaps(box):
                    hidden.append(f"label {text.get_text()!r}")
    return hidden


def _lines_through_labels(fig, renderer) -> list[str]:
    """Bar and reference labels crossed by a line (e.g. a GPU's capacity through a total)."""
    crossed = []
    for ax in fig.axes:
        for text in ax.texts:
            if not text.get_text().strip():
                continue
            box = text.get_window_extent(renderer)
            for line in ax.lines:
                if len(line.get_xydata()) and _inside(_points(line), box):
                    crossed.append(f"{line.get_label()!r} through {text.get_text()!r}")
    return crossed


def test_every_plotting_function_has_a_sample_here():
    """A new plotting function gets drawn by these tests, or this fails."""
    public = set()
    for mod in pkgutil.iter_modules(dtlib.viz.__path__):
        module = importlib.import_module(f"dtlib.viz.{mod.name}")
        public |= {name for name, f in inspect.getmembers(module, inspect.isfunction)
                   if name.startswith("plot_") and f.__module__ == module.__name__}
    assert public <= set(FIGURES), f"no sample figure for {sorted(public - set(FIGURES))}"


@pytest.mark.parametrize("name", sorted(FIGURES))
def test_no_small_text_and_no_legend_over_a_line_a_point_or_a_label(name):
    fig = FIGURES[name]()
    small = [(t.get_text()[:30], t.get_fontsize()) for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.get_fontsize() < SMALL_FONT]
    assert not small, f"{name}: text under {SMALL_FONT} pt: {small}"
    renderer = _drawn(fig)
    assert _what_legends_hide(fig, renderer) == [], f"{name}: the legend hides these"
    assert _lines_through_labels(fig, renderer) == [], f"{name}: lines cross these labels"


def test_the_gpu_capacity_is_named_where_nothing_covers_it():
    """The calculator's capacity line is labelled in its legend (outside the axes), and the
    totals stand under the bars."""
    (ax,) = _calculator().axes
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "h100-sxm: 80 GiB" in labels
    assert ax.get_legend().get_window_extent(_drawn(ax.figure)).x0 > ax.get_window_extent().x1
    total = memory_per_gpu("llama3-8b", Parallelism(dp=8, zero=1, recompute="selective",
                                                    micro_batch_size=1, num_microbatches=8),
                           precision="megatron-bf16", gpu="h100-sxm", dropout=False).total
    assert [t.get_text() for t in ax.get_xticklabels()] == [f"{total / GiB:.1f} GiB"]


def test_overlap_timelines_share_one_time_axis():
    fig = FIGURES["plot_overlap_timeline"]()
    limits = {ax.get_xlim() for ax in fig.axes}
    assert len(fig.axes) == 2 and len(limits) == 1, f"panels on different x ranges: {limits}"


def test_one_block_is_not_plural():
    """Lesson 11's stage balance labelled a stage '1 blocks'."""
    fig = local_sgd.plot_stage_balance(
        {"slowdowns": [1, 3, 1, 1],
         "even": {"counts": [2, 2, 2, 2], "stage_seconds": [0.009, 0.024, 0.008, 0.009], "step_time": 0.17},
         "balanced": {"counts": [2, 1, 3, 2], "stage_seconds": [0.009, 0.012, 0.012, 0.009], "step_time": 0.12}})
    labels = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "1 block" in labels and "1 blocks" not in labels


def test_grouped_bars_draw_the_spread_they_are_given():
    fig = charts.plot_grouped_bars({"left": {"a": 2.0, "b": 5.0}}, "ms", errors={"left": {"b": (4.0, 9.0)}})
    ax = fig.axes[0]
    caps = [line for c in ax.containers if hasattr(c, "lines") and c.lines[2] for line in c.lines[2]]
    (segment,) = [seg for lc in caps for seg in lc.get_segments()]
    assert segment[0][1] == 4.0 and segment[1][1] == 9.0  # b's bar: from its low to its high
    assert ax.get_ylim()[1] > 9.0  # the spread stays inside the axes
    with pytest.raises(ValueError, match="must enclose the value"):
        charts.plot_grouped_bars({"left": {"a": 2.0}}, "ms", errors={"left": {"a": (3.0, 4.0)}})


def test_stage_costs_legend_names_only_the_parts_drawn():
    """Exercise 04 draws only Adam's state: its legend once listed parameters and gradients too."""
    fig = zero.plot_stage_costs({"unsharded AdamW": [{"optimizer": 8.0}] * 2, "yours": [{"optimizer": 4.0}] * 2})
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["optimizer"]
    full = zero.plot_stage_costs({"DDP": [{"parameters": 4.0, "gradients": 4.0, "optimizer": 8.0}]})
    assert [t.get_text() for t in full.axes[0].get_legend().get_texts()] == ["parameters", "gradients", "optimizer"]
