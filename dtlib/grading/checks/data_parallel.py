"""Checks for the data-parallel exercise (MNIST)."""
from __future__ import annotations

import math
import random
from typing import Callable

import torch
from torch import nn

from dtlib.data import Digits
from dtlib.grading.feedback import launch_checked
from dtlib.experiments.scaling_efficiency import scaling_efficiency
from dtlib.experiments.data_parallel import lr_at_step, train


def probe_model(rank: int) -> nn.Linear:
    """A small layer whose weights and gradients differ per rank, so averaging the wrong thing
    (or the right thing with the wrong divisor) shows in every entry."""
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(rank + 1.0 + i)
            p.grad = torch.full_like(p, 10.0 * (rank + 1) + i)
    return model


def _probe_average(rank: int, world_size: int, fn: Callable) -> dict:
    model = probe_model(rank)
    fn(model, world_size)
    return {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}


def check_average_gradients(fn: Callable, world_size: int = 2) -> None:
    """The learner's ``fn(model, world_size)`` averages gradients, leaves weights alone."""
    out = launch_checked(_probe_average, world_size, (fn,), timeout=30)
    for name in out[0]:
        for rank, res in enumerate(out):
            weight, grad = res[name]
            i = list(out[0]).index(name)
            assert torch.all(weight == rank + 1.0 + i), (
                f"the weights ({name}) changed on rank {rank}: average the gradients "
                "(p.grad), never the weights")
            mean = sum(10.0 * (r + 1) + i for r in range(world_size)) / world_size
            total = mean * world_size
            if torch.allclose(grad, torch.full_like(grad, total)):
                raise AssertionError("gradients hold the sum over ranks: divide by world_size")
            assert torch.allclose(grad, torch.full_like(grad, mean)), (
                f"rank {rank}'s gradient of {name} is {grad.flatten()[0].item():g}, expected the "
                f"mean over ranks {mean:g}: all_reduce every p.grad (SUM), then divide by world_size")


def check_matches_single_process(fn: Callable, data: Digits, world_size: int = 2,
                                 steps: int = 3, global_batch: int = 32) -> None:
    """Training with ``fn`` on N ranks equals single-process training on the full batch."""
    ranks = launch_checked(train, world_size, (data, steps, global_batch, 0.05, fn), timeout=60)
    single = train(0, 1, data, steps, global_batch, 0.05, sync=None)
    for rank, res in enumerate(ranks[1:], start=1):
        for k, v in res["state"].items():
            assert torch.equal(v, ranks[0]["state"][k]), (
                f"rank {rank} ends with different parameters ({k}) from rank 0")
    for k, v in ranks[0]["state"].items():
        assert torch.allclose(v, single["state"][k], atol=1e-5), (
            f"{k} differs from single-process training on the full batch by "
            f"{(v - single['state'][k]).abs().max().item():.2e} after {steps} steps of a global batch of "
            f"{global_batch} on {world_size} ranks (tolerance 1e-05)")


def check_lr_schedule(fn: Callable, trials: int = 50) -> None:
    """The learner's schedule equals the linear-scaling-with-warm-up rule on random settings."""
    rng = random.Random(0)
    for _ in range(trials):
        base_lr, base_batch = rng.choice([0.1, 0.01, 0.4]), rng.choice([32, 64, 256])
        global_batch, warmup = base_batch * rng.choice([1, 2, 8, 32]), rng.choice([0, 5, 100])
        step = rng.randrange(0, 2 * warmup + 3)
        want = lr_at_step(step, base_lr, base_batch, global_batch, warmup)
        got = fn(step, base_lr, base_batch, global_batch, warmup)
        assert got is not None and math.isclose(got, want, rel_tol=1e-9), (
            f"lr at step {step} (base_lr={base_lr}, base_batch={base_batch}, "
            f"global_batch={global_batch}, warmup_steps={warmup}) should be {want:g}, got {got}")


def check_scaling_efficiency(fn: Callable) -> None:
    """The learner's efficiency is throughput_N / (N * throughput_1) for every N."""
    rng = random.Random(1)
    for _ in range(20):
        t1 = rng.uniform(10, 1000)
        throughput = {1: t1, **{n: t1 * n * rng.uniform(0.3, 1.0) for n in (2, 4, 8)}}
        want, got = scaling_efficiency(throughput), fn(throughput)
        assert isinstance(got, dict) and set(got) == set(want), (
            f"return a dict keyed by world size {sorted(want)}, got {got!r}")
        for n in want:
            assert math.isclose(got[n], want[n], rel_tol=1e-9), (
                f"efficiency at N={n} should be {want[n]:.4f}, got {got[n]}, for the throughputs "
                + ", ".join(f"N={k}: {v:.1f}" for k, v in throughput.items()) + " (samples/s)")
