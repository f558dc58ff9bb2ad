"""Bandwidth of our ring collectives vs the backend's own, in the same run (nccl-tests metrics).

For each message size (1 KiB .. 64 MiB of float32) and collective, time ``--iters`` calls after
``--warmup`` and report, as nccl-tests does (doc/PERFORMANCE.md): time = median over iterations of
the slowest rank, algbw = S / time, busbw = algbw x (2(n-1)/n for all-reduce, (n-1)/n for
reduce-scatter and all-gather), computed by :mod:`dtlib.analytic.comm`. ``ratio`` = ours / built-in busbw.

    python benchmarks/bench_collectives.py --quick
    python benchmarks/bench_collectives.py --world-size 4 --plot docs/img/busbw.png
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import dtlib
from dtlib.analytic.comm import algbw, busbw
from dtlib.parallel import collectives as C

# (collective, ours, built-in), each a function of (full buffer, rank's shard) for one call
CASES = {
    "all_reduce": (lambda full, shard: C.ring_all_reduce(full),
                   lambda full, shard: dist.all_reduce(full)),
    "reduce_scatter": (lambda full, shard: C.ring_reduce_scatter(full),
                       lambda full, shard: C.reduce_scatter_into(shard, full)),
    "all_gather": (lambda full, shard: C.ring_all_gather(shard),
                   lambda full, shard: C.all_gather_into(full, shard)),
}


def _time(fn, full, shard, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn(full, shard)
    times = torch.zeros(iters)
    for i in range(iters):
        dist.barrier()
        start = time.perf_counter()
        fn(full, shard)
        times[i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return statistics.median(times.tolist())


def worker(rank: int, world_size: int, sizes: list[int], collectives: list[str], warmup: int,
           iters: int) -> list[dict]:
    rows = []
    for name in collectives:
        ours, builtin = CASES[name]
        for nbytes in sizes:
            numel = nbytes // 4 // world_size * world_size  # equal shards for the built-ins
            full = torch.randn(numel)
            shard = torch.randn(numel // world_size)
            # fewer iterations for the big sizes, so that the sweep stays short
            n_iter = max(5, min(iters, int(iters * 2 ** 22 / max(nbytes, 1))))
            for impl, fn in (("ring (ours)", ours), ("built-in", builtin)):
                t = _time(fn, full, shard, warmup, n_iter)
                rows.append({"collective": name, "impl": impl, "bytes": numel * 4, "seconds": t,
                             "algbw": algbw(numel * 4, t), "busbw": busbw(name, numel * 4, t, world_size),
                             "world_size": world_size})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=64 * 2 ** 20)
    p.add_argument("--factor", type=int, default=4, help="size step between measurements")
    p.add_argument("--collectives", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="2 ranks, 1 KiB..64 MiB by 16x, fewer iterations")
    p.add_argument("--plot", help="save the busbw plot (one panel per collective) to this path")
    p.add_argument("--json", help="save the rows to this path")
    a = p.parse_args()
    if a.quick:
        a.world_size, a.factor, a.iters, a.warmup = 2, 16, 5, 1
    sizes, s = [], a.min_bytes
    while s <= a.max_bytes:
        sizes.append(s)
        s *= a.factor
    rows = dtlib.launch(worker, a.world_size, args=(sizes, a.collectives, a.warmup, a.iters),
                        timeout=1800, output="none")[0]
    print(f"{a.world_size} ranks, gloo on CPU ({torch.get_num_threads()} threads in this process)")
    print("algbw, busbw in GB/s; ratio = ours / built-in busbw")
    print(f"{'collective':<15}{'bytes':>10}{'ours ms':>10}{'algbw':>8}{'busbw':>8}{'built-in ms':>13}"
          f"{'algbw':>8}{'busbw':>8}{'ratio':>7}")
    for i in range(0, len(rows), 2):
        o, b = rows[i], rows[i + 1]
        print(f"{o['collective']:<15}{o['bytes']:>10}{1e3 * o['seconds']:>10.3f}{o['algbw'] / 1e9:>8.3f}"
              f"{o['busbw'] / 1e9:>8.3f}{1e3 * b['seconds']:>13.3f}{b['algbw'] / 1e9:>8.3f}"
              f"{b['busbw'] / 1e9:>8.3f}{o['busbw'] / b['busbw']:>7.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.plot:  # one panel per collective
        from dtlib.viz.comm import plot_bandwidth
        plot_bandwidth(rows).savefig(a.plot, dpi=120)
        print(f"plot saved to {a.plot}")


if __name__ == "__main__":
    main()
