"""The check's own rank beside the learner's bucketed DDP (:mod:`~dtlib.grading.witness`).

Rank 0 trains with the learner's ``cls(model, bucket_cap_mb)`` as in the lesson (the given
constructor broadcasts rank 0's weights; ``finish()`` after ``backward()``); rank 1 runs no
learner code: it is the honest second rank of a bucketed DDP (PyTorch's ``Reducer``: buckets
filled last parameter first, closed at ``bucket_cap_mb``; :func:`dtlib.parallel.assign_buckets`).
Per step it all-reduces, in the order the buckets fill, one flat buffer per bucket holding its
gradients divided by the world size, and checks that what rank 0 added is rank 0's own
gradients divided by the world size (computed here from rank 0's half of the batch). gloo matches
an all-reduce only with one of the same size, so one all-reduce per parameter, one for the whole
model, a missing or an extra one, or the sum instead of the mean is seen here, whatever rank 0's
counters say.

With more than one bucket, *when* rank 0 issues and waits is judged the same way, without a
clock: two gates in rank 0's model, the check's code, below its last and its second to last
layer. Passing the first in backward, rank 0 sends the witness a message; the witness joins the
first bucket's all-reduce only after it, so an all-reduce that blocks backward (synchronous, or
waited for in the hook) never completes. The second gate waits for a factor the witness draws at
random and sends only once that all-reduce is over, and scales the gradients below it: an
all-reduce issued only after backward never starts, and a gate removed by the learner's code
leaves the gradients below it without the factor, which the witness sees in what rank 0
all-reduces. A learner's code may still send the first message itself, early (a forgery that
knows the check: docs/grading.md, "Not protected").
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.grading.witness import Witnessed, run_with_witness, say
from dtlib.parallel.buckets import assign_buckets

__all__ = ["witness_ddp", "HINT_DO_NOT_BLOCK", "HINT_ONE_PER_BUCKET"]

_LR, _MOMENTUM = 0.1, 0.9  # the check's optimizer, SGD with momentum, on both ranks
_WITNESS = 1
# what the learner reads when the witness waited in vain (with where it waited)
HINT_DO_NOT_BLOCK = ("issue each bucket's all-reduce with async_op=True in _grad_ready and wait() "
                     "only in finish(): a blocking all-reduce, or a wait() in the hook, stops backward")
HINT_ONE_PER_BUCKET = ("one all-reduce per bucket, of its size, issued when its last gradient arrives, "
                       "in the order the buckets fill (not one per parameter, nor all in finish())")


class _SignalsProgress(torch.autograd.Function):
    """Below the last layer: in backward, tells the witness that rank 0's backward got past the
    last layer (its bucket's all-reduce, if issued in the hook, has not blocked backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        dist.send(torch.ones(1), _WITNESS)
        return grad


class _ScaledByWitness(torch.autograd.Function):
    """Lower down: in backward, scales the gradient by a number the witness sends only once the
    first bucket's all-reduce is over (so it must have been issued during backward). Skipped,
    the gradients below it lack the factor, which the witness sees in what rank 0 all-reduces."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        factor = torch.empty(1)
        dist.recv(factor, _WITNESS)
        return grad * factor


class _Scaled(torch.autograd.Function):
    """The witness's own ``_ScaledByWitness``: the same factor, known here."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def _layers(model: nn.Sequential) -> list[nn.Module]:
    """(Linear, Tanh) pairs of ``ddp_model``: the gates go below the last and the second to last."""
    mods = list(model)
    return [nn.Sequential(*mods[i:i + 2]) for i in range(0, len(mods), 2)]


def _gated_forward(model: nn.Sequential, x: torch.Tensor, factor: float | None = None) -> torch.Tensor:
    """``model(x)`` with the gates: rank 0's (``factor`` None: it comes from the witness), or the
    witness's own (the factor it chose; no message to itself)."""
    *lower, second_last, last = _layers(model)
    for layer in lower:
        x = layer(x)
    if factor is None:
        return last(_SignalsProgress.apply(second_last(_ScaledByWitness.apply(x))))
    return last(second_last(_Scaled.apply(x, factor)))


def _learner(rank: int, n: int, cls: type, cap_mb: float, model_fn: Callable, batches: list,
             gated: bool) -> None:
    model = model_fn(seed=0)
    params = list(model.parameters())
    ddp = cls(model, cap_mb)
    # where each parameter lies in the buckets' flat buffers: the given constructor's layout. A
    # false answer only misaligns rank 0's buffers with the witness's, which the witness then sees
    index = {id(p): i for i, p in enumerate(params)}
    layout = [index.get(id(p), -1) for bucket in getattr(ddp, "buckets", []) for p in bucket]
    dist.send(torch.tensor((layout + [-1] * len(params))[:len(params)]), n - 1)
    opt = torch.optim.SGD(params, lr=_LR, momentum=_MOMENTUM)
    if gated:  # the learner's wrapper calls its model: the gated one, same parameters
        model.forward = lambda x: _gated_forward(model, x)
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
               for b in assign_buckets(list(reversed(params)), int(cap_mb * 2 ** 20))]  # the exercise's MB
    place = {i: k for k, i in enumerate(layout)}
    if sorted(layout) == list(range(len(params))):
        buckets = [sorted(b, key=place.__getitem__) for b in buckets]
    return buckets


