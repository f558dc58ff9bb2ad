"""Our pipeline executor vs ``torch.distributed.pipelining`` on the same stages of the same TinyGPT.

For each schedule (GPipe, 1F1B, interleaved 1F1B with 2 chunks per rank, and ZB-H1 against
PyTorch's ``ScheduleInterleavedZeroBubble`` with one stage per rank, the same "1F1B with deferred
W" idea), on 2 and 4 gloo ranks: the loss of the first and the last step (both start from the same
weights and see the same batches), the largest weight difference after the last step (any rank), and the step time
(forward + backward of all micro-batches + AdamW; slowest rank; median over the steps after
warm-up; the two implementations alternate step by step, who goes first too). ``ratio`` = ours /
PyTorch's.

    python benchmarks/bench_pipeline.py --quick
    python benchmarks/bench_pipeline.py --world-sizes 2 4 --steps 10
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)

import dtlib
from dtlib.models import TinyGPT, tiny_gpt_config
from dtlib.parallel import PipelineExecutor, partition, rank_chunks, schedule

# (our schedule name, chunks per rank, PyTorch's schedule class)
SCHEDULES = [("gpipe", 1, ScheduleGPipe), ("1f1b", 1, Schedule1F1B),
             ("interleaved", 2, ScheduleInterleaved1F1B), ("zb-h1", 1, ScheduleInterleavedZeroBubble)]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _Ours:
    def __init__(self, chunks, name, p, m, v, rank):
        self.ex = PipelineExecutor(chunks, schedule(name, p, m, v), rank, _loss)

    def step(self, x, y):
        return self.ex.step(x, y).loss


class _Torch:
    def __init__(self, chunks, cls, p, m, v, rank):
        stages = [PipelineStage(c, rank + k * p, p * v, torch.device("cpu")) for k, c in enumerate(chunks)]
        self.sched = cls(stages if v > 1 or cls is ScheduleInterleavedZeroBubble else stages[0],
                         n_microbatches=m, loss_fn=_loss)
        self.first, self.last = rank == 0, rank == p - 1

    def step(self, x, y):
        losses: list[torch.Tensor] = []
        self.sched.step(*([x] if self.first else []), **({"target": y, "losses": losses} if self.last else {}))
        return sum(loss.item() for loss in losses) / len(losses) if self.last else None


def worker(rank: int, world_size: int, cfg_kwargs: dict, batch: int, m: int, steps: int, warmup: int) -> list[dict]:
    p = world_size
    cfg = tiny_gpt_config(**cfg_kwargs)
    g = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    rows = []
    for name, v, cls in SCHEDULES:
        impls = {}
        for who, make in (("ours", lambda c: _Ours(c, name, p, m, v, rank)),
                          ("torch", lambda c: _Torch(c, cls, p, m, v, rank))):
            torch.manual_seed(0)
            chunks = rank_chunks(partition(TinyGPT(cfg), p, v), rank, p)
            params = [q for c in chunks for q in c.parameters()]
            impls[who] = (make(chunks), torch.optim.AdamW(params, lr=1e-3), params)
        times: dict[str, list[float]] = {k: [] for k in impls}
        losses: dict[str, list] = {k: [] for k in impls}
        for i, (x, y) in enumerate(batches):
            for who in (list(impls) if i % 2 == 0 else list(reversed(impls))):
                runner, opt, _ = impls[who]
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                loss = runner.step(x, y)
                opt.step()
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                if i in (0, len(batches) - 1):
                    losses[who].append(loss)
                if i >= warmup:
                    times[who].append(elapsed.item())
        diff = max((a - b).abs().max().item() for a, b in zip(impls["ours"][2], impls["torch"][2]))
        rows.append({"schedule": name, "v": v, "torch": cls.__name__, "loss": losses,
                     "max_diff": diff, "median": {k: statistics.median(t) for k, t in times.items()}})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4], help="pipeline ranks (2..8)")
    ap.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (a multiple of each world size)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    ap.add_argument("--quick", action="store_true", help="small model, 3 timed steps")
    args = ap.parse_args()
    for p in args.world_sizes:
        if not 2 <= p <= 8:
            ap.error(f"--world-sizes must be in 2..8, got {p}")
        if args.microbatches % p:
            ap.error(f"--microbatches must be a multiple of every world size (interleaved), got "
                     f"{args.microbatches} for {p}")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    cfg = dict(layers=8, hidden=64, heads=4, vocab=256, seq=32) if args.quick else \
        dict(layers=8, hidden=128, heads=4, vocab=256, seq=64)
    steps, warmup = (3, 1) if args.quick else (args.steps, args.warmup)
    batch = 2 * args.microbatches
    n = sum(q.numel() for q in TinyGPT(tiny_gpt_config(**cfg)).parameters())
    print(f"TinyGPT {cfg} ({n:,} parameters), batch {batch} in {args.microbatches} micro-batches, "
          f"{steps} timed steps after {warmup}; gloo on CPU")
    for p in args.world_sizes:
        per_rank = dtlib.launch(worker, p, args=(cfg, batch, args.microbatches, steps, warmup),
                                timeout=1800, output="none")
        rows = per_rank[-1]  # the last stage has the loss; times are all-reduced already
        for i, r in enumerate(rows):
            r["max_diff"] = max(other[i]["max_diff"] for other in per_rank)
        print(f"\n{p} ranks")
        print(f"{'ours':<17}{'torch.distributed.pipelining':<31}{'loss first -> last':>19}"
              f"{'torch':>19}{'max |w diff|':>13}{'ours ms':>9}{'torch ms':>9}{'ratio':>7}")
        for r in rows:
            ours, theirs = r["median"]["ours"], r["median"]["torch"]
            label = r["schedule"] + (f" v={r['v']}" if r["v"] > 1 else "")
            ours_loss, torch_loss = (" -> ".join(f"{x:.5f}" for x in r["loss"][k]) for k in ("ours", "torch"))
            print(f"{label:<17}{r['torch']:<31}{ours_loss:>19}{torch_loss:>19}"
                  f"{r['max_diff']:>13.1e}{1e3 * ours:>9.1f}{1e3 * theirs:>9.1f}{ours / theirs:>7.2f}")


if __name__ == "__main__":
    main()
