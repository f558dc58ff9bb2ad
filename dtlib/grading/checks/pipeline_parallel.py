"""Checks for the pipeline-parallel exercise: the learner's 1F1B schedule generator.

* :func:`check_one_f_one_b` - ``fn(stages, microbatches)`` returns one list of
  :class:`~dtlib.parallel.Action` per rank; for several (p, m), including m < p, the schedule is
  validated (every backward after its forward, nothing missing, no deadlock:
  :func:`dtlib.parallel.validate`), simulated (bubble ``(p-1)/m``, Narayanan et al. 2021,
  Sec. 2.2.1) and must hold no more than ``min(p - r, m)`` micro-batches on rank ``r`` (1F1B's
  bound; GPipe holds all ``m``).
* :func:`check_one_f_one_b_on_ranks` - the learner's schedule run by
  :class:`~dtlib.parallel.PipelineExecutor` on real gloo ranks: loss and gradients equal one
  process on the whole batch, and the micro-batches each rank really held equal the bound.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from dtlib.experiments.pipeline import DEMO_CONFIG, demo_batch, lm_loss, demo_model
from dtlib.grading.feedback import first_line
from dtlib.launcher import LaunchError, launch
from dtlib.parallel.pipeline import PipelineExecutor, partition, rank_chunks
from dtlib.parallel.schedules import Action, simulate, validate

__all__ = ["check_one_f_one_b", "check_one_f_one_b_on_ranks", "CASES"]

# (stages, micro-batches): m > p, m = p, m < p, a single micro-batch, a single stage
CASES = [(4, 8), (2, 5), (3, 3), (4, 2), (3, 1), (1, 3)]
_WARMUP_HINT = ("rank r runs min(p - r - 1, m) warm-up forwards, then alternates one forward and "
                "one backward, then runs the remaining backwards (cool-down)")


def _call(fn: Callable, p: int, m: int) -> list[list[Action]]:
    """The learner's schedule for (p, m), checked for shape before anything reads it."""
    where = f"one_f_one_b({p}, {m})"
    out = fn(p, m)
    if out is None:
        raise AssertionError(f"{where} returned None: return one list of Action per rank, "
                             f"e.g. [[Action('F', 0), Action('B', 0)], ...]")
    out = [list(ops) for ops in out]
    if len(out) != p:
        raise AssertionError(f"{where} returned {len(out)} lists: return one list of actions per rank ({p})")
    for rank, ops in enumerate(out):
        for i, a in enumerate(ops):
            if not isinstance(a, Action):
                raise AssertionError(f"{where}: rank {rank} has {a!r}; use Action(kind, microbatch), "
                                     f"e.g. Action('F', 0)")
            # plain values from here on: the ranks run only dtlib's executor on them (issue 39)
            ops[i] = a = Action(str(a.kind), int(a.microbatch), int(a.chunk))
            if a.kind not in ("F", "B") or a.chunk != 0:
                raise AssertionError(f"{where}: rank {rank} has {a}; 1F1B uses only Action('F', i) "
                                     f"and Action('B', i), one chunk per rank")
            if not 0 <= a.microbatch < m:
                raise AssertionError(f"{where}: rank {rank} runs micro-batch {a.microbatch} but there "
                                     f"are only {m} (0..{m - 1}): cap the warm-up at m, min(p - r - 1, m)")
    return out


