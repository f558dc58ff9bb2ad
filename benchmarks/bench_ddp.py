"""Step time of our BucketedDDP vs torch.nn.parallel.DistributedDataParallel, same model, same run.

Both wrap identical copies of a TinyGPT (default ~14.7M parameters, so that the gradient
all-reduce, ~59 MB per step, matters next to compute), see the same batches, use the same
bucket size, and run *alternately* step by step (who goes first alternates too), so drifts of
the machine hit both alike. A step
is forward + backward + synchronisation + AdamW; its time is the slowest rank's, median over the
steps after warm-up. ``ratio`` = ours / PyTorch (target: <= 1.10).

    python benchmarks/bench_ddp.py --quick
    python benchmarks/bench_ddp.py --world-sizes 2 4 --steps 20 --plot docs/img/ddp_timeline.png
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

import dtlib
from _timing import time_alternating  # benchmarks/_timing.py, beside this script
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.parallel import BucketedDDP, NaiveDDP


def worker(rank: int, world_size: int, cfg_kwargs: dict, batch: int, steps: int, warmup: int,
           bucket_mb: float, naive: bool) -> dict:
    cfg = tiny_gpt_config(**cfg_kwargs)
    impls = {}
    for name in ["BucketedDDP", "torch DDP"] + (["NaiveDDP"] if naive else []):
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        if name == "BucketedDDP":
            wrapped = BucketedDDP(model, bucket_size_mb=bucket_mb)
        elif name == "NaiveDDP":
            wrapped = NaiveDDP(model)
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        impls[name] = (wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4), name != "torch DDP")
    times = time_alternating({name: (m, opt, m if ours else None) for name, (m, opt, ours) in impls.items()},
                             cfg.vocab, cfg.seq, batch, rank, warmup, steps)
    rec = impls["BucketedDDP"][0].last_record
    # same data and weights: the two should agree to float rounding (bucket layouts may differ,
    # which changes the order in which the ring adds up more than two ranks' values)
    max_diff = max((a - b).abs().max().item() for a, b in zip(impls["BucketedDDP"][0].parameters(),
                                                              impls["torch DDP"][0].parameters()))
    return {"median": {n: statistics.median(t) for n, t in times.items()},
            "params": sum(p.numel() for p in impls["torch DDP"][0].parameters()),
            "buckets": len(impls["BucketedDDP"][0].buckets), "overlapped": rec.overlapped_buckets,
            "wait_after_backward_ms": 1e3 * (rec.finish_end - rec.backward_end),
            "max_weight_diff": max_diff, "record": rec}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--naive", action="store_true", help="also time NaiveDDP (one all-reduce per tensor)")
    p.add_argument("--quick", action="store_true", help="6 timed steps after 2 warm-up steps")
    p.add_argument("--plot", help="save the overlap timeline of our last step (largest world size)")
    a = p.parse_args()
    if a.quick:
        a.steps, a.warmup = 6, 2
    cfg = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab, seq=a.seq,
               tied_embeddings=True)
    print(f"TinyGPT {cfg}, {a.batch} sequences per rank, bucket {a.bucket_mb} MiB, gloo on CPU")
    last = None
    for ws in a.world_sizes:
        out = dtlib.launch(worker, ws, args=(cfg, a.batch, a.steps, a.warmup, a.bucket_mb, a.naive),
                           timeout=1800, output="none")[0]
        med = out["median"]
        print(f"\n{ws} ranks, {out['params'] / 1e6:.1f}M parameters, {out['buckets']} buckets "
              f"({out['overlapped']} issued before backward ended; waited "
              f"{out['wait_after_backward_ms']:.0f} ms after it); max |w_ours - w_torch| after the "
              f"run: {out['max_weight_diff']:.1e}")
        for name, t in med.items():
            print(f"  {name:<12} {1e3 * t:8.1f} ms/step   ratio vs torch DDP {t / med['torch DDP']:.3f}")
        last = out["record"]
    if a.plot and last is not None:
        from dtlib.viz.timeline import plot_overlap_timeline
        plot_overlap_timeline({f"BucketedDDP, {a.world_sizes[-1]} ranks": last}).savefig(a.plot, dpi=120)
        print(f"plot saved to {a.plot}")


if __name__ == "__main__":
    main()
