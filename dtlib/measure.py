"""Measure what PyTorch really holds, to check :mod:`dtlib.memory` against reality.

* :func:`saved_activation_bytes` runs a forward pass under
  ``torch.autograd.graph.saved_tensors_hooks`` and adds up the storages autograd saves for
  backward, each storage once (views share one), leaving out the module's parameters and buffers.
* :func:`model_state_bytes_held` adds up the bytes of parameters, their ``.grad`` and the
  optimizer's state tensors.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

__all__ = ["saved_activation_bytes", "model_state_bytes_held"]


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
        for p, state in optimizer.state.items():
            for t in state.values():
                if torch.is_tensor(t):
                    key = "optimizer" if t.shape == p.shape else "optimizer_scalars"
                    out[key] += t.numel() * t.element_size()
    return out
