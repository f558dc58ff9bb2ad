"""Data-parallel training with gradient all-reduce overlapped with backward: NaiveDDP, BucketedDDP.

Follows the design of PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB, Sec. 3-4; the ``Reducer`` in torch/csrc/distributed):

* at construction rank 0's parameters and buffers are broadcast, so every replica starts equal;
* every parameter gets a hook that fires once its gradient is fully accumulated
  (``Tensor.register_post_accumulate_grad_hook``); the gradient is copied into its bucket, and
  when the bucket's last gradient arrives, the bucket's *asynchronous* all-reduce is issued -
  while autograd goes on computing the gradients of earlier layers (overlap, Sec. 3.2.3);
* buckets are filled in reverse order of use (first assumed to be the reverse of registration,
  then *rebuilt* after the first iteration from the order in which gradients really became
  ready, as PyTorch does), and launched strictly in bucket order, so that all ranks issue the
  same collectives in the same order even if autograd visits parameters in a different order;
* the all-reduce sums gradients pre-divided by the world size: the *gradients* are averaged,
  never the weights, which is what makes N ranks equal one process on the full batch;
* ``no_sync()`` skips communication for gradient accumulation; the gradients accumulated over
  the micro-batches are averaged once, on the last one (Sec. 3.2.4);
* ``find_unused_parameters=True`` walks the autograd graph after forward to mark parameters
  that will get no gradient as ready (Sec. 3.2.3, "globally unused parameters"), and a small
  all-reduce of "used" flags keeps the gradient of a parameter unused on every rank ``None``,
  as in single-process training. Frozen parameters (``requires_grad=False``) are never reduced.

Unlike PyTorch, waiting for the all-reduces is explicit: call
:meth:`finish_gradient_synchronization` after ``backward()`` and before ``optimizer.step()``.
Forgetting it is detected at the next forward. Which modules are wrapped is recorded in this
module (``_WRAPPED``), never on the user's module, so the model can be deep-copied, pickled, and
a copy wrapped again; the wrapper itself pickles (``torch.save``) with the default group, as
PyTorch DDP. Every synchronised iteration leaves a
:class:`SyncRecord` (when each bucket was ready, issued, finished; when backward ended; bytes
moved) in ``.records``, so overlap can be tested and drawn (:mod:`dtlib.viz.timeline`).

About 520 lines: the buckets, their hooks and the records of when each all-reduce was issued and
finished are one mechanism (a record is written by the hook that launches the bucket); apart, the
hooks would reach into another module's state.
"""
from __future__ import annotations

import time
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from dtlib.analytic import validate
from dtlib.analytic.units import MiB
from dtlib.parallel.buckets import (FlatLayout, InOrderLauncher, assign_buckets,
                                    register_grad_ready_hooks, unique_parameters)
from dtlib.analytic.comm import bytes_sent_per_rank
from dtlib.parallel.collectives import broadcast_coalesced

__all__ = ["NaiveDDP", "BucketedDDP", "GradBucket", "SyncRecord", "CommHook"]

# module -> weak reference to the live wrapper around it. Kept here, not as an attribute of the
# user's module, so that copy.deepcopy(model) (an EMA or reference copy) is a fresh module that can
# be wrapped again, and torch.save(model) has nothing unpicklable to save.
_WRAPPED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


class GradBucket:
    """One bucket: a flat gradient buffer for a few parameters, and its timings.

    Offers the methods of ``torch.distributed.GradBucket`` (``index``, ``buffer``, ``gradients``,
    ``parameters``, ``is_last``, ``set_buffer``) so a communication hook can be written once for
    both our DDP and PyTorch's. ``log(collective, tensor)`` is how hooks report what they send.
    """

    def __init__(self, index: int, params: list[nn.Parameter], names: list[str], is_last: bool):
        self._index, self._params, self.names, self._is_last = index, params, names, is_last
        self.layout = FlatLayout.of(params)
        self._buffer = torch.zeros(self.layout.numel, dtype=params[0].dtype, device=params[0].device)
        self._views = self.layout.views(self._buffer)  # made once: hooks index them per gradient
        self.reset()

    def reset(self) -> None:
        self.used = [False] * len(self._params)   # this rank had a gradient for the parameter
        self.ready = [False] * len(self._params)
        self.work: Any = None                     # what the hook returned (has .wait())
        self.comm: list[tuple[str, int, int]] = []  # (collective, numel, element size)

    # -- torch.distributed.GradBucket's interface --
    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return list(self._views)

    def parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last

    def log(self, collective: str, tensor: torch.Tensor) -> None:
        """Record that ``collective`` ("all_reduce", "all_gather", ...) was issued on ``tensor``
        (for all_gather: this rank's input)."""
        self.comm.append((collective, tensor.numel(), tensor.element_size()))


