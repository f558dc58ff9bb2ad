"""A rank of the check's own inside the learner's ring: the ring's behaviour seen from outside.

What a rank measures about its own run (bytes sent, collectives called) is read in the process
where the learner's code runs, so that code can forge it (issue 39). Here the last rank of the
ring runs no learner code: it plays the ring all-reduce of the lesson (Patarasuk & Yuan 2009;
the schedule of ``exercises/02_communication.ipynb``, Q1) with the learner's ranks and checks
every message it receives from its left neighbour: exactly ``2(n-1)`` point-to-point messages of
one chunk (``1/n`` of the tensor) each, holding the partial sums of reduce-scatter, then the
finished sums of all-gather. A built-in collective leaves it waiting (gloo matches a collective
only with the same collective), a whole tensor where a chunk belongs is seen, and so is a wrong
partial sum. Which chunk the left neighbour starts with is read from its first message, so any
offset of the schedule passes.

What it cannot see: messages between two of the learner's own ranks (on 2 ranks there are none:
the witness is the only peer) and channels other than the process group (shared memory, files).
Its findings reach the check through a pipe only it holds (the learner's ranks close their ends
before any of their code runs), as JSON lines: the last one says where it stopped and why.
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable

import torch
import torch.distributed as dist

from dtlib.launcher import LaunchError, launch

__all__ = ["witness_ring", "WITNESS_SHAPE"]

WITNESS_SHAPE: tuple[int, ...] = (12,)  # divides by 2, 3 and 4: every chunk has the same size
_REPORT_LIMIT = 1 << 16


def _say(fd: int, **record: object) -> None:
    os.write(fd, (json.dumps(record) + "\n").encode())


def _witness(rank: int, n: int, make_input: Callable, shape: tuple, fd: int) -> None:
    """The last rank of the ring: the lesson's schedule, every received message checked."""
    left, right = (rank - 1) % n, (rank + 1) % n
    numel = math.prod(shape)
    m = numel // n
    inputs = [make_input(shape, r).view(-1) for r in range(n)]
    chunk = [[x[c * m:(c + 1) * m] for c in range(n)] for x in inputs]  # tensor_split, even sizes
    total = [sum(chunk[r][c] for r in range(n)) for c in range(n)]
    mine = [c.clone() for c in chunk[rank]]

    def receive(phase: str, step: int) -> torch.Tensor:
        _say(fd, waiting=f"{phase} step {step}")
        buf = torch.full((numel,), float("nan"))  # larger than a chunk: a whole tensor is seen
        dist.recv(buf, left)
        if not buf[m:].isnan().all():
            _say(fd, problem=f"rank {left} sent the check's rank {rank} more than one chunk in "
                             f"{phase} step {step} (a whole tensor of {numel} elements?); a ring "
                             f"sends its right neighbour one chunk of {m} elements (1/{n} of the "
                             "tensor) per step")
            raise AssertionError("message too long")
        return buf[:m]

    def wrong(what: str) -> None:
        _say(fd, problem=what)
        raise AssertionError(what)

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
    _say(fd, done=True)


def _ring_with_witness(rank: int, n: int, fn: Callable, make_input: Callable, shape: tuple,
                       read_fd: int, write_fd: int) -> None:
    os.close(read_fd)
    if rank == n - 1:
        try:
            _witness(rank, n, make_input, shape, write_fd)
        finally:
            os.close(write_fd)
        return None
    os.close(write_fd)  # before any learner code: only the witness can write the report
    fn(make_input(shape, rank))  # no barrier first: the witness calls no collective at all
    return None


def _last_record(read_fd: int) -> dict:
    data = b""
    while len(data) < _REPORT_LIMIT:
        part = os.read(read_fd, _REPORT_LIMIT)
        if not part:
            break
        data += part
    records = [json.loads(line) for line in data.decode(errors="replace").splitlines() if line]
    return records[-1] if records else {}


def witness_ring(fn: Callable, world_size: int, make_input: Callable,
                 shape: tuple[int, ...] = WITNESS_SHAPE, timeout: float = 20.0) -> str | None:
    """Run ``fn(tensor)`` on ranks ``0 .. world_size - 2`` with the check's witness as the last
    rank of the ring; ``make_input(shape, rank)`` gives each rank's tensor. Returns what the
    witness saw wrong, in words, or None if it took part in a correct ring."""
    if math.prod(shape) % world_size:
        raise ValueError(f"shape {shape} must divide by world_size={world_size}")
    read_fd, write_fd = os.pipe()
    failure = None
    try:
        launch(_ring_with_witness, world_size,
               args=(fn, make_input, tuple(shape), read_fd, write_fd), timeout=timeout,
               output="none")
    except LaunchError as e:
        failure = e
    finally:
        os.close(write_fd)  # every rank has ended (launch kills them): the pipe reads to its end
    try:
        record = _last_record(read_fd)
    finally:
        os.close(read_fd)
    witness = world_size - 1
    if record.get("done") and failure is None:
        return None
    if "problem" in record:
        return f"on {world_size} ranks with the check's own rank {witness} in your ring: {record['problem']}"
    if "waiting" in record:
        return (f"on {world_size} ranks the check's own rank {witness} took part in your ring and "
                f"waited for {record['waiting']}'s chunk from rank {witness - 1}, which never "
                "came: a ring passes one chunk per step to the right neighbour with point-to-point "
                "messages; a built-in collective (dist.all_reduce, ...) or a message to another "
                "rank leaves the ring waiting")
    return (f"on {world_size} ranks the check's own rank {witness} in your ring ended without a "
            "word (a message longer than the tensor, or the rank was killed)")
