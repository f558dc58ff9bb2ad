"""The planner's search: the whole search for a 10B model on 10,000 GPUs, against the scalar path.

    python benchmarks/bench_plan.py [--quick] [--model capstone-10b] [--gpus 10000] [--global-batch 5000]

Times :func:`dtlib.plan.search.search` (every valid layout, memory fit, step time, ranking, the
top 5 as ``dtlib plan`` prints them; best of ``--repeats``), and as the reference, in the same run, the scalar path
(:class:`Parallelism` + :func:`memory_per_gpu` + :func:`step_time` per layout) on a random sample
of the same candidates, extrapolated to all of them; it also checks both paths agree on the
sample. The issue's target: under 1 s on a 2-core machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import time

from dtlib.analytic.hardware import cluster
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.presets import get_preset
from dtlib.plan.search import search, to_layout
from dtlib.plan.steptime import step_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="capstone-10b")
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=5_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sample", type=int, default=300, help="layouts timed on the scalar path")
    ap.add_argument("--quick", action="store_true", help="2 repeats, 50 scalar layouts")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.sample = 2, 50
    model = get_preset(args.model)
    c = cluster("h100-sxm", args.gpus // args.gpus_per_node, args.gpus_per_node)
    search(model, c, args.global_batch, top=1)  # warm-up (imports, numpy caches)
    times = []
    for _ in range(args.repeats):
        r = search(model, c, args.global_batch, top=5)  # what ``dtlib plan`` runs
        times.append(r.seconds)
    vector = min(times)
    everything = search(model, c, args.global_batch, top=10 ** 9)  # every fitting layout, as rows

    rng = random.Random(0)
    sample = rng.sample(everything.configs, min(args.sample, len(everything.configs)))
    start = time.perf_counter()
    worst = 0.0
    for row in sample:
        layout = to_layout(row)
        mem = memory_per_gpu(model, layout, precision="megatron-bf16").total  # the default stack's
        t = step_time(model, layout, c).step_time
        worst = max(worst, abs(t / row["step_time_s"] - 1), abs(mem / row["memory_per_gpu_bytes"] - 1))
    per_layout = (time.perf_counter() - start) / len(sample)
    scalar = per_layout * r.searched  # every valid (layout, recompute) pair: one scalar evaluation

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    print(f"{model.name} ({model.num_parameters() / 1e9:.1f}B) on {args.gpus:,} GPUs ({c.nodes} nodes x "
          f"{args.gpus_per_node}), global batch {args.global_batch:,}")
    print(f"valid layouts searched: {r.searched:,}; fitting: {r.fitting:,}")
    print(f"vectorised search (top 5), best of {args.repeats}: {vector:.3f} s "
          f"(all repeats: {', '.join(f'{t:.3f}' for t in times)})")
    print(f"vectorised search returning all {len(everything.configs):,} fitting layouts as rows: "
          f"{everything.seconds:.3f} s")
    print(f"scalar path: {per_layout * 1e3:.2f} ms per layout on {len(sample)} sampled layouts -> "
          f"{scalar:.1f} s for all of them (extrapolated)")
    print(f"speed-up of the vectorised search: {scalar / vector:.0f}x")
    print(f"largest relative difference between the paths on the sample: {worst:.1e}")
    print(f"target under 1 s: {'met' if vector < 1 else 'NOT met'}")


if __name__ == "__main__":
    main()
