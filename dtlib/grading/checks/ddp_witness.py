"""The check's own rank beside the learner's bucketed DDP (:mod:`~dtlib.grading.checks.witness`).

Rank 0 trains with the learner's ``cls(model, bucket_cap_mb)`` as in the lesson (the given
constructor broadcasts rank 0's weights; ``finish()`` after ``backward()``); rank 1 runs no
learner code: it is the honest second rank of a bucketed DDP (PyTorch's ``Reducer``: buckets
filled last parameter first, closed at ``bucket_cap_mb``; :func:`dtlib.parallel.assign_buckets`).
Per step it all-reduces, in the order the buckets fill, one flat buffer per bucket holding its
gradients divided by the world size, and checks that what rank 0 added is rank 0's own
gradients divided by the world size (computed here from rank 0's half of the batch). gloo matches
an all-reduce only with one of the same size, so one all-reduce per parameter, one for the whole
model, a missing or an extra one, or the sum instead of the mean is seen here, whatever rank 0's
counters say. Not seen here: *when* rank 0 issued each all-reduce (the overlap with backward), a
time only rank 0's own process knows.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.grading.checks.witness import Witnessed, run_with_witness, say
from dtlib.parallel.buckets import assign_buckets

__all__ = ["witness_ddp"]

_LR, _MOMENTUM = 0.1, 0.9  # the check's optimizer, SGD with momentum, on both ranks


def _learner(rank: int, n: int, cls: type, cap_mb: float, model_fn: Callable, batches: list) -> None:
    model = model_fn(seed=0)
    params = list(model.parameters())
    ddp = cls(model, cap_mb)
    # where each parameter lies in the buckets' flat buffers: the given constructor's layout. A
    # false answer only mixes rank 0's gradients with the witness's, which rank 0's weights show
    index = {id(p): i for i, p in enumerate(params)}
    layout = [index.get(id(p), -1) for bucket in getattr(ddp, "buckets", []) for p in bucket]
    dist.send(torch.tensor((layout + [-1] * len(params))[:len(params)]), n - 1)
    opt = torch.optim.SGD(params, lr=_LR, momentum=_MOMENTUM)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x.tensor_split(n)[rank]), y.tensor_split(n)[rank]).backward()
        ddp.finish()
        opt.step()


def _buckets(params: list[torch.Tensor], cap_mb: float, layout: list[int]) -> list[list[int]]:
    """The buckets as PyTorch fills them (indices into params, in the order they close); inside
    a bucket, the parameters in rank 0's order when it named a permutation of them."""
    last = len(params) - 1
    buckets = [[last - i for i in b]
               for b in assign_buckets(list(reversed(params)), int(cap_mb * 2 ** 20))]
    place = {i: k for k, i in enumerate(layout)}
    if sorted(layout) == list(range(len(params))):
        buckets = [sorted(b, key=place.__getitem__) for b in buckets]
    return buckets


def _witness(rank: int, n: int, fd: int, cls: type, cap_mb: float, model_fn: Callable,
             batches: list) -> None:
    model = model_fn(seed=50 + rank)
    say(fd, waiting="the constructor's broadcast of rank 0's weights")
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)
    params = list(model.parameters())
    layout = torch.empty(len(params), dtype=torch.long)
    dist.recv(layout, 0)
    buckets = _buckets(params, cap_mb, layout.tolist())
    opt = torch.optim.SGD(params, lr=_LR, momentum=_MOMENTUM)
    for step, (x, y) in enumerate(batches):
        xs, ys = x.tensor_split(n), y.tensor_split(n)
        theirs = torch.autograd.grad(nn.functional.mse_loss(model(xs[0]), ys[0]), params)
        opt.zero_grad()
        nn.functional.mse_loss(model(xs[rank]), ys[rank]).backward()
        for b, bucket in enumerate(buckets):
            own = torch.cat([params[i].grad.reshape(-1) / n for i in bucket])
            flat = own.clone()
            say(fd, waiting=f"the all-reduce of bucket {b} ({flat.numel()} elements) in step {step}")
            dist.all_reduce(flat)
            want = torch.cat([theirs[i].reshape(-1) / n for i in bucket])
            if not torch.allclose(flat - own, want, rtol=1e-4, atol=1e-6):  # NaN is never close
                if torch.allclose(flat - own, want * n, rtol=1e-4, atol=1e-6):
                    what = "its gradients summed, not divided by the world size"
                else:
                    what = "not its gradients divided by the world size"
                say(fd, problem=f"in step {step} rank 0 added to bucket {b}'s all-reduce {what}")
                raise Witnessed(what)
            offset = 0
            for i in bucket:
                numel = params[i].numel()
                params[i].grad.copy_(flat[offset:offset + numel].view_as(params[i]))
                offset += numel
        opt.step()
    say(fd, done=True)


def witness_ddp(cls: type, cap_mb: float, model_fn: Callable, batches: list,
                timeout: float = 30.0) -> str | None:
    """Train with ``cls`` on rank 0 beside the check's witness on rank 1; return what the witness
    saw wrong, in words, or None. ``model_fn(seed=...)`` builds the model, ``batches`` are the
    global (x, y) batches, split in two."""
    record, failure = run_with_witness(_learner, _witness, 2, (cls, cap_mb, model_fn, batches),
                                       timeout)
    if record.get("done") and failure is None:
        return None
    setting = f"with bucket_cap_mb={cap_mb:g} and the check's own rank 1 beside your rank 0"
    if "problem" in record:
        return f"{setting}: {record['problem']}"
    if "waiting" in record:
        return (f"{setting}, rank 1 waited in {record['waiting']}, which your rank did not "
                "match: all-reduce one flat buffer per bucket, the bucket's size, in the order "
                "the buckets fill (one per parameter, one for the whole model, or a bucket "
                "missing does not match)")
    return f"{setting}, rank 1 ended without a word (was it killed?)"
