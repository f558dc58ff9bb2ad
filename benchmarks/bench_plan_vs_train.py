"""The loop closed on this machine: calibrate it, plan layouts of ``dtlib train``'s model, run them.

1. ``dtlib.plan.calibrate.calibrate`` measures this machine on 2 gloo ranks (``dtlib calibrate``):
   the GEMMs of the model's own shapes, elementwise bandwidth, collectives per message size;
2. the planner times each layout of :data:`LAYOUTS` on that profile
   (:func:`dtlib.plan.measured.calibrated_cluster`, :func:`dtlib.plan.steptime.step_time`) with
   the options of :data:`TRAINER_OPTIONS`, what ``dtlib train`` does, and the kernels per layer
   the profile counted on the model;
3. each layout runs on ``dtlib train``'s own trainer (:func:`dtlib.trainer.train` on 2 ranks of
   :func:`dtlib.launch`, as ``dtlib train`` starts it), with a hook that times every step on the
   profile's clock; its step time is the median, after ``--warmup`` steps, of the slowest rank's.

The clock is the profile's (``dtlib calibrate --clock``). On this machine, which other jobs load,
it is ``cpu``: each rank's CPU time, all threads (gloo's included), which counts the step's own
work and not the time other processes held the cores. CPU time does not count a rank's idle time
either, so the plan's figure compared is its step time without its idle term, the pipeline
bubble (``pp_bubble``); with ``--clock wall`` (an unloaded machine, a GPU) it is the whole step.

Every layout runs on 2 ranks with the same global batch: this machine's 2 cores give 2 ranks a core
each; more ranks would share cores, a contention the profile (measured on 2 ranks at once) does not
hold. The last line is the summary: ``plan vs train: N layouts, median error X%, worst Y%, rank
correlation R`` (error = |plan - train| / train; R: Spearman's, of the step times).

    python benchmarks/bench_plan_vs_train.py --quick      # a small model, 3 timed steps (about a minute)
    python benchmarks/bench_plan_vs_train.py              # docs/plan.md "The loop on this machine"
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import dtlib
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.timing import STATISTICS
from dtlib.plan.calibrate import CLOCKS, calibrate
from dtlib.plan.measured import calibrated_cluster, counted_forward_kernels, counted_zero3_kernels
from dtlib.plan.steptime import StepOptions, step_time
from dtlib.trainer import TrainConfig, train
from dtlib.trainer.hooks import Hook

RANKS = 2
# (name, dtlib train flags, the same layout for the planner); global batch dp x micro-batch x m = 8.
# Their costs differ by 2-3x (one micro-batch of 4 or 8 sequences up to ZeRO-3's gathers per
# micro-batch and TP's all-reduces over 8 recomputed micro-batches), so that the rank correlation
# measures the plan rather than a few percent of noise between layouts of nearly equal cost
LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("dp2 m1", dict(dp=2, micro_batch_size=4, num_microbatches=1)),
    ("dp2", dict(dp=2, micro_batch_size=2, num_microbatches=2)),
    ("dp2 m4", dict(dp=2, micro_batch_size=1, num_microbatches=4)),
    ("dp2 zero1", dict(dp=2, micro_batch_size=2, num_microbatches=2, zero=1)),
    ("dp2 zero3", dict(dp=2, micro_batch_size=2, num_microbatches=2, zero=3)),
    ("dp2 zero3 m4", dict(dp=2, micro_batch_size=1, num_microbatches=4, zero=3)),
    ("dp2 recompute", dict(dp=2, micro_batch_size=2, num_microbatches=2, recompute="full")),
    ("tp2", dict(tp=2, micro_batch_size=4, num_microbatches=2)),
    ("tp2 m8 recompute", dict(tp=2, micro_batch_size=1, num_microbatches=8, recompute="full")),
    ("pp2 m2", dict(pp=2, micro_batch_size=4, num_microbatches=2)),
    ("pp2 m4", dict(pp=2, micro_batch_size=2, num_microbatches=4)),
    ("pp2 m8", dict(pp=2, micro_batch_size=1, num_microbatches=8)),
]
# what dtlib.trainer does: fp32 weights, gradients, Adam (dtlib.analytic.precision "fp32"); TinyGPT's
# explicit attention (dtlib.models.gpt: the s x s scores stored); eager PyTorch, one kernel per
# operator; gradients reduced after the backward (dtlib.trainer.rank.synchronise_gradients) and
# tensor-parallel all-reduces on the critical path: nothing overlapped; eager PyTorch's gradients:
# accumulated by autograd, reduced from a flat copy (dtlib.parallel.collectives.all_reduce_coalesced),
# and under ZeRO-3 reduce-scattered after every micro-batch's backward, with its copies around each
# gather and reduce-scatter (dtlib.parallel.FSDP, dtlib.plan.zero3); the vocabulary-parallel loss's two
# all-reduces (dtlib.parallel.tensor.vocab_parallel_cross_entropy)
TRAINER_OPTIONS = StepOptions(precision="fp32", flash_attention=False, fused_elementwise=False,
                              dp_overlap=0.0, tp_overlap=0.0, cp_overlap=0.0, grad_accumulation_fusion=False,
                              grad_bucket_copy=True, zero3_reduce_per_microbatch=True, zero3_unit_copies=True,
                              cross_entropy_all_reduces=2)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks, ties given their mean rank."""
    def ranks(v: list[float]) -> np.ndarray:
        v = np.asarray(v, dtype=float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):  # ties: their mean rank
            r[v == value] = r[v == value].mean()
        return r
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


