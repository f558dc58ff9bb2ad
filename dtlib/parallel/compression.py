"""Gradient compression as DDP communication hooks: fp16/bf16 casts, top-k, PowerSGD.

A hook replaces the averaging all-reduce of one bucket (:meth:`BucketedDDP.register_comm_hook`,
same protocol as PyTorch's ``DistributedDataParallel.register_comm_hook``): it receives the
bucket's flat gradient and returns an object whose ``wait()`` gives the *averaged* gradient.
Every hook reports what it puts on the wire through ``bucket.log`` (see
:attr:`SyncRecord.payload_bytes <dtlib.parallel.ddp.SyncRecord.payload_bytes>` and
``wire_bytes``).

* :func:`fp16_compress_hook`, :func:`bf16_compress_hook` - all-reduce a half-precision copy:
  half the bytes, no state (PyTorch's ``default_hooks.fp16_compress_hook``).
* :func:`topk_hook` - each rank sends its ``k`` largest-magnitude entries (values and int32
  indices, by all-gather, since ranks choose different entries) and keeps what it did not send
  as *error feedback* added to the next step's gradient (Stich et al. 2018, "Sparsified SGD with
  Memory"; Lin et al. 2018, "Deep Gradient Compression").
* :func:`powersgd_hook` - rank-``r`` power iteration (Vogels et al. 2019, "PowerSGD: Practical
  Low-Rank Gradient Compression for Distributed Optimization", Algorithms 1-2): for each weight
  matrix ``M`` (``shape[0] x rest``) ``P = M Q``, all-reduce P, orthogonalise, ``Q = M^T P``,
  all-reduce Q, ``M ~ P Q^T``; vectors (biases, norms) are all-reduced uncompressed. With error
  feedback (the local residual ``M - P Q_local^T`` is added next step) and warm start (last
  step's Q seeds the next power iteration). The layout, thresholds and random initialisation
  follow PyTorch's ``powerSGD_hook`` so the two can be compared number for number.

Why hooks return a "deferred" result instead of chaining ``Future.then``: PowerSGD needs a second
collective (on Q) that depends on the first. Issued from a future's callback it would run on a
backend thread, and two ranks could then issue bucket 1's P and bucket 0's Q in different orders
(gloo matches collectives by order). Here the second phase runs in ``wait()``, which our DDP calls
in bucket order on the main thread, so every rank issues the same sequence.

Error-feedback residuals and warm-start factors are kept *per parameter* (``state.errors[p]``,
``state.qs[p]``, keyed by the parameter tensor as ``torch.optim`` keys its state), not per bucket
index: :class:`~dtlib.parallel.ddp.BucketedDDP` rebuilds its buckets after the first iteration
in the order gradients arrived, so bucket 0 may then hold other parameters than before, and a
residual stored under its index would be added to the wrong gradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from dtlib.analytic import validate
from dtlib.parallel.collectives import all_gather_into

__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "TopKState", "topk_hook",
           "PowerSGDState", "powersgd_hook", "powersgd_plan", "orthogonalize"]


class _Deferred:
    """``wait()`` runs ``fn`` once and returns its result (the averaged flat gradient)."""

    def __init__(self, fn: Callable[[], torch.Tensor]):
        self._fn, self._value = fn, None

    def wait(self) -> torch.Tensor:
        if self._value is None:
            self._value = self._fn()
        return self._value


def _group(state: Any) -> Any:
    """Hooks take either a state object with ``process_group`` or a process group (or None)."""
    return getattr(state, "process_group", state)


def _all_reduce_mean(tensor: torch.Tensor, bucket: Any, group: Any) -> _Deferred:
    """Pre-divide (no overflow in low precision), sum-all-reduce asynchronously, log it."""
    tensor.div_(dist.get_world_size(group))
    if hasattr(bucket, "log"):
        bucket.log("all_reduce", tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return _Deferred(lambda: (work.wait(), tensor)[1])


def allreduce_hook(state: Any, bucket: Any) -> _Deferred:
    """Uncompressed averaging: what DDP does without a hook (a baseline for the others)."""
    return _all_reduce_mean(bucket.buffer(), bucket, _group(state))


def _cast_hook(dtype: torch.dtype, state: Any, bucket: Any) -> _Deferred:
    buf = bucket.buffer()
    low = _all_reduce_mean(buf.to(dtype), bucket, _group(state))
    return _Deferred(lambda: buf.copy_(low.wait()))


def fp16_compress_hook(state: Any, bucket: Any) -> _Deferred:
    """All-reduce the bucket in float16 (half the bytes; gradients below ~6e-8 flush to 0)."""
    return _cast_hook(torch.float16, state, bucket)


def bf16_compress_hook(state: Any, bucket: Any) -> _Deferred:
    """All-reduce the bucket in bfloat16 (half the bytes, fp32's range, 8 bits of mantissa)."""
    return _cast_hook(torch.bfloat16, state, bucket)


# ---- top-k -------------------------------------------------------------------------------------
def _slices(bucket: Any) -> list[tuple[torch.Tensor, slice]]:
    """(parameter, where its gradient lies in ``bucket.buffer()``) for each parameter, in order."""
    out, offset = [], 0
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        out.append((p, slice(offset, offset + g.numel())))
        offset += g.numel()
    return out


def _add_residuals(errors: dict[torch.Tensor, torch.Tensor], bucket: Any, flat: torch.Tensor) -> None:
    """Add each parameter's stored residual to its part of ``flat`` (the bucket's layout)."""
    for p, where in _slices(bucket):
        err = errors.get(p)
        if err is not None:
            flat[where] += err


def _store_residuals(errors: dict[torch.Tensor, torch.Tensor], bucket: Any, flat: torch.Tensor) -> None:
    for p, where in _slices(bucket):
        errors[p] = flat[where]


@dataclass
class TopKState:
    """Top-k sparsification: keep ``ratio`` of each bucket's entries (at least one).

    ``errors[p]`` is parameter ``p``'s error-feedback memory (what was not sent yet, flat).
    """
    ratio: float = 0.01
    error_feedback: bool = True
    process_group: Any = None
    errors: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate.number("ratio", self.ratio, maximum=1)  # the fraction of entries sent
        validate.boolean("error_feedback", self.error_feedback)


def topk_hook(state: TopKState, bucket: Any) -> _Deferred:
    """Send the ``k`` largest ``|g + error|`` entries of the bucket; average the sparse sums."""
    group, buf = state.process_group, bucket.buffer()
    n = dist.get_world_size(group)
    acc = buf.clone()
    if state.error_feedback:
        _add_residuals(state.errors, bucket, acc)
    k = max(1, math.ceil(state.ratio * acc.numel()))
    idx = acc.abs().topk(k, sorted=False).indices
    values = acc[idx]
    if state.error_feedback:
        acc[idx] = 0  # what stays behind is sent later
        _store_residuals(state.errors, bucket, acc)
    idx32 = idx.to(torch.int32)  # 4-byte indices on the wire (buckets are < 2^31 elements)
    all_values = torch.empty(n * k, dtype=values.dtype, device=values.device)
    all_idx = torch.empty(n * k, dtype=torch.int32, device=values.device)
    works = [all_gather_into(all_values, values, group, async_op=True),
             all_gather_into(all_idx, idx32, group, async_op=True)]
    if hasattr(bucket, "log"):
        bucket.log("all_gather", values)
        bucket.log("all_gather", idx32)

    def finish() -> torch.Tensor:
        for w in works:
            w.wait()
        buf.zero_().index_add_(0, all_idx.long(), all_values)  # ranks may pick the same entry
        return buf.div_(n)

    return _Deferred(finish)


# ---- PowerSGD ----------------------------------------------------------------------------------
def orthogonalize(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``matrix`` ([n, r]), in place; returns it.

    ``epsilon`` guards against an all-zero column (division by zero), as in PyTorch.
    """
    for i in range(matrix.shape[1]):
        col = matrix[:, i:i + 1]
        col /= col.norm() + epsilon
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1:]
            rest -= col * (col * rest).sum(dim=0, keepdim=True)
    return matrix


def powersgd_plan(shapes: Sequence[Sequence[int]], rank: int,
                  min_compression_rate: float = 2.0) -> list[int | None]:
    """For each gradient shape, the rank PowerSGD sends it at, or None if it goes uncompressed.

    A tensor is viewed as a ``shape[0] x rest`` matrix and compressed at rank
    ``r = min(n, m, rank)`` only if ``n m > min_compression_rate * (n + m) r`` (PyTorch's
    ``_should_compress``): P and Q then carry ``(n + m) r`` numbers instead of ``n m``.
    Biases and norms (vectors) never pass. Pure: a lesson can count bytes per rank with it.
    """
    validate.integer("rank", rank)
    validate.number("min_compression_rate", min_compression_rate, minimum=0, exclusive=False)
    plan = []
    for shape in shapes:
        n = shape[0] if len(shape) else 1
        m = math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        plan.append(r if n * m > min_compression_rate * (n + m) * r else None)
    return plan


@dataclass
class PowerSGDState:
    """Configuration and memory of :func:`powersgd_hook` (names as in PyTorch's PowerSGDState).

    ``rank``: the approximation rank r. ``start_iter``: plain all-reduce for the first steps
    (PyTorch's ``start_powerSGD_iter``; compressing from step 0 hurts accuracy, Vogels et al.
    Sec. 5). ``min_compression_rate``: compress a matrix only if ``n m > rate * (n + m) r``.
    ``errors[p]``, ``qs[p]``: error-feedback memory (flat) and warm-start Q of parameter ``p``.
    With ``error_feedback`` or ``warm_start``, ``start_iter`` must be > 1, the rule of PyTorch's
    ``PowerSGDState`` (``powerSGD_hook.py``: "Expect `start_powerSGD_iter` > 1 if
    `use_error_feedback` or `warm_start` is enabled, because PowerSGD can only be applied after the
    first two iterations in DDP"), where the memory starts only once buckets are rebuilt.
    """
    rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0
    epsilon: float = 0.0
    process_group: Any = None
    iter: int = 0
    errors: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    qs: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate.integer("rank", self.rank)
        validate.integer("start_iter", self.start_iter, minimum=0)
        validate.number("min_compression_rate", self.min_compression_rate, minimum=0, exclusive=False)
        validate.number("epsilon", self.epsilon, minimum=0, exclusive=False)
        validate.boolean("error_feedback", self.error_feedback)
        validate.boolean("warm_start", self.warm_start)
        validate.integer("seed", self.seed, minimum=0, maximum=2 ** 32 - 1)  # numpy's RandomState range
        if (self.error_feedback or self.warm_start) and self.start_iter <= 1:
            raise validate.InvalidArgument(
                "start_iter", "> 1 with error_feedback or warm_start, as PyTorch's PowerSGDState "
                "requires (compress from the third iteration, once DDP has rebuilt its buckets; or "
                "set error_feedback=False, warm_start=False)", self.start_iter)
        # PyTorch draws the seed of every fresh random Q from numpy's RandomState(seed)
        self._rng = np.random.RandomState(self.seed)


def powersgd_hook(state: PowerSGDState, bucket: Any) -> _Deferred:
    """Rank-r PowerSGD with error feedback and warm start for one bucket (see module docstring)."""
    group, buf = state.process_group, bucket.buffer()
    n_ranks = dist.get_world_size(group)
    if state.iter < state.start_iter:
        if bucket.is_last():
            state.iter += 1
        return _all_reduce_mean(buf, bucket, group)
    if state.error_feedback:
        _add_residuals(state.errors, bucket, buf)
        local = buf.clone()  # M_i + e_i: what this rank wanted to send
    params, grads = bucket.parameters(), bucket.gradients()
    matrices, vectors = [], []  # matrices: (parameter, its gradient as a matrix, rank)
    for param, g, r in zip(params, grads, powersgd_plan([g.shape for g in grads], state.rank,
                                                        state.min_compression_rate)):
        if r is None:
            vectors.append(g)
        else:
            matrices.append((param, g.view(g.shape[0], -1), r))
    # same-shaped matrices next to each other, as PyTorch lays out (and draws random) Q and P
    first_seen = {}
    for _, m, _ in matrices:
        first_seen.setdefault(m.shape, len(first_seen))
    matrices.sort(key=lambda pmr: first_seen[pmr[1].shape])
    uncompressed = torch.cat([v.reshape(-1) for v in vectors]) if vectors else buf.new_zeros(0)
    p_flat = buf.new_empty(sum(m.shape[0] * r for _, m, r in matrices))
    q_flat = buf.new_empty(sum(m.shape[1] * r for _, m, r in matrices))
    last_q = [state.qs.get(param) for param, _, _ in matrices]
    fresh = not state.warm_start or any(q is None or q.shape != (m.shape[1], r)
                                        for q, (_, m, r) in zip(last_q, matrices))
    if fresh:  # same seed on every rank -> the same random Q everywhere
        gen = torch.Generator().manual_seed(int(state._rng.randint(1_000_000_000)))
    ps, qs, p_off, q_off = [], [], 0, 0
    for (_, m, r), q_last in zip(matrices, last_q):
        p = p_flat[p_off:p_off + m.shape[0] * r].view(m.shape[0], r)
        q = q_flat[q_off:q_off + m.shape[1] * r].view(m.shape[1], r)
        q.copy_(torch.randn(q.shape, generator=gen, dtype=q.dtype) if fresh else q_last)
        orthogonalize(q, state.epsilon)  # keeps the warm-started Q well conditioned
        torch.matmul(m, q, out=p)
        ps.append(p)
        qs.append(q)
        p_off, q_off = p_off + p.numel(), q_off + q.numel()
    # P is only orthogonalised after the sum, so it needs no division by the world size
    works = [dist.all_reduce(uncompressed, group=group, async_op=True),
             dist.all_reduce(p_flat, group=group, async_op=True)]
    if hasattr(bucket, "log"):
        bucket.log("all_reduce", uncompressed)
        bucket.log("all_reduce", p_flat)

    def finish() -> torch.Tensor:
        for w in works:
            w.wait()
        for (_, m, _), p, q in zip(matrices, ps, qs):
            orthogonalize(p, state.epsilon)
            torch.matmul(m.t(), p, out=q)  # this rank's Q_i = M_i^T P
        if state.error_feedback:
            # the local error of the paper (Alg. 2): M_i - P Q_i^T, with this rank's own Q_i
            # (vectors still hold their local values: they were sent exactly, no residual)
            for (_, m, _), p, q in zip(matrices, ps, qs):
                m.copy_(p @ q.t())
            _store_residuals(state.errors, bucket, local - buf)
        if hasattr(bucket, "log"):
            bucket.log("all_reduce", q_flat)
        dist.all_reduce(q_flat, group=group)
        q_flat.div_(n_ranks)
        for (param, m, _), p, q in zip(matrices, ps, qs):
            torch.matmul(p, q.t(), out=m)
            state.qs[param] = q  # warm start: next step's power iteration begins here
        offset = 0
        for v in vectors:
            v.copy_(uncompressed[offset:offset + v.numel()].view_as(v)).div_(n_ranks)
            offset += v.numel()
        if bucket.is_last():
            state.iter += 1
        return buf

    return _Deferred(finish)
