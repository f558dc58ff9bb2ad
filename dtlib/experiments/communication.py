"""Communication: the experiments a lesson runs on real ranks.

Experiments (gloo on CPU, ranks started with :func:`dtlib.launch`):

* :func:`time_all_reduce` - our ring all-reduce and the backend's, each iteration timed on its
  slowest rank (a collective ends with it) and summarised by the fastest iteration (or the median or
  mean), with nccl-tests' algbw and busbw from :mod:`dtlib.analytic.comm`;
* :func:`fit_alpha_beta` - the latency alpha and bandwidth B that best explain those times in the
  ring model ``t = 2(n-1) alpha + 2(n-1)/n S/B`` (Thakur et al. 2005, Sec. 4);
* :func:`overlap_records` - one real training step of :class:`~dtlib.parallel.BucketedDDP` /
  :class:`~dtlib.parallel.NaiveDDP`, with its recorded timeline (buckets issued vs backward);
* :func:`compression_runs` - MNIST training with each communication hook: bytes on the wire
  per step and final accuracy.
"""
from __future__ import annotations

import re
import statistics
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.analytic import validate
from dtlib.analytic.comm import algbw, busbw, collective_time
from dtlib.data import Digits, global_batches, load_mnist, shard_batch
from dtlib.analytic.hardware import Link
from dtlib.analytic.timing import STATISTICS, summarise
from dtlib.launcher import launch
from dtlib.models import MnistCNN
from dtlib.parallel import (BucketedDDP, NaiveDDP, PowerSGDState, TopKState, fp16_compress_hook,
                            powersgd_hook, ring_all_reduce, topk_hook)

__all__ = ["STATISTICS", "summarise", "time_all_reduce", "fit_alpha_beta", "measured_over_model",
           "overlap_model", "overlap_records",
           "compression_runs", "compression_method", "COMPRESSION_METHODS"]



# ---- timing collectives ---------------------------------------------------------------------------
# the iterations of one size become one time by dtlib.analytic.timing.summarise: the fastest by default