CommHook = Callable[[Any, GradBucket], Any]  # (state, bucket) -> object whose .wait() gives the result


@dataclass
class SyncRecord:
    """Timeline of one synchronised iteration (``time.perf_counter()`` seconds) and its traffic.

    ``bucket_*`` lists are indexed by bucket; ``comm`` lists ``(bucket, collective, numel,
    element_size)`` for every collective the buckets issued. ``bucket_done`` is when
    ``finish_gradient_synchronization`` had the bucket's result (when the code waited);
    ``bucket_completed`` when its all-reduce itself finished (the work's future, marked complete by
    the backend's communication thread), None where a communication hook's result has no future.
    """
    world_size: int
    forward_start: float
    forward_end: float
    first_grad: float | None = None
    backward_end: float | None = None
    finish_end: float | None = None
    bucket_bytes: list[int] = field(default_factory=list)
    bucket_ready: list[float | None] = field(default_factory=list)
    bucket_issued: list[float | None] = field(default_factory=list)
    bucket_done: list[float | None] = field(default_factory=list)
    comm: list[tuple[int, str, int, int]] = field(default_factory=list)
    bucket_completed: list[float | None] = field(default_factory=list)

    @property
    def communication_end(self) -> float | None:
        """When the last bucket's collective finished: its completion where recorded, else when
        it was waited for."""
        ends = [c if c is not None else d for c, d in zip(self.bucket_completed or self.bucket_done,
                                                           self.bucket_done)]
        ends = [t for t in ends if t is not None]
        return max(ends) if ends else None

    @property
    def left_after_backward(self) -> float | None:
        """Seconds of communication still running when backward ended (0 when it all finished
        before): what overlap did not hide (Li et al. 2020, Sec. 3.2.3)."""
        end = self.communication_end
        if end is None or self.backward_end is None:
            return None
        return max(0.0, end - self.backward_end)

    @property
    def payload_bytes(self) -> int:
        """Bytes this rank handed to collectives (the message sizes)."""
        return sum(n * es for _, _, n, es in self.comm)

    @property
    def wire_bytes(self) -> float:
        """Bytes this rank sends if every collective runs as a ring (:mod:`dtlib.analytic.comm`'s model;
        an all-gather's buffer is the gathered output, ``world_size`` times our input)."""
        total = 0.0
        for _, coll, n, es in self.comm:
            nbytes = n * es * (self.world_size if coll == "all_gather" else 1)
            total += bytes_sent_per_rank(coll, nbytes, self.world_size)
        return total

    @property
    def overlapped_buckets(self) -> int:
        """How many buckets were issued before backward ended."""
        end = self.backward_end
        return sum(1 for t in self.bucket_issued if t is not None and end is not None and t < end)


