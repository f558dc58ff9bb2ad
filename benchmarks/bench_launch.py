"""Cost of starting ranks with a large object in ``fn``'s closure (a dataset, as a notebook has).

    python benchmarks/bench_launch.py [--quick] [--mib 179]

Forked ranks inherit the caller's objects, so ``dtlib.launch`` no longer serialises the payload in
fork mode. The reference, measured in the same run, is what it used to do first: one
``cloudpickle.dumps`` of ``(fn, args)`` (time and the bytes it allocates). The default payload is
the size of full MNIST's training images as float32 (60000 x 784 x 4 B = 179 MiB).
"""
from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import cloudpickle
import torch

from dtlib.launcher import launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=179.4, help="payload size in MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    args = parser.parse_args()
    repeats = 3 if args.quick else args.repeats
    big = torch.zeros(int(args.mib * 2 ** 20 / 4))

    def fn(rank: int, world_size: int) -> float:
        return float(big[rank])

    def empty(rank: int, world_size: int) -> int:
        return rank

    launch(empty, 2, timeout=60)  # the first launch pays for imports

    def median_launch(f) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            launch(f, 2, timeout=60, start_method="fork")
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    t_empty, t_big = median_launch(empty), median_launch(fn)
    tracemalloc.start()
    start = time.perf_counter()
    blob = cloudpickle.dumps((fn, ()))
    t_pickle = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"payload {args.mib:g} MiB in the closure, 2 forked ranks, median of {repeats}")
    print(f"launch, empty closure          {t_empty:8.3f} s")
    print(f"launch, payload in closure     {t_big:8.3f} s   ({t_big / t_empty:.2f} x empty)")
    print(f"reference: cloudpickle.dumps   {t_pickle:8.3f} s   {peak / 2 ** 20:6.0f} MiB allocated "
          f"({len(blob) / 2 ** 20:.0f} MiB of bytes): what each launch paid before, "
          f"{t_pickle / t_empty:.1f} x an empty launch")


if __name__ == "__main__":
    main()