class StepClock(Hook):
    """Each step's time on ``clock`` (:data:`dtlib.plan.calibrate.CLOCKS`); at the end the slowest
    rank's per step, in rank 0's summary as ``step_clock_seconds``."""

    def __init__(self, clock: str):
        self.now, self.times, self.start = CLOCKS[clock], [], 0.0

    def before_step(self, run: Any) -> None:
        self.start = self.now()

    def after_step(self, run: Any, loss: float, seconds: float) -> None:
        self.times.append(self.now() - self.start)

    def close(self) -> None:  # every rank closes its hooks in the same order: a collective is safe here
        if dist.is_initialized():
            times = torch.tensor(self.times, dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            self.times = times.tolist()

    def summary(self) -> dict[str, Any]:
        return {"step_clock_seconds": self.times}


def train_step_seconds(shape: dict[str, int], layout: dict[str, Any], steps: int, warmup: int,
                       clock: str) -> float:
    """Median over the steps after ``warmup`` of the slowest rank's step time on ``clock``."""
    train_layout = {k: v for k, v in layout.items() if k != "recompute"}
    config = TrainConfig(**shape, **train_layout, recompute=layout.get("recompute") == "full", steps=warmup + steps)
    summary = dtlib.launch(train, config.world_size, args=(config, False, False, None, [StepClock(clock)]),
                           timeout=600, output="none")[0]
    return statistics.median(summary["step_clock_seconds"][warmup:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 2-layer, 64-wide model, 3 timed steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="timed steps per layout (median)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out before timing")
    # calibrate's figures summarise single calls: on a loaded machine the medians of 9 calls of a 256 KiB
    # all-reduce gave 0.4-4.2 ms of CPU time from one profile to the next (docs/plan.md), more calls spread them less
    p.add_argument("--repeats", type=int, default=25, help="calls per calibrated figure (at least 3)")
    p.add_argument("--statistic", choices=tuple(STATISTICS), default="median",
                   help="how a calibrated figure's calls become one (dtlib calibrate --statistic)")
    p.add_argument("--calibration", metavar="FILE", help="use this profile instead of calibrating")
    p.add_argument("--save-calibration", metavar="FILE", help="write the profile measured here")
    a = p.parse_args()
    if a.quick:
        a.hidden, a.seq, a.steps, a.warmup, a.repeats = 64, 32, 3, 1, 5
    shape = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq)
    model = TrainConfig(**shape).model_config()
    if a.calibration:
        from dtlib.plan.measured import load_profile
        profile = load_profile(a.calibration)
    else:
        micro = sorted({layout["micro_batch_size"] for _, layout in LAYOUTS})
        profile = calibrate(model, RANKS, tp=(1, 2), micro_batch=micro, options=TRAINER_OPTIONS,
                            max_bytes=16 * 2 ** 20, repeats=a.repeats, statistic=a.statistic)
    if a.save_calibration:
        with open(a.save_calibration, "w") as f:
            json.dump(profile, f, indent=1)
    cluster = calibrated_cluster(profile, 1, RANKS)
    # the kernels TinyGPT's layers launch, and those dtlib.parallel.FSDP adds to them, as calibrate counted them
    options = dataclasses.replace(TRAINER_OPTIONS, forward_kernels=counted_forward_kernels(profile, model),
                                  zero3_kernels=counted_zero3_kernels(profile, model))
    clock = profile.get("clock", "wall")
    print(f"{model.name}: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq {a.seq}; {RANKS} gloo ranks on "
          f"{profile['machine']['hostname']} ({profile['machine']['cpu']}, {profile['machine']['cpu_cores']} cores); "
          f"{clock} clock, calibrated figures the {profile.get('statistic', 'median')} of {profile['repeats']} calls; "
          f"train: median of {a.steps} steps after {a.warmup}")
    print(f"{'layout':<18}{'plan ms':>9}{'train ms':>10}{'error':>8}")
    planned, measured = [], []
    for name, layout in LAYOUTS:
        timed = step_time(model, Parallelism(**layout), cluster, options=options)
        # CPU time counts no idle time: the plan's step without its bubble (see the docstring)
        plan = timed.step_time - (clock == "cpu") * timed.breakdown["pp_bubble"]
        train = train_step_seconds(shape, layout, a.steps, a.warmup, clock)
        planned.append(plan)
        measured.append(train)
        print(f"{name:<18}{1e3 * plan:>9.1f}{1e3 * train:>10.1f}{100 * (plan - train) / train:>+7.1f}%", flush=True)
    errors = [abs(p_ - t) / t for p_, t in zip(planned, measured)]
    print(f"plan vs train: {len(errors)} layouts, median error {100 * statistics.median(errors):.1f}%, "
          f"worst {100 * max(errors):.1f}%, rank correlation {spearman(planned, measured):.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