class _Pending:
    """The default hook's result: an async all-reduce whose ``wait()`` returns the buffer."""

    def __init__(self, work: Any, buffer: torch.Tensor):
        self.work, self.buffer = work, buffer

    def wait(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


class _DataParallel(nn.Module):
    """Shared machinery of :class:`NaiveDDP` and :class:`BucketedDDP` (see the module docstring)."""

    def __init__(self, module: nn.Module, bucket_cap_bytes: int, process_group: Any = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 rebuild_buckets: bool = True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run inside dtlib.launch(...) "
                               "or call dist.init_process_group first")
        if _WRAPPED.get(module, lambda: None)() is not None:
            raise ValueError("this module is already wrapped by a live data-parallel wrapper; "
                             "call .remove_hooks() on it (or delete it) first")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self._cap = bucket_cap_bytes
        self._rebuild_pending = rebuild_buckets
        backend = dist.get_backend(process_group)
        for name, t in [*module.named_parameters(), *module.named_buffers()]:
            if backend == "nccl" and t.device.type != "cuda":
                raise ValueError(f"{name} is on {t.device} but the backend is NCCL: move the "
                                 "model to dtlib.launcher.get_device() before wrapping it")
        # every replica starts from rank 0's weights (PyTorch: _sync_module_states)
        broadcast_coalesced(unique_parameters([*module.parameters(), *module.buffers()]), 0,
                            process_group)

        self._params = [p for p in unique_parameters(module.parameters()) if p.requires_grad]
        if not self._params:
            raise ValueError("the module has no parameter that requires a gradient: there is "
                             "nothing to synchronise (data parallelism is not needed)")
        names = {}
        for name, p in module.named_parameters():  # the first name of a tied parameter
            names.setdefault(id(p), name)
        self._names = [names[id(p)] for p in self._params]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # first guess of the order in which gradients become ready: reverse of registration
        self._build_buckets(list(reversed(range(len(self._params)))))

        self._attach()
        self._sync_enabled = True   # False inside no_sync()
        self._armed = False         # a forward asked for a synchronised backward
        self._hook: CommHook | None = None
        self._hook_state: Any = None
        self.records: deque[SyncRecord] = deque(maxlen=1000)
        self._record: SyncRecord | None = None

    # ---- buckets ----------------------------------------------------------------------------
    def _build_buckets(self, order: list[int]) -> None:
        """Buckets over ``self._params`` taken in ``order`` (expected order of readiness)."""
        ordered = [self._params[i] for i in order]
        groups = assign_buckets(ordered, self._cap)
        self.buckets = [GradBucket(b, [ordered[j] for j in idx], [self._names[order[j]] for j in idx],
                                   is_last=b == len(groups) - 1) for b, idx in enumerate(groups)]
        self._launcher = InOrderLauncher([len(b.parameters()) for b in self.buckets],
                                         self._launch_index)
        # parameter index -> (bucket, slot)
        self._slot = {}
        for b in self.buckets:
            for s, p in enumerate(b.parameters()):
                self._slot[self._index[id(p)]] = (b, s)

    def _launch_index(self, i: int) -> None:
        self._launch(self.buckets[i])

    def _attach(self) -> None:
        """Hook the parameters and record the module as wrapped (construction and unpickling)."""
        self._handles = register_grad_ready_hooks(self._params, self, "_grad_ready")
        _WRAPPED[self.module] = weakref.ref(self)

    # ---- pickling (torch.save(wrapper), copy.deepcopy(wrapper)) ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # As PyTorch DDP's __getstate__: only the default group can be pickled (a process group
        # is a live connection), and the hook handles are rebuilt on unpickling.
        if self.process_group is not None:
            raise RuntimeError("a data-parallel wrapper can be pickled only with the default process "
                               "group (as PyTorch DDP); save wrapper.module or its state_dict instead")
        state = self.__dict__.copy()
        del state["_handles"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._index = {id(p): i for i, p in enumerate(self._params)}  # ids change with the objects
        self._attach()

    def bucket_summary(self) -> list[dict[str, Any]]:
        """Per bucket: its index, parameter names (in bucket order) and size in bytes."""
        return [{"index": b.index(), "params": list(b.names), "bytes": b.buffer().nbytes}
                for b in self.buckets]

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the default averaging all-reduce by ``hook(state, bucket)``, as in PyTorch.

        The hook must average the bucket over ranks and return an object whose ``wait()`` gives
        the averaged flat tensor (a ``torch.futures.Future`` qualifies). It is called on the
        thread that runs backward, in bucket order, on every rank.
        """
        if self.records or self._armed:
            raise RuntimeError("register_comm_hook must be called before the first forward")
        if not callable(hook):
            raise TypeError(f"hook must be callable as hook(state, bucket), got {type(hook).__name__}")
        self._hook, self._hook_state = hook, state

    # ---- forward / backward -----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._armed and self._record.first_grad is not None:  # a backward ran, no finish
            raise RuntimeError("the previous backward's gradients were never synchronised: call "
                               "finish_gradient_synchronization() after backward() and before "
                               "optimizer.step()")
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:  # e.g. BatchNorm running stats: rank 0's win, as in PyTorch DDP
                broadcast_coalesced(buffers, 0, self.process_group)
        start = time.perf_counter()
        out = self.module(*args, **kwargs)
        self._armed = self._sync_enabled and torch.is_grad_enabled()
        if self._armed:
            self._prepare_for_backward(out, start)
        return out

    def _prepare_for_backward(self, out: Any, start: float) -> None:
        for b in self.buckets:
            b.reset()
        self._launcher.reset()
        self._ready_order: list[int] = []
        n = len(self.buckets)
        self._record = SyncRecord(self.world_size, start, time.perf_counter(),
                                  bucket_bytes=[b.buffer().nbytes for b in self.buckets],
                                  bucket_ready=[None] * n, bucket_issued=[None] * n,
                                  bucket_done=[None] * n, bucket_completed=[None] * n)
        if self.find_unused_parameters:
            reached = _parameters_reached(out)
            for i, p in enumerate(self._params):
                if id(p) not in reached:
                    self._mark_ready(i)  # no gradient will come: contribute what we have (or 0)

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self._armed:
            return  # inside no_sync(), or a backward not preceded by our forward
        rec = self._record
        if rec.first_grad is None:
            rec.first_grad = time.perf_counter()
            # runs once autograd has finished the whole backward pass: the end of compute
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        self._mark_ready(self._index[id(p)])

    def _backward_done(self) -> None:
        self._record.backward_end = time.perf_counter()

    def _mark_ready(self, i: int) -> None:
        bucket, slot = self._slot[i]
        if bucket.ready[slot]:
            raise RuntimeError(f"parameter {self._names[i]!r} became ready twice in one iteration "
                               "(two backward passes through one forward?); with "
                               "find_unused_parameters=True a parameter must not be used "
                               "outside the module's forward")
        p = self._params[i]
        view = bucket._views[slot]
        if p.grad is None:
            view.zero_()
        elif self._hook is None:
            # average while copying into the bucket: one pass over the gradient instead of two
            # (PyTorch's Reducer does the same); the sum of these over ranks is the mean
            torch.mul(p.grad, 1.0 / self.world_size, out=view)
            bucket.used[slot] = True
        else:
            view.copy_(p.grad)  # hooks get the raw local gradient, as in PyTorch
            bucket.used[slot] = True
        bucket.ready[slot] = True
        self._ready_order.append(i)
        now = time.perf_counter()
        if self._launcher.arrive(bucket.index()):  # launches complete buckets, in bucket order
            self._record.bucket_ready[bucket.index()] = now

    def _launch(self, bucket: GradBucket) -> None:
        self._record.bucket_issued[bucket.index()] = time.perf_counter()
        if self._hook is not None:
            bucket.work = self._hook(self._hook_state, bucket)
            future = bucket.work if isinstance(bucket.work, torch.futures.Future) else None
        else:
            buf = bucket.buffer()  # already divided by the world size (no fp16 overflow in the sum)
            bucket.log("all_reduce", buf)
            work = dist.all_reduce(buf, group=self.process_group, async_op=True)
            bucket.work, future = _Pending(work, buf), work.get_future()
        if future is not None:  # the callback runs when the collective completes, not when waited for
            completed, index = self._record.bucket_completed, bucket.index()
            future.add_done_callback(lambda _: completed.__setitem__(index, time.perf_counter()))

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce and write the averaged gradients into ``.grad``.

        Call after ``backward()`` and before ``optimizer.step()``. A no-op after a backward run
        under :meth:`no_sync`.
        """
        if not self._armed:
            return
        missing = [self._names[i] for i in range(len(self._params))
                   if not self._slot[i][0].ready[self._slot[i][1]]]
        if missing:
            if self._record.first_grad is None:
                raise RuntimeError("finish_gradient_synchronization() was called before backward()")
            raise RuntimeError(
                f"parameters {missing} received no gradient in this backward, so their buckets "
                "were never all-reduced; wrap with find_unused_parameters=True if parts of the "
                "model can be skipped, or set requires_grad=False on parameters that never train")
        rec = self._record
        for b in self.buckets:
            result = b.work.wait()
            result = result[0] if isinstance(result, (list, tuple)) else result
            if result is not b.buffer():
                b.buffer().copy_(result)
            rec.bucket_done[b.index()] = time.perf_counter()
            rec.comm.extend((b.index(), *c) for c in b.comm)
        if self.find_unused_parameters:
            # a parameter unused on *every* rank keeps grad None, as in one process
            used = torch.tensor([float(u) for b in self.buckets for u in b.used],
                                device=self.buckets[0].buffer().device)
            dist.all_reduce(used, group=self.process_group)
            used_anywhere = iter((used > 0).tolist())
        with torch.no_grad():
            for b in self.buckets:
                for p, g in zip(b.parameters(), b.gradients()):
                    if self.find_unused_parameters and not next(used_anywhere):
                        continue
                    if p.grad is None:
                        p.grad = g.clone()
                    else:
                        p.grad.copy_(g)
        rec.finish_end = time.perf_counter()
        self.records.append(rec)
        for b in self.buckets:
            b.work = None
        self._armed = False
        if self._rebuild_pending:
            self._rebuild_buckets()

    def _rebuild_buckets(self) -> None:
        """After the first iteration, re-bucket in the order gradients really became ready.

        Rank 0's order is broadcast so that every rank builds identical buckets (Li et al. 2020
        Sec. 3.2.3; PyTorch's ``Reducer::rebuild_buckets``)."""
        self._rebuild_pending = False
        order = torch.tensor(self._ready_order, dtype=torch.int64,
                             device=self.buckets[0].buffer().device)
        dist.broadcast(order, dist.get_global_rank(self.process_group, 0)
                       if self.process_group is not None else 0, group=self.process_group)
        order_list = order.tolist()
        if order_list != [i for b in self.buckets for i in
                          (self._index[id(p)] for p in b.parameters())]:
            self._build_buckets(order_list)

    def held_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor, Any]]:
        """``(parameter, its gradient, the group over which it is replicated)`` for
        :mod:`dtlib.parallel.clip`: after :meth:`finish_gradient_synchronization` every rank of the
        group holds the same averaged gradients."""
        group = dist.group.WORLD if self.process_group is None else self.process_group
        return [(p, p.grad, group) for p in self._params if p.grad is not None]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward/backward passes inside accumulate gradients locally, without communication;
        the first synchronised backward after it averages the accumulated sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def remove_hooks(self) -> None:
        """Detach from the module (its parameters stop triggering communication)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if _WRAPPED.get(self.module, lambda: None)() is self:
            del _WRAPPED[self.module]

    @property
    def last_record(self) -> SyncRecord | None:
        return self.records[-1] if self.records else None


def _parameters_reached(out: Any) -> set[int]:
    """ids of the leaf tensors (parameters) that the autograd graph of ``out`` reaches."""
    seen, stack, found = set(), [], set()
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif isinstance(t, torch.Tensor) and t.requires_grad:
            found.add(id(t))  # the output is itself a leaf parameter
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: the end of a path at a leaf
            found.add(id(fn.variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return found


class NaiveDDP(_DataParallel):
    """All-reduce each parameter's gradient on its own, as soon as it is ready (async).

    The simplest overlapped DDP: one bucket per parameter, so one collective per parameter -
    for models with many small tensors the per-message latency dominates, which is what
    :class:`BucketedDDP` fixes.
    """

    def __init__(self, module: nn.Module, process_group: Any = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True):
        super().__init__(module, 0, process_group, find_unused_parameters, broadcast_buffers)


class BucketedDDP(_DataParallel):
    """Gradients packed into ~``bucket_size_mb`` MiB buckets in reverse order of use; each
    bucket's all-reduce starts as soon as its last gradient is ready.

    Args:
        module: the model (on ``dtlib.launcher.get_device()``).
        bucket_size_mb: bucket capacity in MiB (PyTorch's ``bucket_cap_mb``, default 25).
        process_group: the data-parallel group (default: all ranks).
        find_unused_parameters: set if some parameters may get no gradient in an iteration.
        broadcast_buffers: broadcast rank 0's buffers before every forward (as PyTorch).
        rebuild_buckets: re-bucket once after the first iteration in the observed order.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float = 25.0, process_group: Any = None,
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 rebuild_buckets: bool = True):
        validate.number("bucket_size_mb", bucket_size_mb)  # MiB, finite: inf overflowed int()
        super().__init__(module, int(bucket_size_mb * MiB), process_group, find_unused_parameters,
                         broadcast_buffers, rebuild_buckets)
