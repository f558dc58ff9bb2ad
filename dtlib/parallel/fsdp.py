"""A toy fully sharded data parallel (ZeRO stage 3): every parameter sharded on dim 0, as FSDP2.

Follows Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"
(VLDB), Sec. 3 (units, the forward/backward all-gathers and the gradient reduce-scatter),
Rajbhandari et al. 2020 (ZeRO, Sec. 5.3, stage 3 / P_os+g+p) and PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``, the per-parameter sharding RFC pytorch/pytorch#114299):

* the model is cut into *units*: each submodule whose type is in ``unit_types`` (e.g. the
  transformer block) and the root for everything else;
* each parameter is sharded **on dim 0**, like FSDP2's ``Shard(0)``: ``torch.chunk`` into N
  pieces of ``ceil(rows / N)`` rows, rank r keeping piece r (the last ranks may hold fewer rows,
  possibly none: shape ``(0, 64)``). The model's own ``nn.Parameter`` objects stay, with their
  names, and become this piece - so ``p.dim()`` is the original one on every rank, every rank
  holds the same parameters with the same trailing dimensions, and a nanoGPT
  ``configure_optimizers`` (decay if ``p.dim() >= 2``) works before or after wrapping, as does
  code that runs one collective per parameter (but not ``torch.nn.utils.clip_grad_norm_``,
  which sees this rank's rows: :meth:`FSDP.clip_grad_norm_` clips by the global norm). A unit's
  padded pieces are packed into one flat shard per rank
  (:class:`~dtlib.parallel.buckets.Dim0Layout`), the only persistent copy, so a unit still costs
  one all-gather and one reduce-scatter;
* parameters with fewer than ``persistence_threshold`` elements (and 0-d ones) are not sharded:
  they stay whole on every rank (replicated) and their gradients are all-reduced (averaged) at the
  end of backward - DeepSpeed ZeRO-3's ``stage3_param_persistence_threshold``;
* just before a unit's forward its shards are all-gathered (in ``compute_dtype`` if given), copied
  out into a buffer where each parameter's rows are contiguous, and the module's parameters are
  bound to views of it; right after its forward they are unbound and the buffer's storage is freed
  (resized to 0, as PyTorch FSDP's ``_free_storage``, so the memory goes at once);
* tensors that autograd saves for backward and that are views of a gathered buffer are not kept:
  a ``saved_tensors_hooks`` pack hook replaces them by (unit, size, stride, offset), and the unpack
  hook all-gathers the unit *again* just before its backward needs it (the "all-gather before
  backward" of FSDP);
* when autograd has accumulated the gradient of a unit's whole buffer (the backward of the
  custom Function that produced it), that gradient is reduce-scattered asynchronously - each
  rank receives the average of its rows - and the buffer is freed again. At the end of the
  backward pass an autograd engine callback (``queue_callback``, as PyTorch FSDP's
  ``_post_backward_final_callback``) waits for them, adds each parameter's rows to its ``.grad``
  (shaped like the parameter) and all-reduces the replicated parameters' gradients, so
  ``backward(); optimizer.step()`` is all a training loop needs;
  :meth:`FSDP.finish_gradient_synchronization` does the same and may still be called (a no-op then);
* activation checkpointing (non-reentrant ``torch.utils.checkpoint``) recomputes a forward
  during backward: there the units' hooks neither gather through the autograd Function nor free,
  they bind the (re-)gathered buffer, which stays until the unit's gradient is reduce-scattered -
  as FSDP2's hooks do nothing in forward while its state is ``PRE_BACKWARD``;
* composition: the module may already be tensor-parallel (its parameters are the TP-local slabs,
  which FSDP shards further on dim 0 - torchtitan's FSDP2 over TP, ``parallelize_llama``) or a
  pipeline stage (one FSDP per stage over the data-parallel group);
* checkpoints: :meth:`FSDP.gather_full_params` gives the full state dict (a collective),
  :meth:`FSDP.load_full_state_dict` loads one into the shards (every rank passes the full dict);
  every sharded parameter carries ``fsdp_shard = (full shape, first row)``, which
  :mod:`dtlib.resilience.chunks` turns into a box of the full tensor (resharding checkpoints).

Not done, to stay readable: prefetching the next unit's all-gather (PyTorch overlaps it), keeping
the root gathered between forward and backward, CPU offload, per-unit mixed precision settings,
reentrant activation checkpointing. Parameters with ``requires_grad=False`` stay ordinary,
replicated parameters (not sharded, not cast: with ``compute_dtype`` they must already have that
dtype), and :meth:`FSDP.gather_full_params` returns them with the rest.

About 570 lines, over the usual 400: one wrapper and its unit, whose hooks (gather, bind, free,
reduce-scatter, the end-of-backward callback with its used-parameter flags) and checkpoint functions
all read and write the same per-unit state; split, each piece would need the others' internals.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from dtlib.analytic import validate
from dtlib.parallel.buckets import Dim0Layout, unique_parameters
from dtlib.parallel.clip import clip_grad_norm_
from dtlib.parallel.collectives import all_gather_into, broadcast_coalesced, reduce_scatter_into

__all__ = ["FSDP", "DEFAULT_PERSISTENCE_THRESHOLD"]

# Shard every parameter by default, as FSDP2 does. DeepSpeed's default (1e5 elements) pays off
# there because ZeRO-3 fetches parameters one by one, each fetch paying a latency; here a unit's
# small parameters ride along in the unit's one all-gather and reduce-scatter for free, while a
# replicated one costs its full size on every rank and an all-reduce of its gradient.
DEFAULT_PERSISTENCE_THRESHOLD = 0


class _GatherParams(torch.autograd.Function):
    """shard -> unsharded parameters (all-gather); its backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: "_Unit") -> torch.Tensor:
        ctx.unit = unit
        return unit.gather()

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None]:
        # The parameters' .grad is written by finish_gradient_synchronization once the async
        # reduce-scatter is done, so nothing flows back through autograd.
        ctx.unit.reduce_scatter_grad(grad_full)
        return None, None


