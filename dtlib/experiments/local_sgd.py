"""What lesson 11 runs: DDP, local SGD and DiLoCo side by side, torchft's own, and an emulated slow link.

* :func:`torchft_manager` starts what ``torchft`` (Meta's fault-tolerant training library) needs on
  CPU ranks: a ``LighthouseServer`` (on rank 0; its address broadcast to the others), one
  ``TCPStore`` per replica and a ``torchft.manager.Manager`` over a ``ProcessGroupGloo``. Each rank
  is a replica group of one process, so torchft's ``LocalSGD`` / ``DiLoCo`` average over the ranks.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlib.analytic import validate
from dtlib.analytic.comm import bytes_sent_per_rank
from dtlib.corpus import VOCAB, token_batch
from dtlib.experiments.profiling import slow_link_hook, slow_link_seconds
from dtlib.launcher import launch
from dtlib.models.gpt import TinyGPT, tiny_gpt_config
from dtlib.parallel.ddp import BucketedDDP
from dtlib.parallel.local_sgd import DiLoCo, LocalSGD

__all__ = ["torchft_manager", "Run", "SCHEMES", "SCHEME_LABELS", "gpt_model", "lm_loss",
           "held_out_loss", "compare_schemes", "simulate_diloco", "simulate_ddp",
           "small_step_seconds", "modelled_seconds", "diloco_tradeoff", "one_thread"]


def torchft_manager(rank: int, world_size: int, model: nn.Module, timeout: float = 20.0
                    ) -> tuple[Any, Callable[[], None]]:
    """A real ``torchft.manager.Manager`` for this rank (a replica of one process), and a function
    that shuts it (and the lighthouse, on rank 0) down. Call it on every rank, inside ``launch``.

    torchft normally runs a lighthouse next to the job and a Manager per replica group; here rank 0
    hosts the lighthouse (``min_replicas=world_size``, so every quorum holds all ranks) and each
    rank its own store. ``use_async_quorum=False`` because torchft's DiLoCo requires it;
    ``init_sync=False`` because every rank builds the same seeded model (with it, the first quorum
    would copy replica 0's weights - after its first H local steps - onto the others).
    """
    os.environ.setdefault("RUST_LOG", "error")  # torchft's Rust side logs every quorum otherwise
    from torchft._torchft import LighthouseServer
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world_size) if rank == 0 else None
    address = [lighthouse.address() if lighthouse else None]
    dist.broadcast_object_list(address, src=0)
    store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    limit = timedelta(seconds=timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=limit), min_replica_size=world_size,
                      use_async_quorum=False, init_sync=False,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=str(rank), store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=address[0], timeout=limit,
                      quorum_timeout=limit, connect_timeout=limit)

    def shutdown() -> None:
        manager.shutdown(wait=False)
        dist.barrier()  # nobody may lose the lighthouse while another rank still talks to it
        if lighthouse is not None:
            lighthouse.shutdown()
        del store_keep[:]

    store_keep = [store]
    return manager, shutdown


# ---- DDP, local SGD and DiLoCo on TinyGPT, over an emulated slow link ------------------------------
SCHEMES = ("ddp", "local_sgd", "diloco")
SCHEME_LABELS = {"ddp": "DDP (every step)", "local_sgd": "local SGD (every H)",
                 "diloco": "DiLoCo (every H)"}


@dataclass(frozen=True)
class Run:
    """One comparison's settings (the defaults are lesson 11's)."""
    steps: int = 32
    sync_every: int = 8            # H
    global_batch: int = 16
    inner_lr: float = 3e-3         # AdamW, for DDP and as the inner optimizer
    outer_lr: float = 0.7          # Douillard et al. 2023, Sec. 3: Nesterov, lr 0.7, momentum 0.9
    outer_momentum: float = 0.9
    latency: float = 0.005         # seconds per all-reduce on the emulated link
    bandwidth: float = 20e6        # bytes/s on the emulated link
    seed: int = 0


def gpt_model(seed: int = 0, small: bool = False) -> TinyGPT:
    """Lesson 11's TinyGPT (byte-level, 2 layers, hidden 64, seq 32; ``small``: 1 layer, hidden 32,
    seq 16, for the widget's quick simulations), seeded: the same on every rank."""
    torch.manual_seed(seed)
    cfg = (tiny_gpt_config(layers=1, hidden=32, heads=2, vocab=VOCAB, seq=16) if small
           else tiny_gpt_config(layers=2, hidden=64, heads=4, vocab=VOCAB, seq=32))
    return TinyGPT(cfg)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _shard(step: int, run: Run, rank: int, world_size: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(step, run.global_batch, seq, seed=run.seed)
    return x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


@torch.no_grad()
def held_out_loss(model: nn.Module, seq: int, batch: int = 32) -> float:
    """Loss on a fixed batch no run trains on (seed 999)."""
    x, y = token_batch(0, batch, seq, seed=999)
    return lm_loss(model, x, y).item()


def _scheme_worker(rank: int, world_size: int, run: Run, schemes: Sequence[str]) -> dict:
    out = {}
    seq = gpt_model(run.seed).cfg.seq

    def link(nbytes: int) -> None:  # every all-reduce pays the emulated link (profiling's)
        time.sleep(slow_link_seconds(nbytes, world_size, run.latency, run.bandwidth))

    for scheme in schemes:
        model = gpt_model(run.seed)
        if scheme == "ddp":
            net: nn.Module = BucketedDDP(model, bucket_size_mb=64.0)  # one bucket: one message
            net.register_comm_hook(None, slow_link_hook(run.latency, run.bandwidth))
            opt = torch.optim.AdamW(net.parameters(), lr=run.inner_lr)
            wrapper: Any = None
        else:
            net = model
            opt = torch.optim.AdamW(model.parameters(), lr=run.inner_lr)
            if scheme == "local_sgd":
                wrapper = LocalSGD(model, opt, sync_every=run.sync_every, on_sync=link)
            else:
                outer = torch.optim.SGD(model.parameters(), lr=run.outer_lr,
                                        momentum=run.outer_momentum, nesterov=run.outer_momentum > 0)
                wrapper = DiLoCo(model, opt, outer, sync_every=run.sync_every, on_sync=link)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        losses, times, sent = [], [], []
        curve = {"step": [0], "time": [0.0], "bytes": [0.0], "loss": [held_out_loss(model, seq)]}
        dist.barrier()
        start = time.perf_counter()
        total = 0.0
        with (wrapper if wrapper is not None else contextlib.nullcontext()):
            for step in range(run.steps):
                x, y = _shard(step, run, rank, world_size, seq)
                loss = lm_loss(net, x, y)
                loss.backward()
                if scheme == "ddp":
                    net.finish_gradient_synchronization()
                    total += float(bytes_sent_per_rank("all_reduce", param_bytes, world_size))
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                times.append(time.perf_counter() - start)
                sent.append(total if wrapper is None else wrapper.bytes_sent)
                if (step + 1) % run.sync_every == 0:
                    # every H steps all replicas hold the same model: evaluate it, off the clock
                    paused = time.perf_counter()
                    curve["loss"].append(held_out_loss(model, seq))
                    for key, value in (("step", step + 1), ("time", times[-1]), ("bytes", sent[-1])):
                        curve[key].append(value)
                    start += time.perf_counter() - paused
        out[scheme] = {"losses": losses, "times": times, "bytes": sent, "curve": curve,
                       "held_out": held_out_loss(model, seq), "param_bytes": param_bytes,
                       "syncs": run.steps if wrapper is None else wrapper.syncs}
    return out


def compare_schemes(run: Run = Run(), world_size: int = 4, schemes: Sequence[str] = SCHEMES,
                    timeout: float = 120.0) -> dict:
    """Train lesson 11's TinyGPT with each scheme on ``world_size`` ranks over the emulated link.

    Returns ``{scheme: {"loss", "time", "bytes", "curve", "held_out", "syncs", "seconds"}}``: per
    step the training loss averaged over ranks, the wall-clock time (slowest rank) and the bytes
    each rank has sent; ``curve``: the held-out loss of the synchronised model every H steps
    (``{"step", "time", "bytes", "loss"}``, evaluation time excluded); the final model's held-out
    loss; the run's total seconds.
    """
    for s in schemes:
        validate.one_of("schemes", s, SCHEMES)
    validate.integer("run.steps", run.steps)
    validate.integer("run.sync_every", run.sync_every)
    validate.integer("run.global_batch", run.global_batch)
    if run.global_batch % world_size:
        raise ValueError(f"run.global_batch must be divisible by world_size={world_size}, got "
                         f"{run.global_batch}")
    validate.number("run.inner_lr", run.inner_lr)
    validate.number("run.outer_lr", run.outer_lr)
    validate.number("run.outer_momentum", run.outer_momentum, minimum=0, exclusive=False, maximum=1)
    validate.number("run.latency", run.latency, minimum=0, exclusive=False)
    validate.number("run.bandwidth", run.bandwidth)
    validate.integer("world_size", world_size, minimum=1, maximum=8)
    ranks = launch(_scheme_worker, world_size, args=(run, tuple(schemes)), timeout=timeout,
                   output="none")
    result = {}
    for s in schemes:
        per_rank = [r[s] for r in ranks]
        times = [max(r["times"][i] for r in per_rank) for i in range(run.steps)]
        result[s] = {"loss": [sum(r["losses"][i] for r in per_rank) / world_size for i in range(run.steps)],
                     "time": times, "bytes": per_rank[0]["bytes"], "held_out": per_rank[0]["held_out"],
                     "syncs": per_rank[0]["syncs"], "seconds": times[-1],
                     "curve": {**per_rank[0]["curve"],
                               "time": [max(r["curve"]["time"][i] for r in per_rank)
                                        for i in range(len(per_rank[0]["curve"]["time"]))]},
                     "param_bytes": per_rank[0]["param_bytes"]}
    return result


# ---- the widget's model: DiLoCo simulated in one process, time from the emulated link -------------
@contextlib.contextmanager
def one_thread() -> Any:
    """Compute on one thread, as every launched rank does: on a shared, loaded machine PyTorch's
    worker threads wait for each other (seconds for a millisecond's work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _replica_shard(step: int, replica: int, replicas: int, global_batch: int, seq: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_batch(step, global_batch, seq, seed=seed)
    return x.tensor_split(replicas)[replica], y.tensor_split(replicas)[replica]


def _simulate_diloco(sync_every: int, outer_lr: float, outer_momentum: float = 0.9, replicas: int = 4,
                    steps: int = 48, inner_lr: float = 3e-3, global_batch: int = 16, seed: int = 0
                    ) -> tuple[tuple[int, float], ...]:
    """DiLoCo on ``replicas`` replicas of the small TinyGPT, computed one replica after another in
    this process (the same arithmetic as the ranks: own AdamW per replica, the mean pseudo-gradient,
    :func:`~dtlib.parallel.local_sgd.outer_nesterov_step`'s Nesterov update). ``sync_every=1``
    with ``outer_lr=1``, no momentum, is local SGD with H = 1. Returns ``(step, held-out loss)``
    of the global model after every synchronisation (and at step 0). Cached: the widget asks again."""
    sync_every = validate.integer("sync_every", sync_every, minimum=1)
    outer_lr = validate.number("outer_lr", outer_lr)
    outer_momentum = validate.number("outer_momentum", outer_momentum, minimum=0, exclusive=False,
                                     maximum=1)
    glob = gpt_model(seed, small=True)
    seq = glob.cfg.seq
    global_params = [p.detach().clone() for p in glob.parameters()]
    bufs = [torch.zeros_like(p) for p in global_params]
    models = [gpt_model(seed, small=True) for _ in range(replicas)]
    opts = [torch.optim.AdamW(m.parameters(), lr=inner_lr) for m in models]
    curve = [(0, held_out_loss(glob, seq))]
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(models, opts)):
            lm_loss(m, *_replica_shard(step, r, replicas, global_batch, seq, seed)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if (step + 1) % sync_every == 0 or step == steps - 1:
            with torch.no_grad():
                for i, g in enumerate(global_params):
                    delta = sum(g - list(m.parameters())[i] for m in models) / replicas
                    bufs[i].mul_(outer_momentum).add_(delta)
                    g.sub_(outer_lr * (delta + outer_momentum * bufs[i]))
                for m in models:
                    for p, g in zip(m.parameters(), global_params):
                        p.copy_(g)
                for p, g in zip(glob.parameters(), global_params):
                    p.copy_(g)
            curve.append((step + 1, held_out_loss(glob, seq)))
    return tuple(curve)


def _simulate_ddp(steps: int = 48, inner_lr: float = 3e-3, global_batch: int = 16, seed: int = 0,
                 eval_every: int = 4) -> tuple[tuple[int, float], ...]:
    """Synchronous DDP with AdamW on the small TinyGPT: one process on the whole global batch
    (what DDP equals). ``(step, held-out loss)`` every ``eval_every`` steps."""
    model = gpt_model(seed, small=True)
    seq = model.cfg.seq
    opt = torch.optim.AdamW(model.parameters(), lr=inner_lr)
    curve = [(0, held_out_loss(model, seq))]
    for step in range(steps):
        x, y = token_batch(step, global_batch, seq, seed=seed)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % eval_every == 0 or step == steps - 1:
            curve.append((step + 1, held_out_loss(model, seq)))
    return tuple(curve)


def _small_step_seconds(global_batch: int = 16, replicas: int = 4, repeats: int = 5) -> float:
    """Measured seconds of one replica's forward + backward + AdamW step on its share of the batch
    (small TinyGPT; the minimum of ``repeats``: the machine is shared)."""
    model = gpt_model(small=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = _replica_shard(0, 0, replicas, global_batch, model.cfg.seq, 0)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    return best


@lru_cache(maxsize=64)
def simulate_diloco(sync_every: int, outer_lr: float, outer_momentum: float = 0.9, replicas: int = 4,
                    steps: int = 48, inner_lr: float = 3e-3, global_batch: int = 16, seed: int = 0
                    ) -> tuple[tuple[int, float], ...]:
    """:func:`_simulate_diloco` on one thread, cached (the widget asks again)."""
    with one_thread():
        return _simulate_diloco(sync_every, outer_lr, outer_momentum, replicas, steps, inner_lr,
                                global_batch, seed)


@lru_cache(maxsize=4)
def simulate_ddp(steps: int = 48, inner_lr: float = 3e-3, global_batch: int = 16, seed: int = 0,
                 eval_every: int = 4) -> tuple[tuple[int, float], ...]:
    """Synchronous DDP with AdamW on the small TinyGPT: one process on the whole global batch
    (what DDP equals). ``(step, held-out loss)`` every ``eval_every`` steps."""
    with one_thread():
        return _simulate_ddp(steps, inner_lr, global_batch, seed, eval_every)


@lru_cache(maxsize=1)
def small_step_seconds(global_batch: int = 16, replicas: int = 4, repeats: int = 5) -> float:
    """Measured seconds of one replica's forward + backward + AdamW step on its share of the batch
    (small TinyGPT, one thread as on a rank; the minimum of ``repeats``: the machine is shared)."""
    with one_thread():
        return _small_step_seconds(global_batch, replicas, repeats)


def modelled_seconds(steps: int, syncs: int, param_bytes: int, step_seconds: float, slowdown: float,
                     bandwidth: float, latency: float = 0.005, world_size: int = 4) -> float:
    """Wall-clock of a synchronous scheme: every step at the slowest rank's pace, every
    synchronisation an all-reduce of the model over the emulated link (:func:`slow_link_seconds`)."""
    return (steps * step_seconds * slowdown
            + syncs * slow_link_seconds(param_bytes, world_size, latency, bandwidth))


def diloco_tradeoff(sync_every: int, outer_lr: float, bandwidth_mb_s: float, slowdown: float,
                    steps: int = 32) -> dict:
    """The widget's result: DDP's and DiLoCo's held-out loss against modelled time (measured step
    time x slowdown + link time per synchronisation) on 4 simulated replicas."""
    sync_every = validate.integer("sync_every", sync_every, minimum=1)
    bandwidth = validate.number("bandwidth_mb_s", bandwidth_mb_s) * 1e6
    slowdown = validate.number("slowdown", slowdown, minimum=1, exclusive=False)
    step = small_step_seconds()
    nbytes = sum(p.numel() * p.element_size() for p in gpt_model(small=True).parameters())
    curves = {}
    for name, curve, every in (("DDP (sync every step)", simulate_ddp(steps), 1),
                               (f"DiLoCo H={sync_every}, outer lr {outer_lr:g}",
                                simulate_diloco(sync_every, float(outer_lr), steps=steps), sync_every)):
        times = [modelled_seconds(s, -(-s // every), nbytes, step, slowdown, bandwidth) for s, _ in curve]
        curves[name] = {"time": times, "loss": [loss for _, loss in curve]}
    (ddp, dl) = curves.values()
    return {"curves": curves, "ddp_seconds": ddp["time"][-1], "diloco_seconds": dl["time"][-1],
            "ddp_loss": ddp["loss"][-1], "diloco_loss": dl["loss"][-1],
            "title": (f"DiLoCo {ddp['time'][-1] / dl['time'][-1]:.1f}x faster than DDP, final loss "
                      f"{dl['loss'][-1]:.3f} vs {ddp['loss'][-1]:.3f} ({steps} steps, 4 replicas)")}
