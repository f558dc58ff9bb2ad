"""ZeRO stages 1 and 2: shard the optimizer state (and the gradients) over data-parallel ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC'20), Sec. 5.1-5.2 and 7.2:

* stage 1 (P_os): every rank keeps the full parameters and gradients, but optimizer state
  (e.g. Adam's two moments, 8 bytes/parameter in fp32) only for its 1/N shard. After the
  gradients are averaged (by DDP, as for ``torch.distributed.optim.ZeroRedundancyOptimizer``),
  each rank updates its shard and the updated shards are all-gathered.
* stage 2 (P_os+g): in addition, as soon as a bucket's gradients are ready during backward they
  are *reduce-scattered*: each rank receives the average of its shard only, and the full
  gradients are freed right away. Do not also wrap the model in DDP: this replaces it. Same
  communication volume as DDP (reduce-scatter + all-gather = all-reduce), 1/N of the gradients.

Layout, as in DeepSpeed: the parameters of each param group are packed into flat buckets (reverse
order of registration, the order gradients arrive in), each padded to a multiple of N and split
into N equal shards; rank r owns shard r of every bucket. The model's parameters become views
into these flat buffers, so the all-gather after the step writes straight into them. The inner
optimizer is an ordinary ``optimizer_cls`` over one flat shard per bucket, so any *element-wise*
optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...) gives exactly the unsharded results; ones
that look at a whole tensor (LAMB/LARS trust ratios, Adafactor) would see a shard instead.
A parameter whose gradient is ``None`` in a step is updated as if its gradient were zero (so
AdamW's weight decay and momentum still move it; ``torch.optim.AdamW`` would skip it). This is
DeepSpeed's ZeRO-1/2 behaviour: ``DeepSpeedZeroOptimizer.get_flat_partition``
(``deepspeed/runtime/zero/stage_1_and_2.py``) uses ``torch.zeros_like`` for a missing gradient and
``step()`` runs the wrapped optimizer on the whole flat partition. In stage 2 ``step()`` consumes
the gradient shards, so ``model.zero_grad()`` and ``optimizer.zero_grad()`` both start the next
step from zero, as DeepSpeed's ZeRO-2 (which frees its averaged gradient partitions in ``step``);
every backward launches every bucket (those left incomplete at ``finish_gradient_synchronization``, or when the
next backward starts), so a bucket that got no gradient on some rank cannot desynchronise ranks.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.analytic import validate
from dtlib.analytic.units import MiB
from dtlib.measure import optimizer_state_bytes
from dtlib.parallel.buckets import (FlatLayout, InOrderLauncher, assign_buckets,
                                    register_grad_ready_hooks, unique_parameters)
from dtlib.parallel.clip import clip_grad_norm_
from dtlib.parallel.collectives import all_gather_into, broadcast_coalesced, reduce_scatter_into

__all__ = ["ShardedOptimizer"]


class _FlatBucket:
    """Parameters packed into one padded flat buffer; this rank's shard is an ``nn.Parameter``
    sharing its storage, and the parameters themselves become views of the buffer."""

    def __init__(self, params: list[nn.Parameter], world_size: int, rank: int):
        self.params = params
        self.layout = FlatLayout.of(params, world_size)
        with torch.no_grad():
            self.flat = self.layout.flatten([p.detach() for p in params])
            for p, view in zip(params, self.layout.views(self.flat)):
                p.data = view  # the parameter now lives inside the flat buffer
        lo, hi = self.layout.shard_range(rank)
        self.shard = nn.Parameter(self.flat[lo:hi], requires_grad=False)
        self.grad_shard: torch.Tensor | None = None   # stage 2: accumulated reduced gradient
        self.in_flight: list[tuple[Any, torch.Tensor]] = []  # stage 2: (work, received shard)


class ShardedOptimizer:
    """ZeRO-1/2 wrapper around ``optimizer_cls`` (e.g. ``torch.optim.AdamW``).

    Args:
        params: parameters or param groups (dicts), as for any optimizer.
        optimizer_cls: the optimizer class to run on this rank's shard.
        stage: 1 (shard optimizer state; gradients must already be averaged, e.g. by
            :class:`~dtlib.parallel.ddp.BucketedDDP`) or 2 (also reduce-scatter gradients during
            backward and keep only this rank's shard; use *without* DDP).
        bucket_size_mb: size of the flat buckets (MiB); in stage 2 also the reduce-scatter size.
        process_group: the data-parallel group (default: all ranks).
        **defaults: the optimizer's hyper-parameters (``lr``, ``weight_decay``, ...).
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer],
                 stage: int = 1, bucket_size_mb: float = 25.0, process_group: Any = None,
                 **defaults: Any):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 (shard optimizer state) or 2 (also gradients), "
                             f"got {stage!r}; stage 3 (parameters) is dtlib.parallel.FSDP")
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer subclass such as "
                            f"torch.optim.AdamW, got {optimizer_cls!r}")
        validate.number("bucket_size_mb", bucket_size_mb)  # MiB, finite: inf overflowed int()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run inside dtlib.launch(...)")
        self.stage, self.process_group = stage, process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        groups = _param_groups(params)
        all_params = unique_parameters(p for g in groups for p in g["params"])
        broadcast_coalesced(all_params, 0, process_group)  # shards must come from equal replicas

        self.buckets: list[_FlatBucket] = []
        inner_groups = []
        for g in groups:
            ps = list(reversed(g["params"]))  # gradients arrive roughly in reverse order
            bucket_ids = []
            for idx in assign_buckets(ps, int(bucket_size_mb * MiB)):
                self.buckets.append(_FlatBucket([ps[i] for i in idx], self.world_size, self.rank))
                bucket_ids.append(len(self.buckets) - 1)
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"},
                                 "params": [self.buckets[b].shard for b in bucket_ids]})
        self.optim = optimizer_cls(inner_groups, **defaults)
        self._where = {id(p): (b, s) for b, bucket in enumerate(self.buckets)
                       for s, p in enumerate(bucket.params)}
        self._handles = []
        if stage == 2:
            self._ready = [[False] * len(b.params) for b in self.buckets]
            self._launcher = InOrderLauncher([len(b.params) for b in self.buckets],
                                             self._reduce_scatter)
            self._handles = register_grad_ready_hooks([p for b in self.buckets for p in b.params],
                                                      self, "_grad_ready")

    # ---- stage 2: reduce-scatter during backward ---------------------------------------------
    def _grad_ready(self, p: torch.Tensor) -> None:
        b, s = self._where[id(p)]
        if self._ready[b][s] or b < self._launcher.next:
            # a new backward began (accumulation) while the previous one left buckets incomplete:
            # p was already counted, or its bucket already launched, in that backward
            self._flush()
        self._ready[b][s] = True
        self._launcher.arrive(b)

    def _reduce_scatter(self, b: int) -> None:
        """Average bucket ``b``'s gradients into this rank's shard, then free the full ones."""
        bucket = self.buckets[b]
        flat = bucket.layout.flatten([p.grad for p in bucket.params], dtype=bucket.flat.dtype,
                                     device=bucket.flat.device)
        flat.div_(self.world_size)  # average (divide before the sum, as DDP does)
        received = torch.empty(bucket.layout.shard_numel, dtype=flat.dtype, device=flat.device)
        work = reduce_scatter_into(received, flat, self.process_group, async_op=True)
        bucket.in_flight.append((work, received))
        for p in bucket.params:
            p.grad = None  # ZeRO-2's saving: the full gradient does not outlive its bucket
        self._ready[b] = [False] * len(bucket.params)
        if self._launcher.all_launched:
            self._launcher.reset()

    def _flush(self) -> None:
        """Launch the buckets of this backward that are still incomplete (missing = zero)."""
        for b, ready in enumerate(self._ready):
            for s, done in enumerate(ready):
                if not done and self._launcher.next <= b:
                    ready[s] = True
                    self._launcher.arrive(b)

    def finish_gradient_synchronization(self) -> None:
        """Stage 2: wait for the reduce-scatters and accumulate them into the gradient shards."""
        if self.stage != 2:
            return
        if self._launcher.next > 0 or any(any(r) for r in self._ready):
            # this backward left buckets unlaunched (parameters without a gradient, possibly a
            # whole bucket): launch them now, so that every rank issues every reduce-scatter
            self._flush()
        for bucket in self.buckets:
            for work, received in bucket.in_flight:
                work.wait()
                if bucket.grad_shard is None:
                    bucket.grad_shard = received
                else:
                    bucket.grad_shard += received
            bucket.in_flight = []

    # ---- the optimizer interface ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update this rank's shards, then all-gather every bucket's parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.stage == 2:
            self.finish_gradient_synchronization()
        for bucket in self.buckets:
            if self.stage == 1:
                lo, hi = bucket.layout.shard_range(self.rank)  # only our shard is copied
                bucket.shard.grad = bucket.layout.flatten_range([p.grad for p in bucket.params], lo, hi,
                                                                dtype=bucket.flat.dtype,
                                                                device=bucket.flat.device)
            else:
                bucket.shard.grad = bucket.grad_shard
        self.optim.step()
        works = [all_gather_into(b.flat, b.shard.detach().clone(), self.process_group, async_op=True)
                 for b in self.buckets]  # the clone: our shard is also a slice of the output
        for w in works:
            w.wait()
        for bucket in self.buckets:
            # Stage 1: a temporary. Stage 2: the step consumed the gradient shards, so the next
            # backward starts from zero whichever zero_grad the user calls (model.zero_grad()
            # cannot reach these shards): DeepSpeed's ZeRO-2 step frees them too
            # (DeepSpeedZeroOptimizer.step, "averaged_gradients[i] = None").
            bucket.shard.grad = None
            bucket.grad_shard = None
        return loss

    def held_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor, Any]]:
        """``(parameter, the gradient this rank holds for it, the group over which that gradient
        is replicated or None)`` for :mod:`dtlib.parallel.clip`. Stage 1: the full gradients,
        averaged (equal) over the group. Stage 2: each parameter's part of this rank's gradient
        shard (a view: scaling it scales the shard), this rank's alone."""
        group = dist.group.WORLD if self.process_group is None else self.process_group
        if self.stage == 1:
            return [(p, p.grad, group) for b in self.buckets for p in b.params if p.grad is not None]
        self.finish_gradient_synchronization()
        out = []
        for b in self.buckets:
            if b.grad_shard is None:
                continue
            lo, hi = b.layout.shard_range(self.rank)
            for p, start, n in zip(b.params, b.layout.offsets, b.layout.numels):
                first, last = max(start, lo), min(start + n, hi)
                if first < last:
                    out.append((p, b.grad_shard[first - lo:last - lo], None))
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, tp_group: Any = None,
                        group: Any = None) -> float:
        """Clip the gradients to global norm ``max_norm`` before :meth:`step` and return the norm
        before clipping, as DeepSpeed's ZeRO optimizers do inside their step. Stage 2 clips its
        gradient shards (``p.grad`` is already freed there, so ``torch.nn.utils.clip_grad_norm_``
        would see a norm of 0); stage 1 the full, averaged gradients. ``tp_group``: the
        tensor-parallel group of a TP model (replicated parameters counted once). A collective
        over ``group`` (default: all ranks); see :func:`dtlib.parallel.clip.clip_grad_norm_`."""
        return clip_grad_norm_(self, max_norm, norm_type, tp_group=tp_group, group=group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for bucket in self.buckets:
            bucket.grad_shard = None
            for p in bucket.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (one per given group): change ``lr`` here, or pass
        ``sharded.optim`` to a learning-rate scheduler."""
        return self.optim.param_groups

    def _layout(self) -> dict[str, Any]:
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "bucket_numels": [b.layout.padded_numel for b in self.buckets]}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (each rank saves its own), with the layout
        it belongs to. Save it next to ``model.state_dict()`` (the full parameters, equal on
        every rank); restore both into a freshly built model and ``ShardedOptimizer``."""
        return {"layout": self._layout(), "optimizer": self.optim.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned on the same rank, with the same world size,
        stage and buckets (a shard only fits the layout it was cut from)."""
        if not isinstance(state, dict) or set(state) != {"layout", "optimizer"}:
            raise ValueError("state must be what ShardedOptimizer.state_dict() returned "
                             "(keys 'layout' and 'optimizer')")
        if state["layout"] != self._layout():
            raise ValueError(f"this optimizer state was saved with layout {state['layout']}, but this "
                             f"ShardedOptimizer has {self._layout()}: load it on the same rank, with "
                             "the same world size, stage, bucket_size_mb and parameters")
        self.optim.load_state_dict(state["optimizer"])

    # ---- what it costs -------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (tensors in the inner optimizer's state)."""
        held = optimizer_state_bytes(self.optim)
        return held["optimizer"] + held["optimizer_scalars"]

    def grad_bytes(self) -> int:
        """Bytes of gradients held by this rank right now (full ``.grad``s plus shards)."""
        full = sum(p.grad.nbytes for b in self.buckets for p in b.params if p.grad is not None)
        return full + sum(b.grad_shard.nbytes for b in self.buckets if b.grad_shard is not None)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Normalise ``params`` to param groups of trainable tensors (frozen ones are skipped)."""
    params = list(params)
    if not params:
        raise ValueError("ShardedOptimizer got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out, seen = [], set()
    for g in groups:
        if not isinstance(g, dict) or "params" not in g:
            raise TypeError("params must be tensors or dicts with a 'params' key (param groups)")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        ps = [p for p in unique_parameters(ps) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in ps)
        if ps:
            out.append({**g, "params": ps})
    if not out:
        raise ValueError("none of the given parameters requires a gradient")
    return out