class _Packed:
    """A saved tensor that was a view of a unit's gathered parameters, kept as a recipe."""
    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: "_Unit", t: torch.Tensor):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


Owners = list[tuple[str, nn.Module, str]]  # (name, module, attribute) of every place a parameter is


class _Unit:
    """One FSDP unit: the flat shard of its sharded parameters (their dim-0 pieces), its replicated
    parameters, and where to bind them during its forward."""

    def __init__(self, owner: "FSDP", name: str, module: nn.Module, params: list[nn.Parameter],
                 aliases: list[Owners], replicated: list[tuple[nn.Parameter, Owners]]):
        self.owner, self.name, self.module, self.aliases = owner, name, module, aliases
        self.replicated = replicated
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError(f"unit {name or '(root)'!r} mixes parameter dtypes/devices "
                             f"{sorted({(str(p.dtype), str(p.device)) for p in params})}: one flat "
                             "buffer holds one dtype; convert the model first (e.g. model.float())")
        self.params, self.layout = params, Dim0Layout.of(params, owner.world_size)
        self.shard: torch.Tensor | None = None
        if params:
            with torch.no_grad():
                # requires_grad only so that _GatherParams is recorded by autograd (its backward
                # is where the gradient is reduce-scattered); the shard itself never gets a .grad
                self.shard = self.layout.shard_of([p.detach() for p in params], owner.rank).requires_grad_()
            views = self.layout.shard_views(self.shard.detach(), owner.rank)
            for i, (p, view) in enumerate(zip(params, views)):
                full_shape = tuple(p.shape)
                p.data = view  # the same Parameter object, now its rows: a view of the shard
                # what a checkpoint needs to place these rows in the full tensor (chunks.model_spans)
                p.fsdp_shard = (full_shape, self.layout.rows(i, owner.rank)[0])
        self.full: torch.Tensor | None = None
        self.recompute_bound = False  # bound for a recomputation during backward
        self.pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []
        self.used = [False] * len(params)  # which parameters this backward reached, here

    def gather(self) -> torch.Tensor:
        """All-gather the shards and copy them out into a fresh param-major buffer (no autograd),
        if not already there."""
        if self.full is None:
            src = self.shard.detach().to(self.owner.compute_dtype or self.shard.dtype)
            gathered = torch.empty(self.layout.padded_numel, dtype=src.dtype, device=src.device)
            all_gather_into(gathered, src, self.owner.process_group)
            # rank-major -> each parameter's rows contiguous (FSDP2's all-gather copy-out); the
            # all-gather output goes at once
            self.full = self.layout.to_param_major(gathered)
            self.owner._allocated(self.full)
        return self.full

    def bind(self, full: torch.Tensor | None) -> None:
        """Point the modules at views of the gathered buffer (and at the replicated parameters in
        ``compute_dtype``). Written into ``_parameters`` (as FSDP's use_orig_params swaps tensors
        for parameters) so the registration order is kept."""
        if full is not None:
            for i, (owners, view) in enumerate(zip(self.aliases, self.layout.full_views(full))):
                if view.requires_grad:  # fires only if backward reaches this parameter
                    view.register_hook(lambda g, i=i: self.used.__setitem__(i, True))
                for _, mod, attr in owners:  # a tied weight is bound in every owning module
                    mod._parameters[attr] = view
        dtype = self.owner.compute_dtype
        if dtype is not None:  # a differentiable cast: the gradient reaches the fp32 parameter
            for p, owners in self.replicated:
                cast = p.to(dtype)
                for _, mod, attr in owners:
                    mod._parameters[attr] = cast

    def bind_for_recompute(self) -> None:
        """Activation checkpointing recomputes a forward inside backward: bind the gathered
        buffer (re-gathered if freed) as a leaf that requires grad, so that the recomputation
        saves the same tensors as the forward did; its graph is only read, never differentiated
        (the forward's _GatherParams node gets the gradient), so no autograd Function here."""
        if not self.recompute_bound:
            self.bind(self.gather().detach().requires_grad_() if self.params else None)
            self.recompute_bound = True

    def free(self) -> None:
        for p, owners in [*zip(self.params, self.aliases), *self.replicated]:
            for _, mod, attr in owners:
                mod._parameters[attr] = p  # the parameter itself again
        self.recompute_bound = False
        if self.full is not None:
            # Release the memory now, whoever still holds the tensor object (e.g. the backend's
            # worker thread): PyTorch FSDP's ``_free_storage``. Safe because autograd keeps no
            # views of it (the pack hook swapped them for recipes), and a checkpointed
            # recomputation's views are used up before the unit's reduce-scatter.
            self.owner._released(self.full.untyped_storage().nbytes())
            self.full.untyped_storage().resize_(0)
            self.full = None

    def reduce_scatter_grad(self, grad_full: torch.Tensor) -> None:
        grad = self.layout.to_rank_major(grad_full)  # one copy, as FSDP2's chunk_cat
        grad /= self.owner.world_size  # average; divide first (fp16)
        received = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)
        work = reduce_scatter_into(received, grad, self.owner.process_group, async_op=True)
        self.pending.append((work, received, grad))  # keep grad alive until the work is done
        self.free()
        self.owner._finish_at_end_of_backward()

    def finish(self, used_anywhere: list[bool]) -> None:
        """Wait for this unit's reduce-scatters; add each parameter's rows to its ``.grad``
        (accumulating like autograd, so any ``zero_grad`` - the model's or the optimizer's - works).
        A parameter no rank's backward reached gets nothing: its ``.grad`` stays ``None`` as in
        one process (its rows are zeros), so AdamW does not decay or move it."""
        for work, received, _ in self.pending:
            work.wait()
            grad = received.to(self.shard.dtype)
            for p, piece, used in zip(self.params, self.layout.shard_views(grad, self.owner.rank), used_anywhere):
                if not used:
                    continue
                if p.grad is None:
                    p.grad = piece
                else:
                    p.grad += piece
        self.pending = []
        self.used = [False] * len(self.params)

    # forward hooks on the unit's module
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _in_backward():
            self.bind_for_recompute()
        else:
            if not self.owner._forwarding:  # its parameters are shards; the wrapper gathers them
                raise RuntimeError(f"{type(module).__name__} was called directly after FSDP(model) sharded its "
                                   "parameters: call the wrapper, fsdp = FSDP(model); fsdp(x) (unlike FSDP2's "
                                   "fully_shard, this FSDP does not turn the module itself into one)")
            self.bind(_GatherParams.apply(self.shard, self) if self.params else None)
        dtype = self.owner.compute_dtype
        if dtype is None:
            return args, kwargs
        # positional and keyword inputs alike, as PyTorch's cast_forward_inputs
        return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
                             (args, kwargs))

    def pre_forward_inner(self, module: nn.Module, args: tuple) -> None:
        """On modules inside the unit: a checkpointed submodule recomputed in backward needs
        the unit's parameters although the unit's own forward is not running."""
        if _in_backward():
            self.bind_for_recompute()

    def post_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not _in_backward():  # a recomputation's saved tensors still view the buffer
            self.free()


