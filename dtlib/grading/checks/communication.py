"""Checks for the communication exercise: ring all-reduce from send/recv, and bucketed DDP.

* :func:`check_ring_all_reduce` runs the learner's ring on 2, 3 and 4 real ranks, on sizes that
  do and do not divide by the world size, against the sum the check computes; it also counts the
  bytes each rank sends (a ring sends at most 2(n-1)/n of the buffer, Patarasuk & Yuan 2009) and
  refuses built-in collectives. Those counts are taken in the rank, where the learner's code
  could forge them, so they only word the feedback: the grade's word on the behaviour is a run
  with the check's own rank in the ring (:mod:`~dtlib.grading.ring_witness`), which sees
  every message its neighbour sends it.
* :func:`check_make_buckets` compares the learner's bucket assignment with
  :func:`dtlib.parallel.assign_buckets` (PyTorch's rule) on the parameters in reverse order.
* :func:`check_bucketed_ddp` trains with the learner's small bucketed DDP on 2 ranks: one
  asynchronous all-reduce per bucket, issued while ``backward()`` still runs, and parameters equal
  to single-process training on the full batch. The calls and their times are spied on in the
  rank (feedback only, forgeable there); the number, sizes, contents and overlap of the
  all-reduces are judged by a run beside the check's own rank
  (:mod:`~dtlib.grading.ddp_witness`). :func:`record_timeline` returns the learner's
  run as a :class:`~dtlib.parallel.SyncRecord`, so the lesson's timeline plot can draw it.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.grading.ddp_witness import witness_ddp
from dtlib.grading.ring_witness import witness_ring
from dtlib.grading.checks import max_diff
from dtlib.grading.feedback import first_line
from dtlib.measure import CollectiveCounter
from dtlib.launcher import LaunchTimeoutError, RankFailedError, launch
from dtlib.analytic.units import MiB
from dtlib.parallel.buckets import assign_buckets
from dtlib.parallel.ddp import SyncRecord

__all__ = ["check_ring_all_reduce", "check_make_buckets", "check_bucketed_ddp",
           "record_timeline", "RING_SHAPES", "ddp_model", "first_line"]

# sizes that divide by 2, 3 and 4 (12), and ones that do not (7, 3x5 = 15, 1001)
RING_SHAPES: tuple[tuple[int, ...], ...] = ((12,), (7,), (3, 5), (1001,))
_P2P = ("send", "isend", "recv", "irecv")



def _rank_input(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + math.prod(shape))
    return torch.randn(shape, generator=g)


def _ring_worker(rank: int, world_size: int, fn: Callable, shapes: tuple) -> list[dict]:
    """Runs only the learner's ring; what it returns is data (the sum it is compared with is
    computed by the check, in its own process: issue 39)."""
    out = []
    for shape in shapes:
        tensor = _rank_input(shape, rank)
        dist.barrier()  # every rank has made its input before any sends
        with CollectiveCounter() as counter:
            returned = fn(tensor)
        result = tensor if returned is None else returned
        dist.barrier()  # no rank moves on to the next size while a peer still sends
        out.append({"result": result.detach().clone() if isinstance(result, torch.Tensor) else None,
                    "returned_type": type(returned).__name__, "sent": counter.bytes("send"),
                    "collectives": sorted(set(counter.counts) - {"send", "recv"})})
    return out


def _ring_expected(world_size: int, shapes: tuple) -> list[list[dict]]:
    """Per rank and shape, its input and the sum over ranks, made by the check from the seeds."""
    per_shape = []
    for shape in shapes:
        inputs = [_rank_input(shape, r) for r in range(world_size)]
        per_shape.append((shape, inputs, torch.stack(inputs).sum(0)))
    return [[{"shape": shape, "input": inputs[rank], "expected": total}
             for shape, inputs, total in per_shape] for rank in range(world_size)]


def _ring_diagnosis(world_size: int, shapes: tuple, returned: list[list[dict]]) -> str | None:
    """What is wrong, in words, or None if every rank holds the sum everywhere."""
    n = world_size
    results = [[{**want, **got} for want, got in zip(wants, gots)]
               for wants, gots in zip(_ring_expected(n, shapes), returned)]
    wrong: list[tuple[int, dict]] = []
    for rank, per_shape in enumerate(results):
        for r in per_shape:
            if r["collectives"]:
                return (f"rank {rank} called torch.distributed.{r['collectives'][0]}: build the ring "
                        "from point-to-point messages only (dist.isend / dist.irecv, or dist.send / "
                        "dist.recv)")
            if r["result"] is None:
                return (f"your function returned {r['returned_type']} and did not change the tensor "
                        "in place: reduce into the given tensor (like dist.all_reduce) or return it")
            if r["result"].shape != r["expected"].shape:
                return (f"for a tensor of shape {tuple(r['shape'])} on {n} ranks you returned shape "
                        f"{tuple(r['result'].shape)}: return the tensor, in its original shape")
            if not torch.allclose(r["result"], r["expected"], rtol=1e-5, atol=1e-5):
                wrong.append((rank, r))
    if wrong:
        bad_shapes = {r["shape"] for _, r in wrong}
        uneven = {s for s in bad_shapes if math.prod(s) % n}
        rank, r = wrong[0]
        numel = math.prod(r["shape"])
        res, exp, inp = (t.reshape(-1) for t in (r["result"], r["expected"], r["input"]))

        def reduced_chunks(rec: dict) -> int:
            got, want = rec["result"].reshape(-1), rec["expected"].reshape(-1)
            return sum(torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                       for a, b in zip(got.tensor_split(n), want.tensor_split(n)))

        one_chunk_each = all(reduced_chunks(rec) == 1 for _, rec in wrong)
        if bad_shapes == uneven:
            return (f"correct when the size divides by the world size, wrong for {numel} elements "
                    f"on {n} ranks: the remainder is lost; split into {n} chunks whose sizes differ by "
                    "at most one and send each chunk whole")
        if torch.allclose(res, inp):
            return (f"rank {rank}'s tensor of {numel} elements is unchanged: nothing was summed "
                    "(did the received chunks get added into the tensor?)")
        if one_chunk_each:
            return (f"on {n} ranks each rank holds the sum in one chunk only (rank {rank}, {numel} "
                    "elements): that is the reduce-scatter phase alone. Add the all-gather phase: "
                    f"{n - 1} more step{'s' * (n > 2)} passing the finished chunks around the ring, "
                    "copying (not adding) what you receive")
        i = int((res - exp).abs().argmax())
        return (f"on {n} ranks, rank {rank}'s result is wrong at index {i} of {numel}: got "
                f"{res[i].item():.4f}, expected the sum over ranks {exp[i].item():.4f}; check which chunk "
                "each step sends and which it adds (reduce-scatter) or copies (all-gather): see the "
                "lesson's ring diagram")
    for rank, per_shape in enumerate(results):
        for r in per_shape:
            numel = math.prod(r["shape"])
            nbytes = numel * r["input"].element_size()
            ring = 2 * (n - 1) * math.ceil(numel / n) * r["input"].element_size()
            if r["sent"] > ring:
                return (f"rank {rank} sent {r['sent']} bytes to all-reduce a {nbytes}-byte tensor "
                        f"on {n} ranks; a ring sends each rank's neighbour 2(n-1) chunks of 1/n, at "
                        f"most {ring} bytes (2(n-1)/n of the tensor, whatever n): send chunks to the "
                        "right neighbour, not whole tensors to everyone (or to one root)")
    return None


def check_ring_all_reduce(fn: Callable, world_sizes: tuple[int, ...] = (2, 3, 4),
                          shapes: tuple[tuple[int, ...], ...] = RING_SHAPES,
                          timeout: float = 20.0) -> None:
    """``fn(tensor)`` sums ``tensor`` over all ranks, in place, with a ring of send/recv.

    Runs on each world size in ``world_sizes`` with tensors of ``shapes`` (some not divisible by
    the world size) and compares every rank's result with ``dist.all_reduce``.
    """
    for n in world_sizes:
        try:
            results = launch(_ring_worker, n, args=(fn, tuple(shapes)), timeout=timeout,
                             output="none")
        except LaunchTimeoutError:
            raise AssertionError(
                f"on {n} ranks the ranks hung (no result in {timeout:g} s): a deadlock, every rank "
                "blocked in a send that no rank receives yet; post each step's send and receive "
                "together (non-blocking), and run the same number of steps on every rank") from None
        except RankFailedError as e:
            raise AssertionError(
                f"your function raised on rank {e.rank} of {n}: {first_line(e)}. Tensors have "
                f"shapes {[tuple(s) for s in shapes]}: flatten with tensor.view(-1) and split with "
                "tensor_split (sizes need not divide by the world size)") from None
        problem = _ring_diagnosis(n, tuple(shapes), results)
        if problem:
            raise AssertionError(problem)
    for n in world_sizes:  # the same ring with the check's own rank in it: behaviour seen outside
        problem = witness_ring(fn, n, _rank_input, timeout=timeout)
        if problem:
            raise AssertionError(problem)


# ---- bucketing -------------------------------------------------------------------------------------
def _expected_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """dtlib's (PyTorch's) assignment over the parameters in reverse order, as indices into params."""
    last = len(params) - 1
    return [[last - i for i in b] for b in assign_buckets(list(reversed(params)), cap_bytes)]


def _bucket_cases() -> list[tuple[list[torch.Tensor], int]]:
    g = torch.Generator().manual_seed(7)
    cases = []
    four = [torch.empty(256, 256) for _ in range(4)]  # 256 KiB each, as in the lesson
    for cap in (0, 256 * 1024, 512 * 1024, 600 * 1024, 25 * MiB):
        cases.append((four, cap))
    for _ in range(20):
        sizes = torch.randint(1, 2000, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
        cap = int(torch.randint(0, 12000, (1,), generator=g))
        cases.append(([torch.empty(int(s)) for s in sizes], cap))
    return cases


def check_make_buckets(fn: Callable) -> None:
    """``fn(params, cap_bytes)`` returns buckets (lists of indices into ``params``) in the order
    their gradients become ready: parameters taken last-to-first, a bucket closed as soon as it
    holds at least ``cap_bytes``."""
    for params, cap in _bucket_cases():
        sizes = [p.numel() * p.element_size() for p in params]
        want = _expected_buckets(params, cap)
        got = fn(params, cap)
        where = f"for parameter sizes {sizes} bytes and cap_bytes={cap}"
        if got is None:
            raise AssertionError("make_buckets returned None: return a list of buckets, each a list "
                                 "of indices into params")
        try:
            got = [[int(i) for i in b] for b in got]
        except TypeError:
            raise AssertionError(f"{where} you returned {got!r}: return a list of lists of "
                                 "integer indices into params") from None
        flat = sorted(i for b in got for i in b)
        if flat != list(range(len(params))):
            missing = sorted(set(range(len(params))) - set(flat))
            raise AssertionError(
                f"{where} every parameter must be in exactly one bucket; "
                + (f"indices {missing} are in none (did you forget the last, partly filled "
                   "bucket?)" if missing else f"you returned {got}"))
        if [sorted(b) for b in got] == [sorted(b) for b in want]:
            continue  # the order inside a bucket is free
        if got and 0 in got[0] and 0 not in want[0]:
            raise AssertionError(
                "your first bucket starts with parameter 0, but backward produces the gradients of "
                f"the last parameters first: walk params in reverse order\n{where}: expected "
                f"{want}, got {got}")
        raise AssertionError(
            "a bucket closes at the wrong parameter: re-read when PyTorch closes a bucket (at least "
            f"cap_bytes; a big parameter, cap 0; the last partial bucket)\n{where}: expected buckets "
            f"{want}, got {got}")


# ---- the learner's bucketed DDP on real ranks -------------------------------------------------------
def ddp_model(seed: int = 0, layers: int = 4, width: int = 128) -> nn.Sequential:
    """``layers`` x (Linear(width, width), Tanh); at width 128 a layer holds a 512 B bias and a
    64 KiB weight."""
    torch.manual_seed(seed)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


_DDP_BATCH = 16  # the global batch of the checks' DDP runs, in the ranks and in the check's own reference


def _ddp_batches(steps: int, batch: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g))
            for _ in range(steps)]


def _train_single(data: list, lr: float, scale: float) -> list[torch.Tensor]:
    model = ddp_model()  # the check's shape: 4 layers of width 128
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        (scale * nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _TimedWork:
    """Wraps the work handle of an async all-reduce: notes when ``wait()`` returns."""

    def __init__(self, work: Any, done: list, index: int):
        self._work, self._done, self._index = work, done, index

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._done[self._index] is None:  # the first wait is the one that blocked
            self._done[self._index] = time.perf_counter()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _ddp_step(ddp: Any, x: torch.Tensor, y: torch.Tensor, world_size: int) -> dict:
    """One forward/backward/finish of the learner's wrapper, every all_reduce spied on.

    Returns the step's calls and a :class:`~dtlib.parallel.SyncRecord` of its timeline (bucket
    ``i`` = the ``i``-th all-reduce issued), so the lesson's plot can draw the learner's run."""
    calls: list[dict] = []
    done: list[float | None] = []
    real = dist.all_reduce

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        is_async = bool(kwargs.get("async_op", False) or (len(args) >= 3 and args[2]))
        calls.append({"t": time.perf_counter(), "numel": tensor.numel(), "async": is_async,
                      "bytes": tensor.numel() * tensor.element_size()})
        done.append(None)
        work = real(tensor, *args, **kwargs)
        if not is_async:
            done[-1] = time.perf_counter()
            return work
        return _TimedWork(work, done, len(done) - 1)

    dist.all_reduce = spy
    try:
        start = time.perf_counter()
        out = ddp(x)
        forward_end = time.perf_counter()
        nn.functional.mse_loss(out, y).backward()
        backward_end = time.perf_counter()
        ddp.finish()
        finish_end = time.perf_counter()
    finally:
        dist.all_reduce = real
    record = SyncRecord(world_size, start, forward_end, backward_end=backward_end,
                        finish_end=finish_end, bucket_bytes=[c["bytes"] for c in calls],
                        bucket_ready=[None] * len(calls), bucket_issued=[c["t"] for c in calls],
                        bucket_done=done,
                        comm=[(i, "all_reduce", c["numel"], c["bytes"] // max(c["numel"], 1))
                              for i, c in enumerate(calls)])
    waits = [d for c, d in zip(calls, done) if c["async"]]
    return {"calls": len(calls), "before_end": sum(c["t"] < backward_end for c in calls),
            "all_async": all(c["async"] for c in calls), "numels": [c["numel"] for c in calls],
            # an async all-reduce waited for inside the hook blocks backward like a sync one
            "waited_in_backward": sum(d is not None and d < backward_end for d in waits),
            "never_waited": sum(d is None for d in waits), "record": record}


def _ddp_worker(rank: int, world_size: int, cls: type, cap_mb: float, steps: int,
                layers: int = 4, width: int = 128, batch: int = _DDP_BATCH) -> dict:
    # the learner's training only: single-process training is the check's, in its own process
    data = _ddp_batches(steps, batch, width)
    # ranks other than 0 start elsewhere: the constructor must broadcast rank 0's weights
    model = ddp_model(seed=0 if rank == 0 else 50 + rank, layers=layers, width=width)
    ddp = cls(model, cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    per_step = []
    for x, y in data:
        xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
        opt.zero_grad()
        per_step.append(_ddp_step(ddp, xs, ys, world_size))
        opt.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "steps": per_step}


def record_timeline(cls: type, bucket_cap_mb: float = 1.0, world_size: int = 2, layers: int = 6,
                    width: int = 512, batch: int = 128, timeout: float = 60.0) -> SyncRecord:
    """Train with the learner's ``cls(model, bucket_cap_mb)`` for two steps on ``world_size`` ranks
    (``layers`` x Linear(width, width)) and return rank 0's last step as a
    :class:`~dtlib.parallel.SyncRecord`, for :func:`dtlib.viz.timeline.plot_overlap_timeline`.
    Raises AssertionError, saying why, if the class does not run."""
    try:
        out = launch(_ddp_worker, world_size,
                     args=(cls, bucket_cap_mb, 2, layers, width, batch),
                     timeout=timeout, output="none")
    except LaunchTimeoutError:
        raise AssertionError(f"training with your class hung (no result in {timeout:g} s)") from None
    except RankFailedError as e:
        raise AssertionError(f"training with your class raised on rank {e.rank}: {first_line(e)}") from None
    return out[0]["steps"][-1]["record"]


def _weights_diagnosis(setting: str, params: list[torch.Tensor], world_size: int, steps: int) -> str | None:
    """Rank 0's weights against one process training on the full batch, computed here (called
    after the launch, so no rank process ever holds it: issue 39)."""
    data = _ddp_batches(steps, _DDP_BATCH, 128)  # _ddp_worker's batch, ddp_model's width (_train_single's model)
    with torch.random.fork_rng(devices=[]):  # ddp_model seeds: leave the caller's generator be
        mean, summed = _train_single(data, 0.1, 1.0), _train_single(data, 0.1, float(world_size))
    diff = max_diff(params, mean)
    if diff <= 1e-5:
        return None
    if max_diff(params, summed) < 1e-5:  # gradients summed over ranks, not averaged
        return (f"{setting}, the gradients are summed over ranks, not averaged: divide by the "
                "world size (before or after the all-reduce)")
    return (f"{setting}, after {steps} SGD steps the weights differ from one process training "
            f"on the full batch by {diff:.2e}: each p.grad must end as the mean over ranks of "
            "the local gradients (check the offsets into the flat buffers)")


def check_bucketed_ddp(cls: type, world_size: int = 2, steps: int = 3,
                       timeout: float = 30.0) -> None:
    """``cls(model, bucket_cap_mb)`` with ``finish()`` averages gradients bucket by bucket.

    On ``world_size`` ranks, a 4-layer MLP whose layers each fill one 64 KiB bucket: one
    asynchronous all-reduce per bucket per step, issued before ``backward()`` returns; with a
    25 MiB cap, a single bucket; and after ``steps`` SGD steps the parameters equal one process
    training on the full batch.
    """
    n_layers = 4
    for cap_mb, n_buckets in ((64 / 1024, n_layers), (25.0, 1)):
        try:
            ranks = launch(_ddp_worker, world_size, args=(cls, cap_mb, steps), timeout=timeout,
                           output="none")
        except LaunchTimeoutError:
            raise AssertionError(
                f"training hung (no result in {timeout:g} s): every rank must issue the same "
                "all-reduces in the same order, and finish() must wait for each of them once") from None
        except RankFailedError as e:
            raise AssertionError(
                f"training with your class raised on rank {e.rank}: {first_line(e)} "
                "(MiniDDP's constructor uses your make_buckets from Q2a: check that first)") from None
        setting = f"with bucket_cap_mb={cap_mb:g} ({n_buckets} bucket{'s' * (n_buckets > 1)} expected)"
        for rank, out in enumerate(ranks):
            for s, st in enumerate(out["steps"]):
                if st["calls"] == 0:
                    raise AssertionError(
                        f"{setting}, rank {rank} issued no all_reduce in step {s}: in _grad_ready, "
                        "copy the gradient into its bucket's flat buffer, count it, and all_reduce "
                        "the buffer once the bucket's last gradient has arrived")
                if st["calls"] == 2 * n_layers and n_buckets < 2 * n_layers:
                    raise AssertionError(
                        f"{setting}, rank {rank} issued {st['calls']} all-reduces, one per "
                        "parameter: issue one per bucket, when its last gradient arrives")
                if st["calls"] != n_buckets:
                    raise AssertionError(
                        f"{setting}, rank {rank} issued {st['calls']} all-reduces in step {s} "
                        f"(sizes {st['numels']}): expected exactly one per bucket, {n_buckets}")
                if st["before_end"] < st["calls"]:
                    raise AssertionError(
                        f"{setting}, {st['calls'] - st['before_end']} of {st['calls']} all-reduces "
                        "were issued after backward() returned: issue each from _grad_ready as "
                        "soon as its bucket is full, so it overlaps the rest of backward, and only "
                        "wait for them in finish()")
                if not st["all_async"]:
                    raise AssertionError(
                        f"{setting}, the all-reduces are blocking: pass async_op=True, keep the "
                        "returned work objects and wait() for them in finish(); a blocking call in "
                        "the hook stalls backward until the communication is over")
                if st["waited_in_backward"]:
                    raise AssertionError(
                        f"{setting}, {st['waited_in_backward']} all-reduce(s) were waited for "
                        "before backward() returned: wait() inside the hook blocks backward just "
                        "like a synchronous call, so nothing overlaps; keep the work objects and "
                        "wait() for them in finish()")
                if st["never_waited"]:
                    raise AssertionError(
                        f"{setting}, {st['never_waited']} all-reduce(s) were never waited for: "
                        "call wait() on each bucket's work in finish() before copying its values "
                        "back, or the optimizer may read a buffer the all-reduce is still writing")
        ref = ranks[0]
        for rank, out in enumerate(ranks[1:], start=1):
            if not max_diff(out["params"], ref["params"]) <= 1e-6:
                raise AssertionError(
                    f"{setting}, rank {rank} ended with different weights from rank 0: after "
                    "wait(), copy each bucket's averaged values back into every p.grad (in place, "
                    "p.grad.copy_(...)) before the optimizer step")
        problem = _weights_diagnosis(setting, ref["params"], world_size, steps)
        if problem:
            raise AssertionError(problem)
    for cap_mb in (64 / 1024, 25.0):  # the same training beside the check's own rank: its word
        problem = witness_ddp(cls, cap_mb, ddp_model, _ddp_batches(steps, _DDP_BATCH, 128), timeout)
        if problem:
            raise AssertionError(problem)
