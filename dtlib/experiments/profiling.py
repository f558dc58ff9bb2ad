"""Injected bottlenecks: a small real training run, healthy or with one fault, profiled on ranks.

The run is an MLP (``depth`` Linear + GELU layers of ``width``) trained with SGD on synthetic
regression data: data-parallel with :class:`~dtlib.parallel.BucketedDDP` on 2 ranks, or cut into
4 pipeline stages run by ``torch.distributed.pipelining``'s GPipe schedule. Each fault is what
the issue names, made strong and measurable on a loaded 2-core machine:

* ``communication``: one bucket per tensor and no overlap - every bucket is all-reduced
  synchronously inside ``backward`` (a DDP comm hook), over an *emulated* slow link that adds
  ``strength`` ms per message (a sleep inside the collective's ``dtlib/comm`` range: loopback gloo
  is too fast for a laptop to be communication-bound otherwise, the same device the pipeline
  notes use for stage costs);
* ``input``: the data loader sleeps ``strength`` ms per batch;
* ``bubble``: pp = 4 stages with ``strength`` micro-batches (GPipe: bubble (p-1)/(m+p-1));
* ``straggler``: rank 1 sleeps ``strength`` ms in every forward (a slower device);
* ``recompute``: full activation recomputation (``torch.utils.checkpoint``) of ``strength`` layers.

Model FLOPs come from the 6N rule (:func:`dtlib.analytic.flops.six_n_flops_per_token`, one
"token" per sample, N = the weights this rank multiplies by) less the input gradient the model
never needs: the first layer's input is the data, which needs no gradient, so autograd skips its
2 x weights FLOPs per sample (:func:`model_flops`). Counting them anyway made MFU exceed HFU.
Hardware FLOPs come from FlopCounterMode.
"""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtlib.analytic.comm import bytes_sent_per_rank
from dtlib.analytic.flops import six_n_flops_per_token
from dtlib.launcher import launch
from dtlib.profile import diagnose, phase, profile_steps, summarize

__all__ = ["FAULTS", "LEVELS", "strength_of", "run_injected", "mlp", "model_flops", "slow_link_seconds",
           "slow_link_hook"]

# fault -> (what the strength means, its default)
FAULTS: dict[str, tuple[str, int]] = {
    "healthy": ("nothing injected", 0),
    "communication": ("emulated latency per message, ms", 30),
    "input": ("data loader sleep per batch, ms", 150),
    "bubble": ("micro-batches m on pp=4 stages", 2),
    "straggler": ("rank 1's sleep per forward, ms", 300),
    "recompute": ("layers recomputed (full recomputation)", 4),
}
LEVELS = ("weak", "default", "strong")
# weak/strong for the faults whose strength is not a duration (sleeps: half and twice the default)
_NAMED_LEVELS = {"bubble": {"weak": 8, "default": 2, "strong": 1},
                 "recompute": {"weak": 2, "default": 4, "strong": 4}}  # 4 = every layer already


def strength_of(fault: str, level: str) -> int:
    """The strength a level names: sleeps halve or double the default; ``bubble`` uses m = 8, 2, 1
    micro-batches; ``recompute`` 2 or all 4 layers (nothing stronger than everything)."""
    if fault not in FAULTS or level not in LEVELS:
        raise ValueError(f"fault must be one of {tuple(FAULTS)} and level one of {LEVELS}, "
                         f"got {fault!r}, {level!r}")
    if fault in _NAMED_LEVELS:
        return _NAMED_LEVELS[fault][level]
    return FAULTS[fault][1] * {"weak": 1, "default": 2, "strong": 4}[level] // 2