def _in_backward() -> bool:
    """True while autograd runs a backward pass (how torch.utils.checkpoint asks too)."""
    return torch._C._current_graph_task_id() != -1


class FSDP(nn.Module):
    """Toy FSDP (ZeRO-3): ``FSDP(module, compute_dtype=None, unit_types=(Block,))``.

    Args:
        module: the model (on ``dtlib.launcher.get_device()``); its parameters keep their
            names and their number of dimensions but become this rank's rows of them (dim-0
            shards, as FSDP2), so the optimizer's groups can be built on the model before
            wrapping or on the wrapper, by name or by ``p.dim()``.
        compute_dtype: gather parameters (and run forward/backward, and reduce gradients) in this
            dtype, e.g. ``torch.bfloat16``; the shards and the optimizer stay in fp32. Floating
            inputs of each unit are cast to it, and the output comes back in it.
        unit_types: submodule classes that become their own unit (gathered one at a time), like
            PyTorch's ``ModuleWrapPolicy``; everything else belongs to the root unit.
        process_group: the data-parallel group (default: all ranks).
        persistence_threshold: parameters with fewer elements stay whole on every rank
            (replicated; gradients all-reduced), as DeepSpeed's
            ``stage3_param_persistence_threshold``. Default 0: shard everything, as FSDP2 - see
            ``DEFAULT_PERSISTENCE_THRESHOLD`` for why.

    ``loss.backward(); optimizer.step()``: the gradients are synchronised at the end of
    backward. To clip them (nanoGPT clips at 1.0), call :meth:`clip_grad_norm_` before the step:
    ``torch.nn.utils.clip_grad_norm_`` would see only this rank's rows and clip each rank by its
    own, smaller norm. :meth:`gather_full_params` returns the full state dict,
    :meth:`load_full_state_dict` loads one. Other attributes are looked up on the wrapped module (as PyTorch's FSDP does).
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 unit_types: Sequence[type[nn.Module]] = (), process_group: Any = None,
                 persistence_threshold: int = DEFAULT_PERSISTENCE_THRESHOLD):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype must be a floating torch.dtype (e.g. torch.bfloat16) "
                             f"or None, got {compute_dtype!r}")
        if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in unit_types):
            raise TypeError(f"unit_types must be nn.Module subclasses, got {unit_types!r}")
        validate.integer("persistence_threshold", persistence_threshold, minimum=0)
        # FSDP runs the forward on views of its gathered buffers, never on the parameters, and
        # writes .grad itself: hooks registered on a parameter would silently never fire (e.g.
        # tensor_parallel's default sum of sequence-parallel gradients). Private attributes, but
        # the only way to see them.
        hooked = [n for n, p in module.named_parameters() if p.requires_grad
                  and (getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None))]
        if hooked:
            raise ValueError(f"parameters {hooked[:4]}{' ...' if len(hooked) > 4 else ''} have gradient hooks, "
                             "which FSDP's gathered views bypass: register them after wrapping on what "
                             "FSDP produces, or (tensor_parallel with sequence parallelism) convert with "
                             "sequence_parallel_grads='manual' and call allreduce_sequence_parallel_grads "
                             "after backward")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: run inside dtlib.launch(...)")
        backend = dist.get_backend(process_group)
        for name, p in module.named_parameters():
            if backend == "nccl" and p.device.type != "cuda":
                raise ValueError(f"{name} is on {p.device} but the backend is NCCL: move the model "
                                 "to dtlib.launcher.get_device() first")
        if compute_dtype is not None:  # frozen parameters are not gathered, so never cast
            frozen = [n for n, p in module.named_parameters()
                      if not p.requires_grad and p.is_floating_point() and p.dtype != compute_dtype]
            if frozen:
                raise ValueError(f"frozen parameters {frozen[:4]}{' ...' if len(frozen) > 4 else ''} "
                                 f"are not {compute_dtype}: with compute_dtype they meet inputs cast to "
                                 f"it; convert the frozen modules first (e.g. .to({compute_dtype}))")
        self.module, self.process_group, self.compute_dtype = module, process_group, compute_dtype
        self.persistence_threshold = persistence_threshold
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._state_keys = list(module.state_dict().keys())
        broadcast_coalesced(unique_parameters([*module.parameters(), *module.buffers()]), 0,
                            process_group)
        self.peak_unsharded_bytes = 0
        self._live_bytes = 0

        self._finish_queued = False
        self._forwarding = False
        self.units = self._make_units(module, tuple(unit_types))
        self.replicated = [p for u in self.units for p, _ in u.replicated]
        self._replicated_used: set[int] = set()  # replicated parameters this backward reached
        for p in self.replicated:  # their gradients are averaged at the end of backward too
            p.register_post_accumulate_grad_hook(self._replicated_grad_ready)
        for u in self.units:
            u.module.register_forward_pre_hook(u.pre_forward, with_kwargs=True)
            u.module.register_forward_hook(u.post_forward)
            inner = {id(mod): mod for owners in [*u.aliases, *(o for _, o in u.replicated)]
                     for _, mod, _ in owners}
            for mod in inner.values():
                if mod is not u.module:
                    mod.register_forward_pre_hook(u.pre_forward_inner)

    def __getattr__(self, name: str) -> Any:
        """Attributes of the wrapped module (e.g. a pipeline stage's ``activation_shape``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")  # not yet set: no recursion
            if module is None:
                raise
            return getattr(module, name)

    @property
    def flat_shards(self) -> list[torch.Tensor]:
        """This rank's flat shard of each unit (the sharded parameters are views into them)."""
        return [u.shard for u in self.units if u.shard is not None]

    def _replicate(self, p: nn.Parameter) -> bool:
        return p.dim() == 0 or p.numel() < self.persistence_threshold

    def _make_units(self, module: nn.Module, unit_types: tuple) -> list[_Unit]:
        unit_paths = [""] + [n for n, m in module.named_modules() if n and isinstance(m, unit_types)]
        modules = dict(module.named_modules())

        def unit_of(path: str) -> str:  # the innermost unit containing module ``path``
            return max((u for u in unit_paths if u == "" or path == u or path.startswith(u + ".")),
                       key=len)

        owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
        params: dict[int, nn.Parameter] = {}
        for path, mod in module.named_modules(remove_duplicate=False):
            for attr, p in mod._parameters.items():
                if p is not None and p.requires_grad:
                    owners.setdefault(id(p), []).append((path, mod, attr))
                    params[id(p)] = p
        members: dict[str, list[int]] = {u: [] for u in unit_paths}
        for pid, places in owners.items():
            units = {unit_of(path) for path, _, _ in places}
            # a weight tied across units (e.g. embedding and LM head) goes to the root
            members[units.pop() if len(units) == 1 else ""].append(pid)
        out = []
        for u in unit_paths:
            if members[u]:
                named = {pid: [(f"{pth}.{a}" if pth else a, m, a) for pth, m, a in owners[pid]]
                         for pid in members[u]}
                sharded = [pid for pid in members[u] if not self._replicate(params[pid])]
                replicated = [(params[pid], named[pid]) for pid in members[u] if self._replicate(params[pid])]
                out.append(_Unit(self, u, modules[u], [params[pid] for pid in sharded],
                                 [named[pid] for pid in sharded], replicated))
        return out

    # ---- forward / backward ----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._forwarding = True  # the units' hooks refuse a forward that bypasses this one
        try:  # (without the pack hook autograd would save views of buffers freed after forward)
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                return self.module(*args, **kwargs)
        finally:
            self._forwarding = False

    def _pack(self, t: torch.Tensor) -> Any:
        # Only views of a currently gathered buffer are swapped for a recipe; activations pass.
        live = [u for u in self.units if u.full is not None]
        if live and t.layout == torch.strided:
            ptr = t.untyped_storage().data_ptr()
            for u in live:
                if t.device == u.full.device and ptr == u.full.untyped_storage().data_ptr():
                    return _Packed(u, t)
        return t

    @staticmethod
    def _unpack(x: Any) -> torch.Tensor:
        if isinstance(x, _Packed):
            return x.unit.gather().as_strided(x.size, x.stride, x.offset)  # re-gather if freed
        return x

    def _allocated(self, full: torch.Tensor) -> None:
        """Account a gathered buffer from its all-gather until :meth:`_Unit.free` releases it."""
        self._live_bytes += full.untyped_storage().nbytes()
        self.peak_unsharded_bytes = max(self.peak_unsharded_bytes, self._live_bytes)

    def _released(self, nbytes: int) -> None:
        self._live_bytes -= nbytes

    def _finish_at_end_of_backward(self) -> None:
        """Called from inside backward: run :meth:`finish_gradient_synchronization` once the
        whole backward pass is done (PyTorch FSDP queues its final callback the same way)."""
        if not self._finish_queued:
            self._finish_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)

    def _replicated_grad_ready(self, p: torch.Tensor) -> None:
        self._replicated_used.add(id(p))
        self._finish_at_end_of_backward()

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient reduce-scatters; accumulate them into the parameters' ``.grad``;
        average the replicated parameters' gradients. One all-reduce carries those gradients and
        a flag per parameter (did this rank's backward reach it?): a parameter that no rank's
        backward reached keeps ``.grad = None``, as in one process (PyTorch DDP's
        ``find_unused_parameters`` all-reduces the same flags), so AdamW leaves it alone instead
        of decaying it with a zero gradient.

        Runs by itself at the end of every backward; calling it again is a no-op."""
        if not self._finish_queued:
            return
        self._finish_queued = False
        # every rank contributes every replicated parameter (zeros if it had no gradient), so
        # the all-reduce has the same size everywhere; mean over ranks is linear, so a gradient
        # averaged by an earlier backward of an accumulation stays right
        had_grad = [p.grad is not None for p in self.replicated]
        for p in self.replicated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flags = [float(f) for u in self.units for f in u.used]
        flags += [float(id(p) in self._replicated_used) for p in self.replicated]
        self._replicated_used = set()
        like = self.replicated[0] if self.replicated else self.flat_shards[0]
        flat = torch.cat([*(p.grad.reshape(-1) / self.world_size for p in self.replicated),
                          torch.tensor(flags, dtype=like.dtype, device=like.device)])
        dist.all_reduce(flat, group=self.process_group)
        used = (flat[flat.numel() - len(flags):] > 0).tolist()
        offset = 0
        for u in self.units:
            u.finish(used[offset:offset + len(u.params)])
            offset += len(u.params)
        offset = 0
        for p, had, reached in zip(self.replicated, had_grad, used[len(used) - len(self.replicated):]):
            if had or reached:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            else:
                p.grad = None  # reached by no rank: no gradient, as in one process
            offset += p.numel()

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (what :meth:`gather_full_params` or the unwrapped model's
        ``state_dict()`` gives, on every rank): each rank copies its rows, in place, so the
        parameters (views of the shard) and an optimizer built on them stay valid. No communication."""
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._state_keys]
        if missing or unexpected:
            raise KeyError(f"state_dict does not match the model: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]} (pass a full state dict, as "
                           "gather_full_params() returns)")
        sharded = set()
        for u in self.units:
            tensors = []
            for owners, shape in zip(u.aliases, u.layout.shapes):
                name = owners[0][0]
                if state_dict[name].shape != shape:
                    raise ValueError(f"{name} has shape {tuple(state_dict[name].shape)} in state_dict, "
                                     f"the model's is {tuple(shape)}")
                tensors.append(state_dict[name])
                sharded.update(n for n, _, _ in owners)
            if tensors:
                u.shard.copy_(u.layout.shard_of(tensors, self.rank))
        # the rest is replicated: buffers, replicated and frozen parameters, copied whole
        replicated = dict(self.module.named_buffers(remove_duplicate=False))
        replicated.update(self.module.named_parameters(remove_duplicate=False))
        for name in self._state_keys:
            if name not in sharded:
                replicated[name].copy_(state_dict[name])

    def held_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor, Any]]:
        """``(parameter, the gradient this rank holds for it, the group over which that gradient
        is replicated or None)`` for :mod:`dtlib.parallel.clip`: a sharded parameter's rows are
        this rank's alone, a replicated parameter's gradient is the same on the whole group."""
        self.finish_gradient_synchronization()
        replicated = {id(p) for p in self.replicated}
        group = dist.group.WORLD if self.process_group is None else self.process_group
        return [(p, p.grad, group if id(p) in replicated else None)
                for p in self.parameters() if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, group: Any = None) -> float:
        """Clip the gradients to global norm ``max_norm`` and return the norm before clipping, as
        FSDP1's ``FullyShardedDataParallel.clip_grad_norm_``: the norm of the whole model (each
        rank's rows summed over the group; a tensor-parallel model inside counts its replicated
        parameters once), not of this rank's shard -- ``torch.nn.utils.clip_grad_norm_`` on
        ``fsdp.parameters()`` would see only the shard. A collective over ``group`` (default: all
        ranks); see :func:`dtlib.parallel.clip.clip_grad_norm_`."""
        return clip_grad_norm_(self, max_norm, norm_type, group=group)

    # ---- inspection --------------------------------------------------------------------------
    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The full (fp32) state dict with the original names, on every rank (a collective);
        :meth:`load_full_state_dict` is its inverse."""
        values: dict[str, torch.Tensor] = {}
        for u in self.units:
            if not u.params:
                continue
            gathered = torch.empty(u.layout.padded_numel, dtype=u.shard.dtype, device=u.shard.device)
            all_gather_into(gathered, u.shard.detach(), self.process_group)
            for owners, view in zip(u.aliases, u.layout.full_views(u.layout.to_param_major(gathered))):
                for name, _, _ in owners:
                    values[name] = view.clone()
        # the rest is kept whole on every rank: buffers, replicated parameters, and frozen
        # parameters (requires_grad=False), which stay ordinary parameters of their modules
        replicated = dict(self.module.named_buffers(remove_duplicate=False))
        replicated.update(self.module.named_parameters(remove_duplicate=False))
        return {k: values[k] if k in values else replicated[k].detach().clone()
                for k in self._state_keys}

    def sharded_param_bytes(self) -> int:
        """Bytes of the persistent shards on this rank."""
        return sum(s.nbytes for s in self.flat_shards)

    def replicated_param_bytes(self) -> int:
        """Bytes of the trainable parameters kept whole (below ``persistence_threshold``)."""
        return sum(p.nbytes for p in self.replicated)

    def memory_stats(self) -> dict[str, int]:
        """Parameter memory on this rank: the shards, the replicated parameters, and the peak of
        gathered buffers alive at once (measured from their real allocation and release) since
        construction or reset."""
        persistent = self.sharded_param_bytes() + self.replicated_param_bytes()
        return {"sharded_param_bytes": self.sharded_param_bytes(),
                "replicated_param_bytes": self.replicated_param_bytes(),
                "peak_unsharded_bytes": self.peak_unsharded_bytes,
                "peak_param_bytes": persistent + self.peak_unsharded_bytes}

    def reset_peak(self) -> None:
        self.peak_unsharded_bytes = self._live_bytes
