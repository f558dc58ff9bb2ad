"""ZeRO-1/2 and the toy FSDP: memory per rank, exactness, and step time vs PyTorch's own, one run.

Three parts, each on real ranks (gloo on CPU):

1. Model states per rank (:func:`dtlib.experiments.zero.measure_zero_stages`): bytes of
   parameters, gradients (held after the gradient synchronisation) and AdamW state that each
   rank holds under DDP (unsharded), ZeRO-1, ZeRO-2 and the toy FSDP, the ratio of the optimizer
   state to 1/N of the unsharded one, :func:`dtlib.analytic.memory.memory_per_gpu`'s prediction, and the
   largest difference of the final weights from one process doing the same training
   (:func:`~dtlib.experiments.zero.single_process_final`).
2. Peak parameter memory of the toy FSDP vs ``fully_shard`` (FSDP2) vs dtlib.analytic.memory's ZeRO-3
   model (:func:`~dtlib.experiments.zero.compare_fully_shard`; PyTorch's side is measured by its
   ``FSDPMemTracker`` at the moment of its peak total memory), and the largest weight difference.
3. Step time (forward + backward + synchronisation + AdamW; slowest rank, median over the steps
   after warm-up; implementations alternate step by step, who goes first too) of ours vs
   PyTorch's: ZeRO-1 (BucketedDDP + ShardedOptimizer) vs DDP + ``ZeroRedundancyOptimizer``,
   toy FSDP vs ``fully_shard``, and our ZeRO-2 (PyTorch has none; shown next to its ZeRO-1).
   ``ratio`` = ours / PyTorch's.

    python benchmarks/bench_zero_fsdp.py --quick
    python benchmarks/bench_zero_fsdp.py --world-size 2 --steps 20
"""
from __future__ import annotations

import argparse
import statistics

import torch

import dtlib
from _timing import time_alternating  # benchmarks/_timing.py, beside this script
from dtlib.experiments.zero import (compare_fully_shard, measure_zero_stages, predict_zero_stages,
                                    setup_stage, setup_torch_stage)
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.models.gpt import Block