class _Layers(nn.Module):
    """Linear + GELU layers; the first ``recompute`` are checkpointed (forward redone in backward)."""

    def __init__(self, width: int, depth: int, recompute: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = checkpoint(layer, x, use_reentrant=False) if i < self.recompute else layer(x)
        return x


def mlp(width: int, depth: int, recompute: int = 0, seed: int = 0) -> nn.Module:
    """The run's model (seeded: every rank builds the same one)."""
    torch.manual_seed(seed)
    return _Layers(width, depth, recompute)


def _weights(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dim() == 2)


def model_flops(layers: nn.Module, samples: int, input_needs_grad: bool) -> float:
    """The FLOPs one step of ``layers`` (Linear layers in sequence) needs for ``samples`` samples:
    forward 2N, weight gradients 2N, input gradients 2N per sample (Narayanan et al. 2021, Sec. 5.1:
    backward = 2 x forward, one for each), less the first layer's input gradient (2 x its weights)
    when its input needs none - the data itself, or the first pipeline stage's micro-batches."""
    per_sample = six_n_flops_per_token(_weights(layers))
    if not input_needs_grad:
        first = next(p for p in layers.parameters() if p.dim() == 2)
        per_sample -= 2 * first.numel()
    return float(per_sample * samples)


def slow_link_seconds(nbytes: float, world_size: int, latency: float, bandwidth: float | None = None) -> float:
    """Seconds an all-reduce of ``nbytes`` takes on the emulated slow link: ``latency`` per message
    plus, with a ``bandwidth`` (bytes/s), the bytes each rank sends in a ring all-reduce
    (2 (n-1)/n x nbytes, :func:`dtlib.analytic.comm.bytes_sent_per_rank`) over it."""
    seconds = latency
    if bandwidth is not None and world_size > 1:
        seconds += float(bytes_sent_per_rank("all_reduce", nbytes, world_size)) / bandwidth
    return seconds


def slow_link_hook(latency: float, bandwidth: float | None = None):
    """A comm hook: all-reduce the bucket synchronously (no overlap), then sleep what the emulated
    link would add (:func:`slow_link_seconds`): loopback gloo is far faster than a real network."""
    def hook(state: Any, bucket: Any) -> torch.futures.Future:
        with phase("comm"):
            buf = bucket.buffer()
            buf.div_(dist.get_world_size())
            bucket.log("all_reduce", buf)
            dist.all_reduce(buf)
            time.sleep(slow_link_seconds(buf.numel() * buf.element_size(), dist.get_world_size(),
                                         latency, bandwidth))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    return hook


def _ddp_worker(rank: int, world_size: int, fault: str, strength: int, width: int, depth: int,
                batch: int, steps: int, trace_dir: str | None) -> dict:
    from dtlib.parallel import BucketedDDP

    model = mlp(width, depth, recompute=strength if fault == "recompute" else 0)
    tiny = fault == "communication"
    ddp = BucketedDDP(model, bucket_size_mb=1e-6 if tiny else 0.5)
    if tiny:
        ddp.register_comm_hook(None, slow_link_hook(strength / 1e3))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    xs, ys = torch.randn(4, batch, width, generator=g), torch.randn(4, batch, width, generator=g)
    counter = iter(range(10 ** 9))

    def step() -> None:
        with phase("data"):
            i = next(counter) % len(xs)
            x, y = xs[i].clone(), ys[i].clone()
            if fault == "input":
                time.sleep(strength / 1e3)
        with phase("forward"):
            if fault == "straggler" and rank == 1:
                time.sleep(strength / 1e3)
            loss = (ddp(x) - y).square().mean()
        with phase("backward"):
            loss.backward()
            ddp.finish_gradient_synchronization()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad()

    flops = model_flops(model, batch, input_needs_grad=False)
    return profile_steps(step, steps=steps, warmup=2, model_flops=flops, trace_dir=trace_dir)


def _pipeline_worker(rank: int, world_size: int, microbatches: int, width: int, depth: int,
                     batch: int, steps: int, trace_dir: str | None) -> dict:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    full = mlp(width, depth)
    per_stage = depth // world_size
    stage_module = nn.Sequential(*full.layers[rank * per_stage:(rank + 1) * per_stage])
    stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches,
                             loss_fn=lambda out, target: (out - target).square().mean())
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)

    def step() -> None:
        with phase("data"):
            inputs = x.clone() if rank == 0 else None
        with phase("backward"):  # the schedule interleaves forward and backward
            if rank == 0:
                schedule.step(inputs)
            elif rank == world_size - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad()

    flops = model_flops(stage_module, batch, input_needs_grad=rank > 0)
    return profile_steps(step, steps=steps, warmup=2, model_flops=flops, trace_dir=trace_dir)


def run_injected(fault: str = "healthy", strength: int | None = None, width: int = 256,
                 depth: int = 4, batch: int = 1024, steps: int = 5, trace_dir: str | None = None,
                 timeout: float = 90.0) -> dict:
    """Profile the run with ``fault`` injected at ``strength`` (default :data:`FAULTS`' own) on
    2 data-parallel ranks (4 pipeline ranks for ``bubble``); traces go to ``trace_dir`` if given.
    Returns the summarised profile
    (:func:`dtlib.profile.summarize`) with its ``findings`` (:func:`dtlib.profile.diagnose`)."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {tuple(FAULTS)}, got {fault!r}")
    strength = FAULTS[fault][1] if strength is None else strength
    if isinstance(strength, bool) or not isinstance(strength, int) or strength < 0:
        raise ValueError(f"strength must be an integer >= 0 ({FAULTS[fault][0]}), got {strength!r}")
    if fault == "bubble":
        if not 1 <= strength <= batch or batch % strength:
            raise ValueError(f"strength (micro-batches) must divide batch={batch}, got {strength}")
        pp = 4
        ranks = launch(_pipeline_worker, pp, args=(strength, width, 2 * pp, batch, steps, trace_dir),
                       timeout=timeout, output="none")
    else:
        if fault == "recompute" and strength > depth:
            raise ValueError(f"strength (layers recomputed) must be <= depth={depth}, got {strength}")
        ranks = launch(_ddp_worker, 2, args=(fault, strength, width, depth, batch, steps, trace_dir),
                       timeout=timeout, output="none")
    profile = summarize(ranks)
    profile["findings"] = diagnose(profile)
    profile["fault"], profile["strength"] = fault, strength
    return profile