def check_one_f_one_b(fn: Callable[[int, int], Any]) -> None:
    """Valid, bubble (p-1)/m, and at most min(p - r, m) micro-batches held on rank r."""
    for p, m in CASES:
        actions = _call(fn, p, m)
        where = f"with p={p}, m={m}"
        try:
            validate(actions)
        except ValueError as e:
            if "deadlock" in str(e):  # the verdict first; which rank waits for which on the next line
                raise AssertionError(f"{where}: deadlock; the warm-up is longest on rank 0: {_WARMUP_HINT}"
                                     f"\n{e}") from None
            hint = ("; " + _WARMUP_HINT) if "never runs" in str(e) else ""
            raise AssertionError(f"{where}: {e}{hint}") from None
        timeline = simulate(actions)
        if abs(timeline.bubble_ratio - (p - 1) / m) > 1e-9:
            raise AssertionError(f"{where} the simulated bubble is {timeline.bubble_ratio:.3f} of the "
                                 f"compute, not (p-1)/m = {(p - 1) / m:.3f}: ranks wait longer than they "
                                 f"must; {_WARMUP_HINT}")
        for rank, held in enumerate(timeline.peak_in_flight):
            bound = min(p - rank, m)
            if held > bound:
                kind = " (all of them: that is GPipe)" if held == m else ""
                raise AssertionError(f"{where} rank {rank} holds {held} micro-batches at once{kind}, "
                                     f"1F1B at most min(p - r, m) = {bound}: start the backwards after "
                                     f"p - r - 1 = {p - rank - 1} warm-up forwards")


def _worker(rank: int, world_size: int, actions: list[list[Action]], batch: int) -> dict[str, Any]:
    """Runs the schedule with dtlib's executor; returns the loss, this rank's gradients and the
    micro-batches it held (one process's loss and gradients are the check's: issue 39)."""
    x, y = demo_batch(DEMO_CONFIG, batch, seed=3)
    model = demo_model(DEMO_CONFIG)
    ex = PipelineExecutor(rank_chunks(partition(model, world_size), rank, world_size), actions, rank, lm_loss)
    log = ex.step(x, y)
    mine = {id(q) for q in ex.parameters()}
    return {"loss": log.loss, "peak": max(n for _, n in log.held),
            "grads": {k: None if q.grad is None else q.grad.clone()
                      for k, q in model.named_parameters() if id(q) in mine}}


def _one_process(batch: int) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradients of the whole model on the whole batch, in one process."""
    x, y = demo_batch(DEMO_CONFIG, batch, seed=3)
    with torch.random.fork_rng(devices=[]):  # demo_model seeds: leave the caller's generator be
        model = demo_model(DEMO_CONFIG)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.item(), {k: q.grad for k, q in model.named_parameters()}


def check_one_f_one_b_on_ranks(fn: Callable[[int, int], Any], world_size: int = 4, microbatches: int = 4) -> None:
    """The learner's schedule on ``world_size`` real ranks equals one process; each rank holds
    at most min(p - r, m) micro-batches (counted by the executor)."""
    check_one_f_one_b(fn)  # a schedule that cannot run is reported before any process starts
    actions = _call(fn, world_size, microbatches)
    try:
        results = launch(_worker, world_size, args=(actions, 2 * microbatches), timeout=60, output="none")
    except LaunchError as e:
        raise AssertionError(f"your schedule failed on {world_size} ranks: {first_line(e)}") from None
    ref_loss, ref_grads = _one_process(2 * microbatches)  # after the launch: no rank holds it
    loss = results[-1]["loss"]
    if not abs(loss - ref_loss) <= 1e-5 * abs(ref_loss):  # a NaN loss fails too
        raise AssertionError(f"on {world_size} ranks the loss is {loss:.6f}, one process gives "
                             f"{ref_loss:.6f}: every micro-batch must run forward and backward once")
    for rank, r in enumerate(results):
        if not all(g is not None and torch.allclose(g, ref_grads[k], rtol=1e-5, atol=1e-6)
                   for k, g in r["grads"].items()):
            raise AssertionError(f"on {world_size} ranks rank {rank}'s gradients differ from one process: "
                                 f"every micro-batch must run forward and backward exactly once")
        if r["peak"] > min(world_size - rank, microbatches):
            raise AssertionError(f"on {world_size} ranks rank {rank} held {r['peak']} micro-batches; "
                                 f"1F1B holds at most {min(world_size - rank, microbatches)}")