def _witness(rank: int, n: int, fd: int, cls: type, cap_mb: float, model_fn: Callable,
             batches: list, gated: bool) -> None:
    model = model_fn(seed=50 + rank)
    say(fd, waiting="the constructor's broadcast of rank 0's weights",
        hint="the given constructor broadcasts every tensor of the model's state_dict from rank 0")
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)
    params = list(model.parameters())
    layout = torch.empty(len(params), dtype=torch.long)
    dist.recv(layout, 0)
    buckets = _buckets(params, cap_mb, layout.tolist())
    opt = torch.optim.SGD(params, lr=_LR, momentum=_MOMENTUM)
    noise = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    for step, (x, y) in enumerate(batches):
        factor = 0.5 + float(torch.rand(1, generator=noise))  # rank 0 cannot know it in advance
        run = (lambda v: _gated_forward(model, v, factor)) if gated else model
        xs, ys = x.tensor_split(n), y.tensor_split(n)
        theirs = torch.autograd.grad(nn.functional.mse_loss(run(xs[0]), ys[0]), params)
        opt.zero_grad()
        nn.functional.mse_loss(run(xs[rank]), ys[rank]).backward()
        if gated:
            say(fd, waiting=f"your backward to pass the last layer in step {step}",
                hint=HINT_DO_NOT_BLOCK)
            dist.recv(torch.empty(1), 0)
        for b, bucket in enumerate(buckets):
            own = torch.cat([params[i].grad.reshape(-1) / n for i in bucket])
            flat = own.clone()
            say(fd, waiting=f"bucket {b}'s all-reduce ({flat.numel()} elements) in step {step}",
                hint=HINT_ONE_PER_BUCKET)
            dist.all_reduce(flat)
            if gated and b == 0:  # only now may rank 0's backward go below its second to last layer
                dist.send(torch.tensor([factor]), 0)
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
    gated = len(_buckets(list(model_fn(seed=0).parameters()), cap_mb, [])) > 1
    record, failure = run_with_witness(_learner, _witness, 2, (cls, cap_mb, model_fn, batches, gated),
                                       timeout)
    if record.get("done") and failure is None:
        return None
    setting = f"with bucket_cap_mb={cap_mb:g} beside the check's own rank 1"
    if "problem" in record:
        return f"{setting}: {record['problem']}"
    if "waiting" in record:
        return f"{setting}, rank 1 waited in vain for {record['waiting']}: {record['hint']}"
    return f"{setting}, rank 1 ended without a word (was it killed?)"
