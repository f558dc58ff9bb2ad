"""A toy fully sharded data parallel (ZeRO stage 3): parameters live only as 1/N flat shards.

Follows Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel"
(VLDB), Sec. 3 (FlatParameter, sharding, the forward/backward all-gathers and the gradient
reduce-scatter) and Rajbhandari et al. 2020 (ZeRO, Sec. 5.3, stage 3 / P_os+g+p):

* the model is cut into *units*: each submodule whose type is in ``unit_types`` (e.g. the
  transformer block) and the root for everything else. A unit's parameters are flattened into one
  buffer padded to a multiple of N; rank r keeps shard r (fp32) - the only persistent copy;
* the model's own ``nn.Parameter`` objects stay, with their names, but each becomes a 1-D view of
  its part of this rank's flat shard (possibly empty), as PyTorch FSDP's ``use_orig_params=True``:
  ``FSDP.parameters()`` yields them, so the optimizer, its state and the gradients are all 1/N
  and per-parameter groups work (no weight decay for norms and biases, as nanoGPT's
  ``configure_optimizers``: build the groups before wrapping, while the shapes are the original
  ones, or by name);
* just before a unit's forward its shards are all-gathered (in ``compute_dtype`` if given) and
  the module's parameters are bound to views of the full buffer; right after its forward they are
  unbound and the buffer's storage is freed (resized to 0, as PyTorch FSDP's ``_free_storage``,
  so the memory goes at once even if the backend still holds the tensor object);
* tensors that autograd saves for backward and that are views of a gathered buffer are not kept:
  a ``saved_tensors_hooks`` pack hook replaces them by (unit, size, stride, offset), and the unpack
  hook all-gathers the unit *again* just before its backward needs it (the "all-gather before
  backward" of FSDP; PyTorch triggers it from a pre-backward hook, the unpack hook is where the
  need actually arises);
* when autograd has accumulated the gradient of a unit's whole buffer (the backward of the
  custom Function that produced it), that gradient is reduce-scattered asynchronously - each
  rank receives the average of its shard - and the buffer is freed again. At the end of the
  backward pass an autograd engine callback (``queue_callback``, as PyTorch FSDP's
  ``_post_backward_final_callback``) waits for them and accumulates each parameter's piece into
  its ``.grad``, so ``backward(); optimizer.step()`` is all a training loop needs;
  :meth:`FSDP.finish_gradient_synchronization` does the same and may still be called (a no-op then);
* activation checkpointing (non-reentrant ``torch.utils.checkpoint``) recomputes a forward
  during backward: there the units' hooks neither gather through the autograd Function nor free,
  they bind the (re-)gathered buffer, which stays until the unit's gradient is reduce-scattered -
  as FSDP2's hooks do nothing in forward while its state is ``PRE_BACKWARD``;
* checkpoints: :meth:`FSDP.gather_full_params` gives the full state dict (a collective),
  :meth:`FSDP.load_full_state_dict` loads one into the shards (every rank passes the full dict);
  the optimizer's ``state_dict()`` is per rank, over the local pieces.

Not done, to stay readable: prefetching the next unit's all-gather (PyTorch overlaps it), keeping
the root gathered between forward and backward, CPU offload, per-unit mixed precision settings,
reentrant activation checkpointing, and resharding a checkpoint's optimizer state to another
world size. Parameters with ``requires_grad=False`` stay ordinary, replicated parameters (not
sharded, not cast: with ``compute_dtype`` they must already have that dtype), and
:meth:`FSDP.gather_full_params` returns them with the rest.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from dtlib.parallel.buckets import FlatLayout, unique_parameters
from dtlib.parallel.collectives import all_gather_into, broadcast_coalesced, reduce_scatter_into

__all__ = ["FSDP"]


class _GatherParams(torch.autograd.Function):
    """shard -> full flat parameters (all-gather); its backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, unit: "_Unit") -> torch.Tensor:
        ctx.unit = unit
        return unit.gather()

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None]:
        # The shard's .grad is written by finish_gradient_synchronization once the async
        # reduce-scatter is done, so nothing flows back through autograd.
        ctx.unit.reduce_scatter_grad(grad_full)
        return None, None