STAGES = {0: "DDP (unsharded)", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP (ZeRO-3)"}
# (label, implementation, ZeRO stage); PyTorch's counterparts from setup_torch_stage
TIMED = [("ZeRO-1", "ours", 1), ("ZeRO-1", "torch", 1), ("ZeRO-2", "ours", 2),
         ("FSDP", "ours", 3), ("FSDP", "torch", 3)]


# ---- 1 and 2: memory and exactness -------------------------------------------------------------
def model_states(world_size: int, cfg, steps: int, batch: int) -> None:
    out = measure_zero_stages(world_size, stages=tuple(STAGES), cfg=cfg, steps=steps, batch=batch)
    n_params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    unsharded_opt = out[0]["per_rank"][0]["optimizer"]
    print(f"\n1. Model states per rank: TinyGPT {n_params:,} parameters, {world_size} ranks, fp32 AdamW, "
          f"{steps} steps (bytes; max over ranks; 'predicted' = dtlib.analytic.memory.memory_per_gpu)")
    print(f"{'':<17}{'params':>10}{'grads held':>12}{'predicted':>11}{'optimizer':>11}{'predicted':>11}"
          f"{'opt / (unsharded/N)':>21}{'max |w - 1 process|':>21}")
    for z, name in STAGES.items():
        row = out[z]
        per_rank = row["per_rank"]
        worst = {k: max(r[k] for r in per_rank) for k in ("parameters", "gradients", "optimizer")}
        pred = row["predicted"]
        ratio = worst["optimizer"] / (unsharded_opt / world_size)
        print(f"{name:<17}{worst['parameters']:>10,}{worst['gradients']:>12,}{pred['gradients']:>11,.0f}"
              f"{worst['optimizer']:>11,}{pred['optimizer']:>11,.0f}{ratio:>21.3f}"
              f"{row['max_diff_vs_single']:>21.1e}")


def fsdp_peak(world_size: int, cfg, steps: int, batch: int) -> None:
    cmp = compare_fully_shard(world_size, cfg=cfg, steps=steps, batch=batch)
    pred = predict_zero_stages(cfg, world_size, stages=(3,))[3]
    ours, theirs = cmp["ours"], cmp["torch"]
    unit = pred["temporary"] / 2  # dtlib.analytic.memory's temporary = one unit's parameters + gradients
    model = TinyGPT(cfg)
    in_blocks = sum(p.numel() for m in model.modules() if isinstance(m, Block) for p in m.parameters())
    root = sum(p.numel() for p in model.parameters()) - in_blocks
    print(f"\n2. Peak parameter memory per rank, toy FSDP vs fully_shard vs dtlib.analytic.memory (ZeRO-3), "
          f"{world_size} ranks, one unit per block + root (bytes)")
    print(f"{'':<34}{'sharded':>10}{'unsharded at peak':>19}{'all-gather buffers':>20}{'total':>10}")
    rows = [("toy FSDP (measured)", ours["sharded_param_bytes"], ours["peak_unsharded_bytes"], 0),
            ("fully_shard (FSDPMemTracker)", theirs["SHARDED_PARAM"], theirs["UNSHARDED_PARAM"],
             theirs["ALL_GATHER"]),
            ("dtlib.analytic.memory (one unit gathered)", pred["parameters"], unit, 0)]
    for name, sharded, unsharded, gather in rows:
        print(f"{name:<34}{sharded:>10,.0f}{unsharded:>19,.0f}{gather:>20,.0f}"
              f"{sharded + unsharded + gather:>10,.0f}")
    print(f"toy - dtlib.analytic.memory = {ours['peak_param_bytes'] - pred['parameters'] - unit:,.0f} B; the root "
          f"unit ({root:,} parameters, {4 * root:,} B unpadded) stays gathered while a block is")
    print(f"max |w_toy - w_fully_shard| after {steps} AdamW steps: {cmp['max_param_diff']:.1e}")


# ---- 3: step time --------------------------------------------------------------------------------
def _full_params(model, impl: str, stage: int) -> list[torch.Tensor]:
    if stage == 3:  # both collectives: every rank calls them
        state = model.gather_full_params() if impl == "ours" else \
            {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        state = (model.module if hasattr(model, "module") else model).state_dict()
    return [t for t in state.values() if t.is_floating_point()]


def timing_worker(rank: int, world_size: int, cfg_kwargs: dict, batch: int, steps: int,
                  warmup: int) -> dict:
    cfg = tiny_gpt_config(**cfg_kwargs)
    impls = {}
    for label, impl, stage in TIMED:
        torch.manual_seed(0)
        if impl == "ours":
            model, opt, sync = setup_stage(stage, TinyGPT(cfg))
        else:
            (model, opt), sync = setup_torch_stage(stage, TinyGPT(cfg)), None
        impls[(label, impl)] = (model, opt, sync, stage)
    times = time_alternating({k: (m, opt, sync) for k, (m, opt, sync, _) in impls.items()},
                             cfg.vocab, cfg.seq, batch, rank, warmup, steps)
    finals = {k: _full_params(m, k[1], stage) for k, (m, _, _, stage) in impls.items()}
    ref = {"ZeRO-1": finals[("ZeRO-1", "torch")], "ZeRO-2": finals[("ZeRO-1", "torch")],
           "FSDP": finals[("FSDP", "torch")]}
    return {"median": {k: statistics.median(t) for k, t in times.items()},
            "params": sum(p.numel() for p in TinyGPT(cfg).parameters()),
            "max_diff": {k: max((a - b).abs().max().item() for a, b in zip(f, ref[k[0]]))
                         for k, f in finals.items() if k[1] == "ours"}}


def step_times(world_size: int, cfg_kwargs: dict, batch: int, steps: int, warmup: int) -> None:
    out = dtlib.launch(timing_worker, world_size, args=(cfg_kwargs, batch, steps, warmup),
                       timeout=1800, output="none")[0]
    med = out["median"]
    print(f"\n3. Step time, TinyGPT {out['params'] / 1e6:.1f}M parameters {cfg_kwargs}, {batch} sequences "
          f"per rank, {world_size} ranks, median of {steps} steps after {warmup} warm-up")
    print(f"{'':<8}{'ours ms':>10}{'PyTorch ms':>12}{'ratio':>8}  {'PyTorch':<36}{'max |w_ours - w_torch|':>24}")
    for label, torch_name in (("ZeRO-1", "DDP + ZeroRedundancyOptimizer"),
                              ("ZeRO-2", "(none; its ZeRO-1 shown)"), ("FSDP", "fully_shard")):
        t_ours = med[(label, "ours")]
        t_torch = med[(label if label != "ZeRO-2" else "ZeRO-1", "torch")]
        print(f"{label:<8}{1e3 * t_ours:>10.1f}{1e3 * t_torch:>12.1f}{t_ours / t_torch:>8.3f}  "
              f"{torch_name:<36}{out['max_diff'][(label, 'ours')]:>24.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--mem-layers", type=int, default=3, help="memory model (parts 1 and 2)")
    p.add_argument("--mem-hidden", type=int, default=32)
    p.add_argument("--mem-vocab", type=int, default=64)
    p.add_argument("--mem-steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=4, help="timed model (part 3)")
    p.add_argument("--hidden", type=int, help="default 512 (256 with --quick)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per timed step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true",
                   help="timed model hidden 256 unless given, 6 timed steps after 2 warm-up steps")
    a = p.parse_args()
    if a.quick:
        a.steps, a.warmup = 6, 2
    a.hidden = a.hidden or (256 if a.quick else 512)
    # the memory model of docs/parallel.md's table (40,736 parameters for the defaults)
    mem_cfg = tiny_gpt_config(layers=a.mem_layers, hidden=a.mem_hidden, heads=2, vocab=a.mem_vocab,
                              seq=16, tied_embeddings=True)
    print(f"gloo on CPU ({torch.get_num_threads()} threads in this process)")
    model_states(a.world_size, mem_cfg, a.mem_steps, batch=8)
    fsdp_peak(a.world_size, mem_cfg, a.mem_steps, batch=8)
    step_times(a.world_size, dict(layers=a.layers, hidden=a.hidden, heads=a.heads, vocab=a.vocab,
                                  seq=a.seq, tied_embeddings=True), a.batch, a.steps, a.warmup)


if __name__ == "__main__":
    main()
