"""Tokens/s of `dtlib train` against a PyTorch-native composition of the same layout, same run.

Layouts (4 ranks, gloo on CPU, the same TinyGPT and byte batches, AdamW):

* ``dp2xtp2``: ours = ``dtlib.trainer`` with dp=2, tp=2 and ZeRO-1 (``ShardedOptimizer`` over the
  data-parallel group, our Megatron-style tensor parallelism); PyTorch = torchtitan's composition:
  DTensor TP (``parallelize_module`` with torchtitan's plan, ``dtlib.parallel.dtensor``) on the
  ``tp`` dimension of a 2-D ``DeviceMesh``, then FSDP2 ``fully_shard`` of every block and the root
  on its ``dp`` dimension (ZeRO-3: it shards the parameters too, ours only the optimizer state);
* ``tp2xpp2``: ours = tp=2, pp=2, 1F1B over 2 micro-batches (our executor); PyTorch = DTensor TP
  on the ``tp`` dimension and ``torch.distributed.pipelining`` (``PipelineStage`` per rank on the
  ``pp`` dimension's group, ``Schedule1F1B``) on the same stages of the same TinyGPT;
* ``dp4-fsdp``: ours = dp=4 with the toy FSDP (``--zero 3``); PyTorch = ``fully_shard``.

(The tensor-parallel comparison follows ``benchmarks/bench_tensor_parallel.py``, the pipeline
one ``benchmarks/bench_pipeline.py``; this one composes them.) Both run *alternately*, step by step, in one launch; a step is forward + backward + gradient
synchronisation + AdamW, timed as the slowest rank's; tokens/s = global batch x seq / median step.
``ratio`` = ours / PyTorch tokens/s (the issue's target: ours within 15%, ratio >= 0.85).

    python benchmarks/bench_train.py --quick
    python benchmarks/bench_train.py --steps 20 --hidden 128 --layers 4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import dtlib
from dtlib.corpus import token_batch
from dtlib.models import TinyGPT
from dtlib.parallel.dtensor import parallelize_tinygpt
from dtlib.parallel.pipeline import partition, rank_chunks
from dtlib.trainer import TrainConfig, _Run

LAYOUTS = {"dp2xtp2": dict(dp=2, tp=2, zero=1), "tp2xpp2": dict(tp=2, pp=2, num_microbatches=2),
           "dp4-fsdp": dict(dp=4, zero=3)}


class _TorchNative:
    """TinyGPT composed with PyTorch's own parallelisms on a (pp, dp, tp) device mesh: DTensor TP,
    then either ``torch.distributed.pipelining`` stages or FSDP2 ``fully_shard`` over dp."""

    def __init__(self, config: TrainConfig):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.config = config
        mesh = init_device_mesh("cpu", (config.pp, config.dp, config.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.dp_rank, self.pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
        torch.manual_seed(config.seed)
        model = TinyGPT(config.model_config())
        if config.tp > 1:  # logits as a DTensor sharded on the vocabulary unless a pipeline follows
            model = parallelize_tinygpt(model, mesh["tp"], loss_parallel=config.pp == 1)
        if config.pp > 1:
            chunk = rank_chunks(partition(model, config.pp), self.pp_rank, config.pp)[0]
            stage = PipelineStage(chunk, self.pp_rank, config.pp, torch.device("cpu"),
                                  group=mesh["pp"].get_group())
            self.schedule = Schedule1F1B(stage, n_microbatches=config.num_microbatches, loss_fn=_loss)
            params = list(chunk.parameters())
        else:
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            params = list(model.parameters())
        self.model, self.opt = model, torch.optim.AdamW(params, lr=config.lr)

    def step(self, step: int) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        c = self.config
        inputs, targets = token_batch(step, c.global_batch, c.seq, c.seed)
        per_replica = c.micro_batch_size * c.num_microbatches
        rows = slice(self.dp_rank * per_replica, (self.dp_rank + 1) * per_replica)
        x, y = inputs[rows], targets[rows]
        if c.pp > 1:
            first, last = self.pp_rank == 0, self.pp_rank == c.pp - 1
            self.schedule.step(*([x] if first else []), **({"target": y} if last else {}))
        elif c.tp > 1:
            with loss_parallel():
                _loss(self.model(x), y).backward()
        else:
            _loss(self.model(x), y).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank: int, world_size: int, shape: dict, steps: int, warmup: int) -> dict:
    out = {}
    for name, layout in LAYOUTS.items():
        config = TrainConfig(**shape, **layout, steps=steps)
        ours = _Run(rank, config)
        theirs = _TorchNative(config)
        times = {"ours": [], "pytorch": []}
        for step in range(warmup + steps):
            order = ["ours", "pytorch"] if step % 2 == 0 else ["pytorch", "ours"]
            for impl in order:
                dist.barrier()
                start = time.perf_counter()
                if impl == "ours":
                    ours.step()
                else:
                    theirs.step(step)
                elapsed = _slowest(time.perf_counter() - start)
                if step >= warmup:
                    times[impl].append(elapsed)
        tokens = config.global_batch * config.seq
        out[name] = {impl: tokens / statistics.median(t) for impl, t in times.items()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 timed steps of a 2-layer, 64-wide model")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    args = p.parse_args()
    if args.quick:
        args.steps, args.layers, args.hidden, args.seq = 4, 2, 64, 64
    shape = dict(layers=args.layers, hidden=args.hidden, heads=4, seq=args.seq,
                 micro_batch_size=args.micro_batch)
    result = dtlib.launch(worker, 4, args=(shape, args.steps, args.warmup), timeout=600)[0]
    print(f"TinyGPT layers={args.layers} hidden={args.hidden} seq={args.seq}, micro-batch "
          f"{args.micro_batch} per replica, {args.steps} timed steps (median), 4 gloo ranks")
    print(f"{'layout':10s} {'ours tok/s':>12s} {'PyTorch tok/s':>14s} {'ratio':>7s}")
    for name, r in result.items():
        print(f"{name:10s} {r['ours']:12,.0f} {r['pytorch']:14,.0f} {r['ours'] / r['pytorch']:7.2f}")


if __name__ == "__main__":
    main()