class _Packed:
    """A saved tensor that was a view of a unit's gathered parameters, kept as a recipe."""
    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: "_Unit", t: torch.Tensor):
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class _Unit:
    """One FSDP unit: the flat shard of some parameters and where to bind them when gathered."""

    def __init__(self, owner: "FSDP", name: str, module: nn.Module, params: list[nn.Parameter],
                 aliases: list[list[tuple[str, nn.Module, str]]]):
        self.owner, self.name, self.module, self.aliases = owner, name, module, aliases
        if len({(p.dtype, p.device) for p in params}) > 1:
            raise ValueError(f"unit {name or '(root)'!r} mixes parameter dtypes/devices "
                             f"{sorted({(str(p.dtype), str(p.device)) for p in params})}: one flat "
                             "buffer holds one dtype; convert the model first (e.g. model.float())")
        self.params, self.layout = params, FlatLayout.of(params, owner.world_size)
        lo, hi = self.layout.shard_range(owner.rank)
        with torch.no_grad():
            # requires_grad only so that _GatherParams is recorded by autograd (its backward is
            # where the gradient is reduce-scattered); the shard itself never gets a .grad
            self.shard = self.layout.flatten([p.detach() for p in params])[lo:hi].clone().requires_grad_()
        # this rank's piece of each parameter: [start, end) inside the shard (empty if none)
        self.pieces = []
        for off, n in zip(self.layout.offsets, self.layout.numels):
            start, end = max(lo, off) - lo, min(hi, off + n) - lo
            self.pieces.append((start, end) if start < end else (0, 0))
        for p, (start, end) in zip(params, self.pieces):
            p.data = self.shard.detach()[start:end]  # same Parameter object, now a view of the shard
        self.full: torch.Tensor | None = None
        self.recompute_bound = False  # bound for a recomputation during backward
        self.pending: list[tuple[Any, torch.Tensor, torch.Tensor]] = []

    def gather(self) -> torch.Tensor:
        """All-gather the shards into a fresh full buffer (no autograd), if not already there."""
        if self.full is None:
            src = self.shard.detach().to(self.owner.compute_dtype or self.shard.dtype)
            full = torch.empty(self.layout.padded_numel, dtype=src.dtype, device=src.device)
            all_gather_into(full, src, self.owner.process_group)
            self.owner._allocated(full)
            self.full = full
        return self.full

    def bind(self, full: torch.Tensor) -> None:
        """Point the modules at views of the gathered buffer. Written into ``_parameters`` (as
        FSDP's use_orig_params swaps tensors for parameters) so the registration order is kept."""
        for owners, view in zip(self.aliases, self.layout.views(full)):
            for _, mod, attr in owners:  # a tied weight is bound in every owning module
                mod._parameters[attr] = view

    def bind_for_recompute(self) -> None:
        """Activation checkpointing recomputes a forward inside backward: bind the gathered
        buffer (re-gathered if freed) as a leaf that requires grad, so that the recomputation
        saves the same tensors as the forward did; its graph is only read, never differentiated
        (the forward's _GatherParams node gets the gradient), so no autograd Function here."""
        if not self.recompute_bound:
            self.bind(self.gather().detach().requires_grad_())
            self.recompute_bound = True

    def free(self) -> None:
        for p, owners in zip(self.params, self.aliases):
            for _, mod, attr in owners:
                mod._parameters[attr] = p  # the sharded parameter again
        self.recompute_bound = False
        if self.full is not None:
            # Release the memory now, whoever still holds the tensor object (e.g. the backend's
            # worker thread, for a moment after the collective): PyTorch FSDP's ``_free_storage``.
            # Safe because autograd keeps no views of it (the pack hook swapped them for recipes),
            # and a checkpointed recomputation's views are used up before the unit's reduce-scatter.
            self.owner._released(self.full.untyped_storage().nbytes())
            self.full.untyped_storage().resize_(0)
            self.full = None

    def reduce_scatter_grad(self, grad_full: torch.Tensor) -> None:
        grad = grad_full.contiguous() / self.owner.world_size  # average; divide first (fp16)
        received = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)
        work = reduce_scatter_into(received, grad, self.owner.process_group, async_op=True)
        self.pending.append((work, received, grad))  # keep grad alive until the work is done
        self.free()
        self.owner._finish_at_end_of_backward()

    def finish(self) -> None:
        """Wait for this unit's reduce-scatters; add each parameter's piece to its ``.grad``
        (accumulating like autograd, so any ``zero_grad`` - the model's or the optimizer's - works)."""
        for work, received, _ in self.pending:
            work.wait()
            grad = received.to(self.shard.dtype)
            for p, (start, end) in zip(self.params, self.pieces):
                if p.grad is None:
                    p.grad = grad[start:end]
                else:
                    p.grad += grad[start:end]
        self.pending = []

    # forward hooks on the unit's module
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _in_backward():
            self.bind_for_recompute()
        else:
            self.bind(_GatherParams.apply(self.shard, self))
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
            names but become 1-D views of this rank's flat shards (``FSDP.parameters()``), so
            the optimizer's groups can be built on the model before wrapping or on the wrapper.
        compute_dtype: gather parameters (and run forward/backward, and reduce gradients) in this
            dtype, e.g. ``torch.bfloat16``; the shards and the optimizer stay in fp32. Floating
            inputs of each unit are cast to it, and the output comes back in it.
        unit_types: submodule classes that become their own unit (gathered one at a time), like
            PyTorch's ``ModuleWrapPolicy``; everything else belongs to the root unit.
        process_group: the data-parallel group (default: all ranks).

    ``loss.backward(); optimizer.step()``: the gradients are synchronised at the end of
    backward. :meth:`gather_full_params` returns the full state dict, :meth:`load_full_state_dict`
    loads one.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None,
                 unit_types: Sequence[type[nn.Module]] = (), process_group: Any = None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype)
                                              and compute_dtype.is_floating_point):
            raise ValueError(f"compute_dtype must be a floating torch.dtype (e.g. torch.bfloat16) "
                             f"or None, got {compute_dtype!r}")
        if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in unit_types):
            raise TypeError(f"unit_types must be nn.Module subclasses, got {unit_types!r}")
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
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._state_keys = list(module.state_dict().keys())
        broadcast_coalesced(unique_parameters([*module.parameters(), *module.buffers()]), 0,
                            process_group)
        self.peak_unsharded_bytes = 0
        self._live_bytes = 0

        self._finish_queued = False
        self.units = self._make_units(module, tuple(unit_types))
        for u in self.units:
            u.module.register_forward_pre_hook(u.pre_forward, with_kwargs=True)
            u.module.register_forward_hook(u.post_forward)
            inner = {id(mod): mod for owners in u.aliases for _, mod, _ in owners}
            for mod in inner.values():
                if mod is not u.module:
                    mod.register_forward_pre_hook(u.pre_forward_inner)

    @property
    def flat_shards(self) -> list[torch.Tensor]:
        """This rank's flat shard of each unit (the parameters are views into them)."""
        return [u.shard for u in self.units]

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
                aliases = [[(f"{pth}.{a}" if pth else a, m, a) for pth, m, a in owners[pid]]
                           for pid in members[u]]
                out.append(_Unit(self, u, modules[u], [params[pid] for pid in members[u]], aliases))
        return out

    # ---- forward / backward ----------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

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

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient reduce-scatters; accumulate them into the parameters' ``.grad``.

        Runs by itself at the end of every backward; calling it again is a no-op."""
        self._finish_queued = False
        for u in self.units:
            u.finish()

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a full state dict (what :meth:`gather_full_params` or the unwrapped model's
        ``state_dict()`` gives, on every rank): each rank copies its shard, in place, so the
        parameters (views of it) and an optimizer built on them stay valid. No communication."""
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
            lo, hi = u.layout.shard_range(self.rank)
            u.shard.copy_(u.layout.flatten_range(tensors, lo, hi))
        # the rest is replicated: buffers and frozen parameters, copied whole
        replicated = dict(self.module.named_buffers(remove_duplicate=False))
        replicated.update(self.module.named_parameters(remove_duplicate=False))
        for name in self._state_keys:
            if name not in sharded:
                replicated[name].copy_(state_dict[name])

    # ---- inspection --------------------------------------------------------------------------
    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """The full (fp32) state dict with the original names, on every rank (a collective);
        :meth:`load_full_state_dict` is its inverse."""
        values: dict[str, torch.Tensor] = {}
        for u in self.units:
            full = torch.empty(u.layout.padded_numel, dtype=u.shard.dtype, device=u.shard.device)
            all_gather_into(full, u.shard.detach(), self.process_group)
            for owners, view in zip(u.aliases, u.layout.views(full)):
                for name, _, _ in owners:
                    values[name] = view.clone()
        # the rest is replicated and kept whole on every rank: buffers, and frozen parameters
        # (requires_grad=False), which stay ordinary parameters of their modules
        replicated = dict(self.module.named_buffers(remove_duplicate=False))
        replicated.update(self.module.named_parameters(remove_duplicate=False))
        return {k: values[k] if k in values else replicated[k].detach().clone()
                for k in self._state_keys}

    def sharded_param_bytes(self) -> int:
        """Bytes of the persistent shards on this rank."""
        return sum(u.shard.nbytes for u in self.units)

    def memory_stats(self) -> dict[str, int]:
        """Parameter memory on this rank: the shards, and the peak of gathered buffers alive at
        once (measured from their real allocation and release) since construction or reset."""
        return {"sharded_param_bytes": self.sharded_param_bytes(),
                "peak_unsharded_bytes": self.peak_unsharded_bytes,
                "peak_param_bytes": self.sharded_param_bytes() + self.peak_unsharded_bytes}

    def reset_peak(self) -> None:
        self.peak_unsharded_bytes = self._live_bytes
