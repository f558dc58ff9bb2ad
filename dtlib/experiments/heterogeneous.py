"""What lesson 11 runs on a heterogeneous cluster: one slow rank, and each fix measured.

* :func:`balance_data_parallel` - synchronous DP on ranks of different speeds (injected with
  :func:`~dtlib.parallel.heterogeneous.slowed`): (a) equal batches, every rank waiting for the
  slowest; (b) batches proportional to the throughput each rank measured in (a), gradients
  averaged by sample count - and checked equal to one process on the same global batches.
* :func:`balance_pipeline` - TinyGPT's layers on 4 pipeline stages, one of them slow: (c) an even
  split against one balanced by measured per-layer time x the stage's slowdown.
* :func:`staleness_runs` - asynchronous SGD with a parameter server under SSP bounds.

Every rank's compute is real; only the slowness is a sleep. Times are wall-clock on this machine,
so the lesson prints ratios computed from them, never fixed claims.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from dtlib.analytic import validate
from dtlib.corpus import token_batch
from dtlib.experiments.local_sgd import gpt_model, held_out_loss, lm_loss, one_thread
from dtlib.launcher import launch
from dtlib.models.gpt import TinyGPT, tiny_gpt_config
from dtlib.parallel.heterogeneous import (proportional_batch_sizes, slowed,
                                          time_balanced_counts, weighted_average_gradients)
from dtlib.parallel.parameter_server import async_sgd
from dtlib.parallel.pipeline import PipelineExecutor, partition
from dtlib.parallel.schedules import schedule

__all__ = ["balance_data_parallel", "balance_pipeline", "staleness_runs"]


def _dp_phase(rank: int, world_size: int, model: torch.nn.Module, opt: torch.optim.Optimizer,
              sizes: list[int], slowdown: float, steps: int, first_step: int, global_batch: int,
              seq: int, sample_seconds: float) -> dict:
    begin = sum(sizes[:rank])
    step_times, busy = [], []
    for step in range(first_step, first_step + steps):
        x, y = token_batch(step, global_batch, seq)
        x, y = x[begin:begin + sizes[rank]], y[begin:begin + sizes[rank]]
        start = time.perf_counter()
        with slowed(slowdown) as clock:
            loss = lm_loss(model, x, y)
            loss.backward()
            # the emulated accelerator's own time for these samples (as PipelineExecutor's
            # emulate=): on 2 shared cores the real compute alone is too noisy to balance on
            time.sleep(sizes[rank] * sample_seconds)
        weighted_average_gradients(model, sizes[rank])  # waits here for the slowest rank
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - start)
        busy.append(clock.work + clock.slept)
    # the first step pays for warm-up: the median of the others is this rank's steady pace
    steady = float(torch.tensor(busy[1:]).median())
    return {"step_times": step_times, "busy": steady, "throughput": sizes[rank] / steady}


def _dp_worker(rank: int, world_size: int, slowdowns: Sequence[float], global_batch: int,
               steps: int, sample_seconds: float) -> dict:
    model = gpt_model(small=True)
    seq = model.cfg.seq
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    even = [global_batch // world_size] * world_size
    equal = _dp_phase(rank, world_size, model, opt, even, slowdowns[rank], steps, 0, global_batch, seq,
                      sample_seconds)
    # every rank learns every rank's measured throughput, so all compute the same split
    speeds = [torch.zeros(1) for _ in range(world_size)]
    dist.all_gather(speeds, torch.tensor([equal["throughput"]]))
    sizes = proportional_batch_sizes([s.item() for s in speeds], global_batch)
    balanced = _dp_phase(rank, world_size, model, opt, sizes, slowdowns[rank], steps, steps,
                         global_batch, seq, sample_seconds)
    return {"equal": equal, "balanced": balanced, "sizes": sizes,
            "params": [p.detach().clone() for p in model.parameters()]}


def balance_data_parallel(slowdowns: Sequence[float] = (1.0, 1.0, 1.0, 3.0), global_batch: int = 32,
                          steps: int = 4, sample_ms: float = 2.0, timeout: float = 120.0) -> dict:
    """(a) equal batches, then (b) throughput-proportional batches with sample-weighted gradients.

    Each rank computes its samples for real and then sleeps ``sample_ms`` per sample (the emulated
    device's time), all of it ``slowdowns[rank]`` times slower (:func:`slowed`).

    Returns, for ``"equal"`` and ``"balanced"``: per rank its ``busy`` seconds per step (compute,
    slowed; median)
    and ``step_time`` (median, the same for all: everyone waits for the slowest), the ``sizes``
    each rank got, ``throughput`` (global samples/s); and ``max_diff_vs_one_process`` between the
    ranks' final weights and one process trained on the same global batches.
    """
    slowdowns = [validate.number(f"slowdowns[{k}]", f, minimum=1, exclusive=False)
                 for k, f in enumerate(slowdowns)]
    world = len(slowdowns)
    validate.integer("global_batch", global_batch, minimum=world)
    if global_batch % world:
        raise ValueError(f"global_batch must be divisible by the {world} ranks for the equal split, "
                         f"got {global_batch}")
    steps = validate.integer("steps", steps, minimum=2)
    sample_ms = validate.number("sample_ms", sample_ms, minimum=0, exclusive=False)
    ranks = launch(_dp_worker, world, args=(slowdowns, global_batch, steps, sample_ms / 1e3),
                   timeout=timeout, output="none")
    # the reference: one process, every global batch whole, the same optimizer
    ref = gpt_model(small=True)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with one_thread():
        _one_process(ref, opt, steps, global_batch)
    diff = max((a - b).abs().max().item() for a, b in zip(ranks[0]["params"], ref.parameters()))
    out: dict = {"slowdowns": slowdowns, "max_diff_vs_one_process": diff}
    for phase in ("equal", "balanced"):
        # the first step pays for warm-up: the median of the others is the steady pace
        per_step = [max(r[phase]["step_times"][i] for r in ranks) for i in range(steps)]
        step_time = float(torch.tensor(per_step[1:]).median())
        sizes = [global_batch // world] * world if phase == "equal" else ranks[0]["sizes"]
        out[phase] = {"sizes": sizes, "busy": [r[phase]["busy"] for r in ranks],
                      "step_time": step_time, "throughput": global_batch / step_time}
    return out


def _one_process(ref: TinyGPT, opt: torch.optim.Optimizer, steps: int, global_batch: int) -> None:
    for step in range(2 * steps):
        x, y = token_batch(step, global_batch, ref.cfg.seq)
        lm_loss(ref, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _pipe_worker(rank: int, world_size: int, counts: list[int], stage_seconds: list[float],
                 microbatches: int, batch: int, steps: int, layers: int) -> dict:
    model = _pipeline_model(layers)
    stage = partition(model, world_size, balance=counts)[rank]
    actions = schedule("gpipe", world_size, microbatches)
    # this stage's emulated device time per micro-batch, forward : backward = 1 : 2
    cost = stage_seconds[rank]
    run = PipelineExecutor([stage], actions, rank, loss_fn=lambda out, y: torch.nn.functional.cross_entropy(
        out.reshape(-1, out.shape[-1]), y.reshape(-1)), emulate={"F": cost / 3, "B": 2 * cost / 3})
    times = []
    for step in range(steps):
        x, y = token_batch(step, batch, model.cfg.seq)
        dist.barrier()
        start = time.perf_counter()
        run.step(x, y)
        times.append(time.perf_counter() - start)
        stage.zero_grad(set_to_none=True)
    return {"times": times}


def _pipeline_model(layers: int) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(tiny_gpt_config(layers=layers, hidden=64, heads=4, vocab=256, seq=32,
                                   tied_embeddings=False))


def _layer_seconds(model: TinyGPT, batch: int = 2, rounds: int = 8) -> tuple[float, list[float], float]:
    """Forward + backward seconds of the embedding, each block and the head, measured round-robin
    (every piece once per round, the minimum over rounds): a burst of load from another process
    then slows one round of every piece, not every round of a few pieces."""
    idx = torch.randint(0, model.cfg.vocab, (batch, model.cfg.seq))
    hidden = model.embed(idx).detach().requires_grad_()
    pieces = [(model.embed, idx)] + [(b, hidden) for b in model.blocks] + [(model.head, hidden)]
    best = [float("inf")] * len(pieces)
    for _ in range(rounds + 1):  # the first round warms up allocations
        for i, (fn, x) in enumerate(pieces):
            start = time.perf_counter()
            fn(x).float().sum().backward()
            best[i] = min(best[i], time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return best[0], best[1:-1], best[-1]


def balance_pipeline(slowdowns: Sequence[float] = (1.0, 3.0, 1.0, 1.0), layers: int = 8,
                     layer_ms: float = 4.0, microbatches: int = 4, steps: int = 3,
                     timeout: float = 120.0) -> dict:
    """(c) pipeline stages split evenly, then by measured time: TinyGPT with ``layers`` blocks on
    ``len(slowdowns)`` stages (GPipe), stage k a device ``slowdowns[k]`` times slower.

    Each piece's forward + backward time is measured here (:func:`_layer_seconds`), scaled so an average block takes ``layer_ms`` on the emulated device, and each
    stage sleeps its share x its slowdown per micro-batch (``PipelineExecutor(emulate=...)``).
    Returns, for ``"even"`` and ``"balanced"``: block ``counts``, emulated ``stage_seconds`` and
    the measured ``step_time``; and the measured ``layer_seconds``.
    """
    slowdowns = [validate.number(f"slowdowns[{k}]", f, minimum=1, exclusive=False)
                 for k, f in enumerate(slowdowns)]
    pp = len(slowdowns)
    layers = validate.integer("layers", layers, minimum=pp)
    with one_thread():  # as on a rank
        emb, blocks, head = _layer_seconds(_pipeline_model(layers))
    scale = layer_ms / 1e3 / (sum(blocks) / len(blocks))
    weights = [b * scale for b in blocks]
    weights[0] += emb * scale     # the embedding runs on the first stage,
    weights[-1] += head * scale   # the final norm and LM head on the last
    plans = {"even": [layers // pp + (k < layers % pp) for k in range(pp)],
             "balanced": time_balanced_counts(weights, slowdowns)}
    out: dict = {"slowdowns": slowdowns, "layer_seconds": weights}
    for name, counts in plans.items():
        bounds = [sum(counts[:k]) for k in range(pp + 1)]
        stage_seconds = [slowdowns[k] * sum(weights[bounds[k]:bounds[k + 1]]) for k in range(pp)]
        ranks = launch(_pipe_worker, pp, args=(counts, stage_seconds, microbatches, 2 * microbatches,
                                               steps, layers), timeout=timeout, output="none")
        per_step = [max(r["times"][i] for r in ranks) for i in range(steps)]
        out[name] = {"counts": counts, "stage_seconds": stage_seconds,
                     "step_time": float(torch.tensor(per_step[1:] or per_step).median())}
    return out


def _ps_worker(rank: int, world_size: int, bound: int | None, slowdowns: Sequence[float],
               steps: int, lr: float, shard: int, step_seconds: float) -> dict:
    model = gpt_model(small=True)
    seq = model.cfg.seq
    workers = world_size - 1

    def loss_fn(m: torch.nn.Module, worker: int, clock: int) -> torch.Tensor:
        x, y = token_batch(clock, workers * shard, seq)
        return lm_loss(m, x[worker * shard:(worker + 1) * shard], y[worker * shard:(worker + 1) * shard])

    out = async_sgd(rank, world_size, model, loss_fn, steps, lr=lr, bound=bound, slowdowns=slowdowns,
                    step_seconds=step_seconds)
    if rank == 0:
        out["held_out"] = held_out_loss(model, seq)
    return out


def staleness_runs(bounds: Sequence[int | None] = (0, 2, None),
                   slowdowns: Sequence[float] = (3.0, 1.0, 1.0), steps: int = 12, lr: float = 0.5,
                   shard: int = 4, step_seconds: float = 0.04, timeout: float = 120.0) -> dict:
    """Asynchronous SGD (server on rank 0, one worker per slowdown) under each SSP ``bound``.

    Each gradient costs ``step_seconds`` of emulated device time (x the worker's slowdown): the
    small model computes one in about a millisecond, less than a round trip to the server on a
    loaded 2-core machine, so without it the slow worker would hardly be slower.

    Returns ``{bound: {"updates": [...], "seconds", "held_out"}}`` (the server's records,
    :class:`~dtlib.parallel.parameter_server.Update` as dicts; the key of ``None`` is ``"async"``).
    """
    step_seconds = validate.number("step_seconds", step_seconds, minimum=0, exclusive=False)
    out = {}
    for bound in bounds:
        ranks = launch(_ps_worker, len(slowdowns) + 1,
                       args=(bound, list(slowdowns), steps, lr, shard, step_seconds),
                       timeout=timeout, output="none")
        server = ranks[0]
        out["async" if bound is None else bound] = {
            "updates": server["updates"], "seconds": max(r["seconds"] for r in ranks),
            "held_out": server["held_out"]}
    return out
