"""Step time of our tensor parallelism vs PyTorch's DTensor TP, same TinyGPT, same run.

Both split identical copies of a TinyGPT over all ranks (ours: ``dtlib.parallel.tensor_parallel``;
PyTorch's: ``parallelize_module`` with torchtitan's plan, ``dtlib.parallel.dtensor``), both
compute the loss on vocabulary-sharded logits (ours: ``vocab_parallel_cross_entropy``; PyTorch:
``loss_parallel()``), see the same batches and run *alternately* step by step (who goes first
alternates too). A step is forward + backward + AdamW; its time is the slowest rank's, median over
the steps after warm-up. ``ratio`` = ours / DTensor (target: <= 1.10).

Communication of our step: each collective's size is recorded (``dtlib.measure.CollectiveCounter``)
and its time measured by ``torch.profiler`` (the ``gloo:*`` events, i.e. the time gloo spent in
collectives); the prediction is ``dtlib.analytic.comm.collective_time`` of the same collectives on the
link fitted, as in lesson 2, to all-reduces timed on these ranks just before
(``dtlib.experiments.communication.fit_alpha_beta``).

    python benchmarks/bench_tensor_parallel.py --quick
    python benchmarks/bench_tensor_parallel.py --world-sizes 2 4 --steps 20
    python benchmarks/bench_tensor_parallel.py --sequence-parallel --position rope
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import dtlib
from _timing import time_alternating  # benchmarks/_timing.py, beside this script
from dtlib.analytic.comm import collective_time
from dtlib.experiments.communication import fit_alpha_beta, time_all_reduce
from dtlib.measure import CollectiveCounter
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.parallel import tensor_parallel, vocab_parallel_cross_entropy
from dtlib.parallel.dtensor import parallelize_tinygpt
from dtlib.parallel.tensor import allreduce_sequence_parallel_grads

PROFILED_STEPS = 3


def worker(rank: int, world_size: int, cfg_kwargs: dict, batch: int, steps: int, warmup: int,
           sequence_parallel: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    cfg = tiny_gpt_config(**cfg_kwargs)
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    ours = tensor_parallel(TinyGPT(cfg), sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    theirs = parallelize_tinygpt(TinyGPT(cfg), mesh, sequence_parallel=sequence_parallel,
                                 loss_parallel=True)

    def ours_backward(logits, y):
        vocab_parallel_cross_entropy(logits, y).backward()
        allreduce_sequence_parallel_grads(ours)

    def theirs_backward(logits, y):
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()

    impls = {"ours": (ours, torch.optim.AdamW(ours.parameters(), lr=1e-4), None, ours_backward),
             "DTensor": (theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-4), None,
                         theirs_backward)}
    # rank=0 for every rank: a tensor-parallel group sees the same tokens
    times = time_alternating(impls, cfg.vocab, cfg.seq, batch, 0, warmup, steps)

    tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=torch.Generator().manual_seed(0))
    with CollectiveCounter() as log, profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            ours_backward(ours(tokens[:, :-1]), tokens[:, 1:])
    gloo_us = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith("gloo:"))
    return {"median": {k: statistics.median(v) for k, v in times.items()},
            "calls": log.calls[:len(log.calls) // PROFILED_STEPS],
            "comm_measured": gloo_us / 1e6 / PROFILED_STEPS,
            "params": sum(p.numel() for p in TinyGPT(cfg).parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4, help="sequences per step (every TP rank sees them)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--position", choices=["learned", "rope"], default="learned")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="time both with sequence parallelism (needs --position rope)")
    p.add_argument("--quick", action="store_true", help="6 timed steps after 2 warm-up steps, 2 layers")
    a = p.parse_args()
    if a.quick:
        a.steps, a.warmup, a.layers = 6, 2, 2
    for name in ("layers", "hidden", "heads", "vocab", "seq", "batch", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0 or min(a.world_sizes) < 2:
        p.error("--warmup must be >= 0 and every --world-sizes entry >= 2 (TP needs two ranks)")
    if a.sequence_parallel and a.position != "rope":
        p.error("--sequence-parallel needs --position rope: DTensor's SequenceParallel plan cannot "
                "add TinyGPT's learned position table (a plain tensor) to the sharded sequence")
    cfg = dict(layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab, seq=a.seq,
               position=a.position)
    try:  # the TP divisibility rules, checked before any process starts
        tiny_gpt_config(**cfg)
        for ws in a.world_sizes:
            for field in ("heads", "vocab") + (("seq",) if a.sequence_parallel else ()):
                if cfg[field] % ws:
                    raise ValueError(f"--{field} ({cfg[field]}) must be divisible by every world "
                                     f"size; {ws} does not divide it")
    except ValueError as e:
        p.error(str(e))
    print(f"TinyGPT {cfg}, {a.batch} sequences per step, sequence_parallel={a.sequence_parallel}, "
          f"gloo on CPU")
    for ws in a.world_sizes:
        rows = time_all_reduce([2 ** k for k in range(16, 23)], world_size=ws, iters=10)
        link = fit_alpha_beta(rows, "built-in (dist.all_reduce)")
        out = dtlib.launch(worker, ws, args=(cfg, a.batch, a.steps, a.warmup, a.sequence_parallel),
                           timeout=1800, output="none")[0]
        med = out["median"]
        predicted = sum(collective_time(op, size, ws, link) for op, size in out["calls"])
        kinds = sorted({op for op, _ in out["calls"]})
        print(f"\n{ws} ranks, {out['params'] / 1e6:.1f}M parameters; fitted link "
              f"{link.bandwidth / 1e9:.2f} GB/s, {link.latency * 1e6:.0f} us per step")
        for name, t in med.items():
            print(f"  {name:<8} {1e3 * t:8.1f} ms/step   ratio vs DTensor {t / med['DTensor']:.3f}")
        print(f"  our communication per step: {len(out['calls'])} collectives ({', '.join(kinds)}), "
              f"measured {1e3 * out['comm_measured']:.1f} ms, predicted {1e3 * predicted:.1f} ms "
              f"(ratio {out['comm_measured'] / predicted:.2f})")


if __name__ == "__main__":
    main()
