"""The planner's search against the issue's budgets: a 10B-class model on 10,000 GPUs under 1 s, an
MoE model (DeepSeek-V3) on 2,048 GPUs under 5 s.

    python benchmarks/bench_plan_search.py [--repeats 5] [--moe-gpu h100-sxm]

Each search is what ``dtlib plan`` runs (every valid layout, its memory, the step times of the
fitting ones, the top 5), timed as the best of ``--repeats`` on this machine (the machine may be
shared: the best run is the one least disturbed). For each it prints the size of the grid:
``candidates`` (layouts of the product that divide the GPUs and the global batch), ``searched``
(valid layouts x recompute options) and ``fitting``. DeepSeek-V3 trained on 2,048 H800s
(DeepSeek-AI 2024, Sec. 3.1) at a global batch of 15,360 sequences of 4,096 tokens (Sec. 4.2); the
GPU's numbers change the ranking, not the work of the search (``--moe-gpu``).
"""
from __future__ import annotations

import argparse
import os
import platform

from dtlib.analytic.hardware import cluster
from dtlib.analytic.presets import get_preset
from dtlib.plan.search import search

# (label, preset, GPUs, global batch in sequences, budget in seconds): the two targets
CASES = (("10B-class dense", "capstone-10b", 10_000, 5_000, 1.0),
         ("MoE", "deepseek-v3", 2_048, 15_360, 5.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--moe-gpu", default="h100-sxm", help="GPU of the MoE case (DeepSeek-V3 used H800s)")
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores")
    for label, preset, gpus, batch, budget in CASES:
        model = get_preset(preset)
        gpu = args.moe_gpu if model.moe_experts else "h100-sxm"
        c = cluster(gpu, gpus // 8, 8)
        search(model, c, batch, top=1)  # warm-up (imports, numpy caches)
        runs = [search(model, c, batch, top=5) for _ in range(args.repeats)]
        best = min(r.seconds for r in runs)
        r = runs[0]
        top = r.configs[0]
        layout = " ".join(f"{k}={top[k]}" for k in ("dp", "tp", "pp", "cp", "ep", "etp", "virtual_stages",
                                                     "micro_batch", "zero", "recompute"))
        print(f"{label}: {model.name} ({model.num_parameters() / 1e9:.1f}B, "
              f"{model.active_parameters() / 1e9:.1f}B active) on {gpus:,} {gpu} ({c.nodes} nodes x 8), "
              f"global batch {batch:,}")
        print(f"  grid: {r.candidates:,} candidates, {r.searched:,} valid (x recompute), {r.fitting:,} fitting")
        print(f"  search (top 5), best of {args.repeats}: {best:.3f} s "
              f"(all: {', '.join(f'{x.seconds:.3f}' for x in runs)}); budget {budget:g} s: "
              f"{'met' if best < budget else 'NOT met'}")
        print(f"  fastest: {layout}, {top['step_time_s']:.2f} s per step, MFU {top['mfu']:.1%}")


if __name__ == "__main__":
    main()
