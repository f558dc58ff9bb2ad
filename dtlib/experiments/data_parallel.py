"""Data-parallel training by hand: one loop that runs on 1 rank or N.

The rule every data-parallel framework follows (PyTorch DDP, Li et al. 2020, VLDB; Horovod):
each rank computes gradients on its slice of the global batch, the gradients (never the weights)
are all-reduced and divided by the world size, and every rank applies the same optimizer step.
With equal slices and a mean loss, the averaged gradient *is* the full-batch gradient, so N ranks
reproduce single-process training on the full batch.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.data import Digits, global_batches, shard_batch
from dtlib.models.cnn import MnistCNN

__all__ = ["average_gradients", "lr_at_step", "make_model", "train", "accuracy"]

SyncFn = Callable[[nn.Module, int], None]


def make_model(seed: int = 0) -> MnistCNN:
    """The lesson's CNN with seeded initial weights (identical on every rank for the same seed)."""
    torch.manual_seed(seed)
    return MnistCNN()


def average_gradients(model: nn.Module, world_size: int) -> None:
    """All-reduce (sum) every gradient and divide by ``world_size``: PyTorch DDP's semantics."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size


def lr_at_step(step: int, base_lr: float, base_batch: int, global_batch: int,
               warmup_steps: int = 0) -> float:
    """Linear scaling rule with gradual warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD", §2.1-2.2).

    The target rate is ``base_lr * global_batch / base_batch``; during the first ``warmup_steps``
    steps the rate climbs linearly from ``base_lr`` to that target.
    """
    if base_lr <= 0 or base_batch < 1 or global_batch < 1 or warmup_steps < 0 or step < 0:
        raise ValueError("need base_lr > 0, base_batch >= 1, global_batch >= 1, warmup_steps >= 0 "
                         f"and step >= 0; got {base_lr}, {base_batch}, {global_batch}, "
                         f"{warmup_steps}, {step}")
    target = base_lr * global_batch / base_batch
    if step < warmup_steps:
        return base_lr + (target - base_lr) * step / warmup_steps
    return target


def train(rank: int, world_size: int, data: Digits, steps: int = 10, global_batch: int = 64,
          lr: float = 0.05, sync: SyncFn | str | None = average_gradients, seed: int = 0,
          warmup_steps: int = 0, base_batch: int | None = None) -> dict:
    """Train the CNN for ``steps`` steps on rank ``rank``'s slice of each global batch.

    ``sync``: a function ``sync(model, world_size)`` called between ``backward()`` and the
    optimizer step (e.g. :func:`average_gradients`), ``"ddp"`` to wrap the model in
    ``torch.nn.parallel.DistributedDataParallel`` instead, or None (single process).
    With ``base_batch`` set, the learning rate follows :func:`lr_at_step`.
    Returns the final ``state`` dict, per-step ``losses`` (this rank's) and learning rates
    (``lrs``), and the median ``seconds_per_step``, of it ``sync_seconds_per_step`` (inside a
    callable ``sync``: the gradient all-reduce; 0 for ``"ddp"``, which syncs inside backward) and
    ``cpu_seconds_per_step`` (the CPU time this process got in the step: below the step's length
    when it waited, for a peer or for a core shared with other processes).
    """
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must be divisible by world_size={world_size} "
                         "so that every rank's slice (and so its mean loss) has the same weight")
    model: nn.Module = make_model(seed)
    if sync == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    batches = global_batches(len(data), global_batch, seed=seed)
    if not batches:
        raise ValueError(f"global_batch={global_batch} is larger than the dataset ({len(data)})")
    losses, lrs, step_times, sync_times, cpu_times = [], [], [], [], []
    for step in range(steps):
        start = time.perf_counter()
        cpu_start = time.process_time()
        if base_batch is not None:
            for group in opt.param_groups:
                group["lr"] = lr_at_step(step, lr, base_batch, global_batch, warmup_steps)
        idx = shard_batch(batches[step % len(batches)], rank, world_size)
        loss = F.cross_entropy(model(data.images[idx]), data.labels[idx])
        opt.zero_grad()
        loss.backward()
        sync_start = time.perf_counter()
        if callable(sync):
            sync(model, world_size)
        sync_times.append(time.perf_counter() - sync_start)
        opt.step()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])
        step_times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)

    def median(values: list[float]) -> float:
        # the steps after the first (which pays for allocations and the first connections)
        timed = values[1:] or values
        return float(torch.tensor(timed).median()) if timed else 0.0

    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return {"state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "losses": losses, "lrs": lrs, "seconds_per_step": median(step_times),
            "sync_seconds_per_step": median(sync_times), "cpu_seconds_per_step": median(cpu_times)}


@torch.no_grad()
def accuracy(state: dict, data: Digits) -> float:
    """Top-1 accuracy of the CNN with weights ``state`` on ``data``."""
    model = make_model()
    model.load_state_dict(state)
    return (model(data.images).argmax(1) == data.labels).float().mean().item()
