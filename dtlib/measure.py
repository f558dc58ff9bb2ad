"""Measure what PyTorch really holds, to check :mod:`dtlib.analytic.memory` against reality.

* :func:`saved_activation_bytes` runs a forward pass under
  ``torch.autograd.graph.saved_tensors_hooks`` and adds up the storages autograd saves for
  backward, each storage once (views share one), leaving out the module's parameters and buffers.
* :func:`model_state_bytes_held` adds up the bytes of parameters, their ``.grad`` and the
  optimizer's state tensors (:func:`optimizer_state_bytes`).
* :class:`CollectiveCounter` counts the collectives a block of code issues, and their bytes.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["saved_activation_bytes", "model_state_bytes_held", "optimizer_state_bytes", "CollectiveCounter"]


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def saved_activation_bytes(model: nn.Module, fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn()`` (a forward pass, loss included if wanted) and return ``{"bytes", "tensors",
    "result"}``: bytes of distinct storages saved for backward, excluding ``model``'s own tensors.
    Keep ``result`` alive if you want to call backward afterwards."""
    own = {_storage_key(t)[0] for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in own:
            seen[ptr] = max(seen.get(ptr, 0), nbytes)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return {"bytes": sum(seen.values()), "tensors": len(seen), "result": result}


def model_state_bytes_held(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state tensors (shared parameters once).

    ``optimizer`` splits into ``optimizer`` (state tensors shaped like a parameter: Adam's moments,
    momentum buffers) and ``optimizer_scalars`` (per-tensor scalars such as Adam's ``step``,
    4 bytes per parameter *tensor*, which per-parameter formulas leave out)."""
    params = list(model.parameters())  # deduplicated: tied weights appear once
    out = {"parameters": sum(p.numel() * p.element_size() for p in params),
           "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
           "optimizer": 0, "optimizer_scalars": 0}
    if optimizer is not None:
        out.update(optimizer_state_bytes(optimizer))
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of an optimizer's state tensors: ``optimizer`` (shaped like their parameter: Adam's
    moments, momentum buffers) and ``optimizer_scalars`` (per-tensor scalars such as Adam's
    ``step``, which per-parameter formulas leave out)."""
    out = {"optimizer": 0, "optimizer_scalars": 0}
    for p, state in optimizer.state.items():
        for t in state.values():
            if torch.is_tensor(t):
                key = "optimizer" if t.shape == p.shape else "optimizer_scalars"
                out[key] += t.numel() * t.element_size()
    return out


# c10d op -> (collective, index of the argument that holds S, the buffer size nccl-tests reports:
# the all-gather's output, the reduce-scatter's input, the tensor itself otherwise).
_C10D_OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0), "reduce_": ("reduce", 0), "gather_": ("gather", 1),
    "scatter_": ("scatter", 0), "send": ("send", 0), "recv_": ("recv", 0),
    "recv_any_source_": ("recv", 0), "barrier": ("barrier", None),
}


def _tensor_bytes(obj: Any) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(o) for o in obj)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Records every collective and point-to-point call issued inside the block, with its bytes.

    A dispatch mode over the ``c10d`` operators, the layer every ``torch.distributed`` call goes
    through (the same mechanism as PyTorch's ``CommDebugMode``, which counts only collectives):
    direct calls, ``async_op=True``, ``batch_isend_irecv`` and calls made inside PyTorch are all
    seen, and nothing in ``torch.distributed`` is patched. ``calls`` is a list of
    ``(name, bytes)`` with torch's names (``all_reduce``, ``all_gather``, ``send``, ...)::

        with CollectiveCounter() as counter:
            model(x).sum().backward()
        counter.counts["all_reduce"], counter.bytes("send")
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        op = _C10D_OPS.get(func._schema.name.split("::")[-1]) if func.namespace == "c10d" else None
        if op is not None:
            name, arg = op
            self.calls.append((name, 0 if arg is None else _tensor_bytes(args[arg])))
        return func(*args, **(kwargs or {}))

    @property
    def counts(self) -> Counter:
        """How many times each collective was called."""
        return Counter(name for name, _ in self.calls)

    def bytes(self, name: str) -> int:
        """Total bytes of the buffers passed to ``name`` (e.g. ``"send"``: bytes sent)."""
        return sum(n for c, n in self.calls if c == name)