def _time_worker(rank: int, world_size: int, sizes: Sequence[int], iters: int, statistic: str) -> list[dict]:
    impls: dict[str, Callable[[torch.Tensor], Any]] = {
        "ring (dtlib, send/recv)": ring_all_reduce, "built-in (dist.all_reduce)": dist.all_reduce}
    rows = []
    for nbytes in sizes:
        x = torch.randn(max(1, nbytes // 4))
        # small messages take microseconds, so one descheduled rank skews a few samples: time them
        # 3x as often (some iteration then runs undisturbed on a busy machine); big ones fewer times
        n_iter = max(3, min(3 * iters, int(iters * 2 ** 20 / nbytes)))
        for impl, fn in impls.items():
            fn(x)  # warm-up
            times = torch.zeros(n_iter)
            for i in range(n_iter):
                dist.barrier()
                start = time.perf_counter()
                fn(x)
                times[i] = time.perf_counter() - start
            dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a collective ends with its slowest rank
            t = summarise(times.tolist(), statistic)
            size = x.numel() * 4
            rows.append({"impl": impl, "collective": "all_reduce", "bytes": size, "seconds": t,
                         "algbw": algbw(size, t), "busbw": busbw("all_reduce", size, t, world_size),
                         "world_size": world_size, "statistic": statistic, "iterations": n_iter})
    return rows


def time_all_reduce(sizes: Sequence[int], world_size: int = 2, iters: int = 10,
                    statistic: str = "min") -> list[dict]:
    """Time our ring all-reduce and ``dist.all_reduce`` on float32 messages of ``sizes`` bytes.

    Returns one row per (size, implementation): ``impl``, ``bytes``, ``seconds`` (each iteration's
    time on its slowest rank, summarised by ``statistic``, :data:`dtlib.analytic.timing.STATISTICS`:
    the fastest iteration by default, which load on a shared machine disturbs least; ``3 * iters``
    iterations up to 1/3 MiB, fewer above 1 MiB, ``iterations``), ``algbw`` = S/t and ``busbw`` = algbw x 2(n-1)/n
    (nccl-tests definitions, :mod:`dtlib.analytic.comm`), ``world_size``, ``statistic``.
    """
    if not sizes or min(sizes) < 4:
        raise ValueError(f"sizes must be message sizes in bytes (>= 4), got {sizes!r}")
    validate.one_of("statistic", statistic, STATISTICS)
    return launch(_time_worker, world_size, args=(list(sizes), iters, statistic), timeout=120, output="none")[0]


def fit_alpha_beta(rows: Sequence[Mapping], impl: str) -> Link:
    """The ring all-reduce model ``t = 2(n-1) alpha + 2(n-1)/n S/B`` fitted to ``rows`` of ``impl``.

    A least-squares fit of ``t = a + b S`` in *relative* error (the sizes span decades), then
    ``alpha = a / (2(n-1))`` and ``B = 2(n-1)/n / b``. Returns a :class:`~dtlib.analytic.hardware.Link` that
    :func:`dtlib.analytic.comm.collective_time` accepts.
    """
    pts = [(r["bytes"], r["seconds"], r["world_size"]) for r in rows if r["impl"] == impl]
    if len(pts) < 2:
        raise ValueError(f"need measurements of {impl!r} at two sizes at least; impls in rows: "
                         f"{sorted({r['impl'] for r in rows})}")
    n = pts[0][2]
    S, t = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
    A = np.stack([np.ones_like(S), S], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if a <= 0 or b <= 0:
        raise ValueError(f"the times of {impl!r} do not grow like a + bS (a={a:.3g}, b={b:.3g}): "
                         "measure more sizes, or more iterations")
    return Link(f"fitted: {impl}", bandwidth=float(2 * (n - 1) / n / b), latency=float(a / (2 * (n - 1))),
                source=f"least-squares fit of the ring model to {len(pts)} measured sizes on {n} ranks")


def measured_over_model(rows: Sequence[Mapping], impl: str, link: Link) -> dict[int, float]:
    """Each measured time of ``impl`` divided by the all-reduce model's on ``link`` (e.g.
    :func:`fit_alpha_beta`'s): ``{bytes: ratio}``, 1.0 where the measurement sits on the line."""
    return {r["bytes"]: r["seconds"] / collective_time("all_reduce", r["bytes"], r["world_size"], link)
            for r in rows if r["impl"] == impl}


# ---- bucketing and overlap ------------------------------------------------------------------------
def overlap_model(layers: int = 6, width: int = 512, seed: int = 0) -> nn.Sequential:
    """``layers`` x (Linear(width, width), Tanh): one ``width^2 x 4``-byte weight per layer."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def _overlap_worker(rank: int, world_size: int, configs: Mapping[str, float | None], layers: int,
                    width: int, batch: int, warmup: int, repeats: int) -> dict[str, dict]:
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    ddps = {name: NaiveDDP(overlap_model(layers, width)) if bucket_mb is None
            else BucketedDDP(overlap_model(layers, width), bucket_size_mb=bucket_mb)
            for name, bucket_mb in configs.items()}
    # the configurations take turns, iteration by iteration, so a burst of load on a shared
    # machine falls on all of them alike; the first iteration also rebuilds the buckets
    for _ in range(warmup + repeats):
        for ddp in ddps.values():
            ddp(x).square().mean().backward()
            ddp.finish_gradient_synchronization()
    out = {name: {"records": list(ddp.records)[-repeats:], "buckets": ddp.bucket_summary()}
           for name, ddp in ddps.items()}
    for ddp in ddps.values():
        ddp.remove_hooks()
    return out


def overlap_records(configs: Mapping[str, float | None], world_size: int = 2, layers: int = 6,
                    width: int = 512, batch: int = 128, warmup: int = 2, repeats: int = 9) -> dict[str, dict]:
    """Train :func:`overlap_model` with each DDP of ``configs`` (``{name: bucket MiB, or None for
    NaiveDDP}``), taking turns: ``warmup`` iterations, then ``repeats`` measured ones. Returns rank 0's
    ``{name: {"records": [SyncRecord per measured iteration], "record": the one whose
    communication left after backward is the median, "left_after_backward": [seconds per
    iteration], "buckets": bucket_summary()}}`` (times from :attr:`BucketedDDP.records`; each
    all-reduce's end is when it completed, :attr:`SyncRecord.bucket_completed`)."""
    validate.integer("repeats", repeats)
    validate.integer("warmup", warmup, minimum=0)
    runs = launch(_overlap_worker, world_size, args=(dict(configs), layers, width, batch, warmup, repeats),
                  timeout=120, output="none")[0]
    for run in runs.values():
        run["left_after_backward"] = [r.left_after_backward for r in run["records"]]
        order = sorted(range(repeats), key=run["left_after_backward"].__getitem__)
        run["record"] = run["records"][order[repeats // 2]]
    return runs


# ---- gradient compression ------------------------------------------------------------------------
COMPRESSION_METHODS: dict[str, tuple[Callable[[], Any] | None, Callable | None]] = {
    "none (fp32 all-reduce)": (None, None),
    "fp16 cast": (lambda: None, fp16_compress_hook),
    "top-k 1% + error feedback": (lambda: TopKState(ratio=0.01), topk_hook),
    "PowerSGD rank 1": (lambda: PowerSGDState(rank=1, start_iter=10), powersgd_hook),
    "PowerSGD rank 4": (lambda: PowerSGDState(rank=4, start_iter=10), powersgd_hook),
}


def _method_spec(name: str) -> tuple[Callable[[], Any] | None, Callable | None] | None:
    """``(make_state, hook)`` for a known name, None for an unknown one; ValueError for a known
    form with an impossible setting."""
    if name in COMPRESSION_METHODS:
        return COMPRESSION_METHODS[name]
    if m := re.fullmatch(r"PowerSGD rank (\d+)", name):
        rank = int(m.group(1))
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        return (lambda: PowerSGDState(rank=rank, start_iter=10)), powersgd_hook
    if m := re.fullmatch(r"top-k ([0-9.]+)% \+ error feedback", name):
        percent = float(m.group(1))
        if not 0 < percent <= 100:
            raise ValueError(f"top-k share must be in (0, 100] %, got {percent:g}%")
        return (lambda: TopKState(ratio=percent / 100)), topk_hook
    return None


_VALID = (f"valid: {list(COMPRESSION_METHODS)}, 'PowerSGD rank R' (R >= 1) or "
          "'top-k P% + error feedback' (0 < P <= 100)")


def compression_method(name: str) -> tuple[Callable[[], Any] | None, Callable | None]:
    """``(make_state, hook)`` for a method name: a key of :data:`COMPRESSION_METHODS`, or any
    ``"PowerSGD rank R"`` (R >= 1) or ``"top-k P% + error feedback"`` (0 < P <= 100)."""
    spec = _method_spec(name)
    if spec is None:
        raise ValueError(f"unknown method {name!r}; {_VALID}")
    return spec


def _compression_worker(rank: int, world_size: int, methods: Sequence[str], steps: int, batch: int,
                        lr: float, seeds: Sequence[int], train: Digits, test: Digits) -> list[dict]:
    rows = []
    for name in methods:
        make_state, hook = compression_method(name)
        accuracies, first = [], None
        for seed in seeds:  # another seed: other initial weights and another data order
            order = [b for epoch in range(steps * batch // len(train) + 1)
                     for b in global_batches(len(train), batch, epoch=epoch, seed=seed)][:steps]
            torch.manual_seed(seed)
            model = MnistCNN()
            ddp = BucketedDDP(model)
            if hook is not None:
                ddp.register_comm_hook(make_state(), hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
            losses = []
            for idx in order:
                idx = shard_batch(idx, rank, world_size)
                opt.zero_grad()
                loss = F.cross_entropy(ddp(train.images[idx]), train.labels[idx])
                loss.backward()
                ddp.finish_gradient_synchronization()
                opt.step()
                losses.append(loss.item())
            with torch.no_grad():
                accuracies.append((model(test.images).argmax(1) == test.labels).float().mean().item())
            rec = ddp.last_record  # the steady state (PowerSGD compresses after start_iter steps)
            first = first or {"payload_bytes": rec.payload_bytes, "bytes_per_step": rec.wire_bytes, "losses": losses}
        rows.append({"method": name, **first, "accuracy": statistics.mean(accuracies),
                     "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                     "accuracies": accuracies})
    return rows


def compression_runs(methods: Sequence[str] = tuple(COMPRESSION_METHODS), steps: int = 80,
                     world_size: int = 2, batch: int = 32, lr: float = 0.02, seed: int = 0,
                     train: Digits | None = None, test: Digits | None = None, seeds: int = 1) -> list[dict]:
    """Train the MNIST CNN with :class:`BucketedDDP` and each hook of ``methods`` (keys of
    :data:`COMPRESSION_METHODS`, or names :func:`compression_method` understands, e.g.
    ``"PowerSGD rank 8"``), once per seed ``seed, seed + 1, ...`` (``seeds`` of them: initial
    weights and data order), the same seeds for every method. Per method return ``method``,
    ``bytes_per_step`` (what a rank sends per step if the collectives run as rings,
    :attr:`SyncRecord.wire_bytes`), ``payload_bytes``, test ``accuracies`` (one per seed), their mean
    ``accuracy`` and sample standard deviation ``accuracy_std`` (0 for one seed: a single run says
    nothing about its noise), and rank 0's ``losses`` (first seed). ``train`` may be a subset (e.g.
    ``load_mnist("train").subset(256)``) for a quick run."""
    unknown = [m for m in methods if _method_spec(m) is None]  # checked before any rank starts
    if unknown:
        raise ValueError(f"unknown methods {unknown}; {_VALID}")
    validate.integer("seeds", seeds)
    train = train if train is not None else load_mnist("train", verbose=False)
    test = test if test is not None else load_mnist("test", verbose=False)
    return launch(_compression_worker, world_size,
                  args=(list(methods), steps, batch, lr, [seed + k for k in range(seeds)], train, test),
                  timeout=300, output="none")[0]
