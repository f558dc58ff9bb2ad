"""Configurations per second of the analytic core: scalar path vs vectorised (numpy) path.

    python benchmarks/bench_analytic.py [--n 200000] [--model llama3-70b]

The planner sweeps layouts (dp, tp, pp, cp, ZeRO stage, micro-batching) for a fixed model and a few
categorical options; this times exactly that sweep, and checks the two paths agree on a sample.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from dtlib.analytic.flops import flops_report
from dtlib.analytic.memory import memory_per_gpu
from dtlib.models import get_preset
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.vectorised import flops_batch, memory_batch


def random_layouts(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return dict(dp=rng.choice([1, 2, 4, 8, 16, 32, 64], n), tp=rng.choice([1, 2, 4, 8], n),
                pp=rng.choice([1, 2, 4, 8], n), cp=rng.choice([1, 2], n), zero=rng.integers(0, 4, n),
                micro_batch_size=rng.choice([1, 2, 4], n), num_microbatches=rng.choice([1, 8, 32], n))


def _rate(fn, count: int) -> float:
    start = time.perf_counter()
    fn()
    return count / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000, help="configurations for the vectorised path")
    ap.add_argument("--scalar-n", type=int, default=2_000, help="configurations for the scalar path")
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--quick", action="store_true", help="20,000 vectorised / 500 scalar configurations")
    args = ap.parse_args()
    if args.quick:
        args.n, args.scalar_n = 20_000, 500
    cfg = get_preset(args.model)
    opts = dict(recompute="selective", schedule="1f1b")
    big, small = random_layouts(args.n), random_layouts(args.scalar_n, seed=1)
    rows = [{k: int(v[i]) for k, v in small.items()} for i in range(args.scalar_n)]

    def scalar_memory():
        for kw in rows:
            memory_per_gpu(cfg, Parallelism(**kw, **opts))

    # a step time every sampled layout can reach (shorter than the FLOPs allow is an error)
    step_time = 1e5

    def scalar_flops():
        for kw in rows:
            flops_report(cfg, kw["dp"] * kw["micro_batch_size"] * kw["num_microbatches"], step_time=step_time,
                         gpus=kw["dp"] * kw["tp"] * kw["pp"] * kw["cp"])

    batch = big["dp"] * big["micro_batch_size"] * big["num_microbatches"]
    gpus = big["dp"] * big["tp"] * big["pp"] * big["cp"]
    results = {
        "memory, scalar": _rate(scalar_memory, args.scalar_n),
        "memory, vectorised": _rate(lambda: memory_batch(cfg, **opts, **big), args.n),
        "flops, scalar": _rate(scalar_flops, args.scalar_n),
        "flops, vectorised": _rate(lambda: flops_batch(cfg, batch=batch, step_time=step_time, gpus=gpus), args.n),
    }
    # the two paths agree (same formulas)
    out = memory_batch(cfg, **opts, **small)
    assert np.allclose(out["total"][:50], [memory_per_gpu(cfg, Parallelism(**kw, **opts)).total for kw in rows[:50]])
    print(f"{args.model}: configurations per second")
    for name, rate in results.items():
        print(f"  {name:<20} {rate:14,.0f}")
    print(f"  vectorised / scalar: memory x{results['memory, vectorised'] / results['memory, scalar']:,.0f}, "
          f"flops x{results['flops, vectorised'] / results['flops, scalar']:,.0f}")


if __name__ == "__main__":
    main()
