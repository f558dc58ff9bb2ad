"""The check's own rank in the learner's ring all-reduce (:mod:`~dtlib.grading.witness`).

The last rank of the ring runs no learner code: it plays the ring all-reduce of the lesson
(Patarasuk & Yuan 2009; the schedule of ``exercises/02_communication.ipynb``, Q1) with the
learner's ranks and checks every message it receives from its left neighbour: exactly ``2(n-1)``
point-to-point messages of one chunk (``1/n`` of the tensor) each, holding the partial sums of
reduce-scatter, then the finished sums of all-gather. A built-in collective leaves it waiting, a
whole tensor where a chunk belongs is seen, and so is a wrong partial sum. Which chunk the left
neighbour starts with is read from its first message, so any offset of the schedule passes. On
2 ranks the witness is the learner's only peer: every message is seen.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from dtlib.grading.witness import Witnessed, run_with_witness, say

__all__ = ["witness_ring", "WITNESS_SHAPE"]

WITNESS_SHAPE: tuple[int, ...] = (12,)  # divides by 2, 3 and 4: every chunk has the same size


def _witness(rank: int, n: int, fd: int, fn: Callable, make_input: Callable, shape: tuple) -> None:
    """The last rank of the ring: the lesson's schedule, every received message checked."""
    left, right = (rank - 1) % n, (rank + 1) % n
    numel = math.prod(shape)
    m = numel // n
    inputs = [make_input(shape, r).view(-1) for r in range(n)]
    chunk = [[x[c * m:(c + 1) * m] for c in range(n)] for x in inputs]  # tensor_split, even sizes
    total = [sum(chunk[r][c] for r in range(n)) for c in range(n)]
    mine = [c.clone() for c in chunk[rank]]

    def receive(phase: str, step: int) -> torch.Tensor:
        say(fd, waiting=f"{phase} step {step}")
        buf = torch.full((numel,), float("nan"))  # larger than a chunk: a whole tensor is seen
        dist.recv(buf, left)
        if not buf[m:].isnan().all():
            say(fd, problem=f"rank {left} sent the check's rank {rank} more than one chunk in "
                             f"{phase} step {step} (a whole tensor of {numel} elements?); a ring "
                             f"sends its right neighbour one chunk of {m} elements (1/{n} of the "
                             "tensor) per step")
            raise Witnessed("message too long")
        return buf[:m]

    def wrong(what: str) -> None:
        say(fd, problem=what)
        raise Witnessed(what)

    got = receive("reduce-scatter", 0)
    starts = [c for c in range(n) if torch.equal(got, chunk[left][c])]
    if not starts:
        wrong(f"rank {left}'s first message to the check's rank {rank} was not a chunk of its own "
              "tensor: reduce-scatter's first step sends one of the rank's own chunks, unsummed")
    j = starts[0]
    dist.send(mine[(j + 1) % n].clone(), right)  # this rank's own chunk, one behind its left's
    c = j
    for step in range(1, n - 1):
        mine[c] += got
        work = dist.isend(mine[c].clone(), right)
        got = receive("reduce-scatter", step)
        work.wait()
        c = (j - step) % n
        want = sum(chunk[(left - i) % n][c] for i in range(step + 1))
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
            wrong(f"in reduce-scatter step {step} rank {left} sent the check's rank {rank} a chunk "
                  f"that is not the sum of chunk {c} over the {step + 1} ranks before it: add each "
                  "received chunk into your own before passing it on")
    mine[c] += got  # this rank's chunk c is now the sum over every rank
    full = c
    for step in range(n - 1):
        work = dist.isend(mine[(full - step) % n].clone(), right)
        got = receive("all-gather", step)
        work.wait()
        c = (full - step - 1) % n
        if not torch.allclose(got, total[c], rtol=1e-5, atol=1e-5):
            wrong(f"in all-gather step {step} rank {left} sent the check's rank {rank} a chunk "
                  f"that is not the finished sum of chunk {c}: all-gather passes the finished "
                  "chunks on, copied (not added)")
        mine[c] = got.clone()
    say(fd, done=True)


def _learner(rank: int, n: int, fn: Callable, make_input: Callable, shape: tuple) -> None:
    fn(make_input(shape, rank))  # no barrier first: the witness calls no collective at all


def witness_ring(fn: Callable, world_size: int, make_input: Callable,
                 shape: tuple[int, ...] = WITNESS_SHAPE, timeout: float = 20.0) -> str | None:
    """Run ``fn(tensor)`` on ranks ``0 .. world_size - 2`` with the check's witness as the last
    rank of the ring; ``make_input(shape, rank)`` gives each rank's tensor. Returns what the
    witness saw wrong, in words, or None if it took part in a correct ring."""
    if math.prod(shape) % world_size:
        raise ValueError(f"shape {shape} must divide by world_size={world_size}")
    record, failure = run_with_witness(_learner, _witness, world_size,
                                       (fn, make_input, tuple(shape)), timeout)
    witness = world_size - 1
    if record.get("done") and failure is None:
        return None
    if "problem" in record:
        return f"on {world_size} ranks with the check's own rank {witness} in your ring: {record['problem']}"
    if "waiting" in record:
        return (f"on {world_size} ranks the check's own rank {witness}, in your ring, waited in vain "
                f"for {record['waiting']}'s chunk from rank {witness - 1}: pass one chunk per step "
                "to the right neighbour by point-to-point messages; a built-in collective or a "
                "message to another rank leaves the ring waiting")
    return (f"on {world_size} ranks the check's own rank {witness} in your ring ended without a "
            "word (a message longer than the tensor, or the rank was killed)")
