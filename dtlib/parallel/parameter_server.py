"""Asynchronous SGD with a parameter server, and stale-synchronous parallel (SSP) to bound staleness.

Before all-reduce took over, large models were trained with a *parameter server* (Dean et al. 2012,
"Large Scale Distributed Deep Networks" - Downpour SGD; Li et al. 2014, "Scaling Distributed
Machine Learning with the Parameter Server", OSDI): one process holds the parameters, workers
pull them, compute a gradient on their own data and push it back; the server applies every
gradient *as soon as it arrives*. Nobody waits for the slowest worker - but a gradient may have
been computed on parameters that other workers have since updated: it is *stale*.

Stale-synchronous parallel (Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous
Parallel Parameter Server", NeurIPS) bounds that: every worker has a *clock* (how many updates it
has pushed), and a worker may start its next step only while its clock is at most ``s`` ahead of
the slowest worker's. ``s = 0`` is synchronous SGD (everyone waits every step); ``s = None`` is
fully asynchronous (Downpour).

Here rank ``server`` (0) is the server and every other rank a worker, over point-to-point gloo:

* worker -> server: ``[gradient..., version it read, loss]`` (``dist.send``);
* server -> worker: ``[parameters..., version]``, sent only when SSP allows the worker to go on.

The server receives from whichever worker is first (``dist.recv`` without ``src``) and applies
``theta <- theta - (lr / W) g``: with ``W`` workers a round of ``W`` pushes is one synchronous SGD
step on the mean gradient, so with ``s = 0`` and equal shards the run equals one process on the
global batch. Every update is recorded with its **staleness** (updates other workers applied
between this worker's read and its push: Dean et al.'s delay, ``<= (W-1)(2s+1)`` under SSP) and
its **lead** (the worker's clock minus the slowest clock when it read: ``<= s``, SSP's bound).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dtlib.analytic import validate
from dtlib.parallel.heterogeneous import SlowClock, slowed

__all__ = ["Update", "async_sgd", "staleness_bound"]

# loss_fn(model, worker, clock) -> the loss of worker ``worker`` (0-based) at its clock ``clock``;
# the caller's data lives in it
LossFn = Callable[[nn.Module, int, int], torch.Tensor]


@dataclass
class Update:
    """One gradient the server applied."""
    worker: int          # 0-based worker index (rank - 1 when the server is rank 0)
    clock: int           # the worker's clock when it computed it (0 = its first gradient)
    read_version: int    # server version of the parameters it was computed on
    version: int         # server version just before it was applied
    staleness: int       # version - read_version: updates it did not see
    lead: int            # worker's clock - slowest clock when it read (SSP keeps this <= s)
    loss: float
    time: float          # seconds since the server started when it was applied


def staleness_bound(workers: int, bound: int | None) -> float:
    """Most updates a gradient can miss under SSP with ``bound`` (None: no bound, infinite).

    A worker at clock c reads when every clock is in [c - s, c + s + 1]; until its push each other
    worker can push until it reaches c + s + 1, so at most 2s + 1 updates each.
    """
    workers = validate.integer("workers", workers, minimum=1)
    if bound is None:
        return float("inf")
    return (workers - 1) * (2 * validate.integer("bound", bound, minimum=0) + 1)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def _load(model: nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def _serve(model: nn.Module, workers: list[int], total: int, lr: float, bound: int | None) -> dict:
    start = time.perf_counter()
    params = _flat(model)
    n, w = params.numel(), len(workers)
    version = 0
    clock = {r: 0 for r in workers}
    lead_at_read = {r: 0 for r in workers}
    updates: list[Update] = []
    waiting: list[int] = []
    active = set(workers)

    def reply(r: int, stop: bool = False) -> None:
        lead_at_read[r] = clock[r] - min(clock.values())
        dist.send(torch.cat([params, torch.tensor([-1.0 if stop else float(version)])]), dst=r)

    for r in workers:  # everyone starts from version 0
        reply(r)
    buf = torch.empty(n + 2)
    while active:
        src = dist.recv(buf)   # any worker: the first gradient to arrive is the first applied
        if version < total:
            read = int(buf[n].item())
            updates.append(Update(worker=workers.index(src), clock=clock[src], read_version=read,
                                  version=version, staleness=version - read, lead=lead_at_read[src],
                                  loss=float(buf[n + 1].item()), time=time.perf_counter() - start))
            params -= (lr / w) * buf[:n]
            version += 1
            clock[src] += 1
        # (a gradient that arrives after the budget is spent is dropped: its worker just stops)
        waiting.append(src)
        if version >= total:  # budget spent: everyone who asks is told to stop
            for r in waiting:
                reply(r, stop=True)
                active.discard(r)
            waiting.clear()
            continue
        # SSP: a worker may read again only while at most `bound` clocks ahead of the slowest
        slowest = min(clock.values())
        for r in list(waiting):
            if bound is None or clock[r] - slowest <= bound:
                waiting.remove(r)
                reply(r)
    _load(model, params)
    return {"role": "server", "updates": [asdict(u) for u in updates], "version": version,
            "seconds": time.perf_counter() - start}


def _work(model: nn.Module, loss_fn: LossFn, index: int, server: int, slowdown: float,
          step_seconds: float) -> dict:
    start = time.perf_counter()
    n = sum(p.numel() for p in model.parameters())
    buf = torch.empty(n + 1)
    clock = SlowClock()
    waited, step = 0.0, 0
    while True:
        t0 = time.perf_counter()
        dist.recv(buf, src=server)         # blocks while SSP holds this worker back
        waited += time.perf_counter() - t0
        _load(model, buf[:n])
        if buf[n].item() < 0:
            break                          # the server has applied all the updates it wanted
        with slowed(slowdown, clock):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, index, step)
            loss.backward()
            grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            # the emulated accelerator's own time for this gradient (as the heterogeneous DP
            # lesson's): a small model's real compute is shorter than a loaded machine's noise
            time.sleep(step_seconds)
        dist.send(torch.cat([grad, torch.tensor([buf[n].item(), loss.item()])]), dst=server)
        step += 1
    return {"role": "worker", "worker": index, "steps": step, "seconds": time.perf_counter() - start,
            "waited": waited, "work": clock.work, "slept": clock.slept}


def async_sgd(rank: int, world_size: int, model: nn.Module, loss_fn: LossFn, steps: int,
              lr: float, bound: int | None = None, slowdowns: Sequence[float] | None = None,
              server: int = 0, step_seconds: float = 0.0) -> dict:
    """Run on every rank (inside :func:`dtlib.launch`): rank ``server`` serves, the others work.

    The server applies ``steps x workers`` gradients in all (``steps`` rounds of synchronous SGD's
    worth), whoever computes them: workers compute with ``loss_fn(model, worker, clock)`` until
    told to stop, so a fast worker contributes more than a slow one unless SSP holds it back.
    ``bound`` is SSP's staleness bound ``s`` (0: synchronous, every worker exactly ``steps``
    gradients; None: fully asynchronous); ``slowdowns[k]`` makes worker ``k`` that many times
    slower (:func:`~dtlib.parallel.heterogeneous.slowed`), both at its real compute and at the
    ``step_seconds`` of emulated device time each gradient costs (a sleep; 0: none).
    The server's ``model`` ends with the final parameters (a worker's with the last it read). The
    server returns every ``updates``
    record (:class:`Update` as a dict); a worker its number of gradients ``steps``, its time ``seconds``, ``waited`` (on the server),
    ``work`` and ``slept``.
    """
    steps = validate.integer("steps", steps, minimum=1)
    lr = validate.number("lr", lr)
    if bound is not None:
        bound = validate.integer("bound", bound, minimum=0)
    if world_size < 2:
        raise ValueError(f"a parameter server needs world_size >= 2 (a server and a worker), got {world_size}")
    workers = [r for r in range(world_size) if r != server]
    slowdowns = list(slowdowns) if slowdowns is not None else [1.0] * len(workers)
    if len(slowdowns) != len(workers):
        raise ValueError(f"slowdowns must give one factor per worker ({len(workers)}), got {len(slowdowns)}")
    for k, f in enumerate(slowdowns):
        validate.number(f"slowdowns[{k}]", f, minimum=1, exclusive=False)
    step_seconds = validate.number("step_seconds", step_seconds, minimum=0, exclusive=False)
    if rank == server:
        return _serve(model, workers, steps * len(workers), lr, bound)
    index = workers.index(rank)
    return _work(model, loss_fn, index, server, slowdowns[index], step_seconds)
