"""Measure what PyTorch really holds, to check :mod:`dtlib.analytic.memory` against reality.

* :func:`saved_activation_bytes` runs a forward pass under
  ``torch.autograd.graph.saved_tensors_hooks`` and adds up the storages autograd saves for
  backward, each storage once (views share one), leaving out the module's parameters and buffers.
* :func:`model_state_bytes_held` adds up the bytes of parameters, their ``.grad`` and the
  optimizer's state tensors (:func:`optimizer_state_bytes`).
* :class:`CollectiveCounter` counts the collectives a block of code issues, and their bytes.
* :func:`measure_cpu` measures this machine's matmul peak and main-memory bandwidth, as an
  :class:`~dtlib.analytic.hardware.Accelerator` for the analytic model.
"""
from __future__ import annotations

from dtlib.extras import require

require("course", "torch", feature=__name__)

import glob
import os
import platform
import time
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dtlib.analytic import validate
from dtlib.analytic.hardware import Accelerator

__all__ = ["saved_activation_bytes", "model_state_bytes_held", "optimizer_state_bytes", "CollectiveCounter",
           "measure_cpu"]


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


MIN_COPY_BYTES = 256 * 2 ** 20  # far beyond any L2 and most L3 caches
MAX_COPY_BYTES = 2 ** 30        # bounds memory (two buffers) and time (~0.2 s a copy at 10 GB/s)


def _l3_bytes(cache_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """Size of the L3 cache that CPU 0 sees (Linux sysfs), or None where it cannot be read."""
    for index in sorted(glob.glob(f"{cache_dir}/index*")):
        try:
            with open(f"{index}/level") as f:
                if f.read().strip() != "3":
                    continue
            with open(f"{index}/size") as f:
                text = f.read().strip().upper()
        except OSError:
            return None
        scale = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        return int(digits) * scale if digits.isdigit() else None
    return None


def measure_cpu(n: int = 512, repeats: int = 5, name: str = "cpu-local",
                copy_bytes: int | None = None) -> Accelerator:
    """Measure this machine's fp32 matmul throughput (best of ``repeats``; 2n^3 FLOPs per n x n
    matmul) and its *main-memory* copy bandwidth, and describe it as an
    :class:`~dtlib.analytic.hardware.Accelerator`.

    The copy moves ``copy_bytes`` (default: 4 x the L3 cache read from sysfs, at least 256 MiB and
    at most 1 GiB) from one preallocated, already-touched buffer to another, so neither a cache nor
    page faults are timed; bandwidth counts the bytes read plus the bytes written, as the STREAM
    "Copy" kernel does (McCalpin 1995). torch runs the copy on all its threads. About 0.3 s with
    the default 256 MiB on a 2-core machine.
    """
    validate.integer("n", n, minimum=16)
    validate.integer("repeats", repeats)
    l3 = _l3_bytes()
    if copy_bytes is None:
        copy_bytes = min(max(MIN_COPY_BYTES, 4 * (l3 or 0)), MAX_COPY_BYTES)
    # at least 1 MiB (the default, 4 x L3 and >= 256 MiB, makes the copy leave the caches)
    validate.integer("copy_bytes", copy_bytes, minimum=2 ** 20)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up (thread pool, caches)
    best = min(_timed(lambda: a @ b) for _ in range(repeats))
    flops = 2 * n ** 3 / best
    src = torch.ones(copy_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touches every page of dst, so the timed copies take no page faults
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    bandwidth = 2 * src.nbytes / copy  # read + write
    del src, dst
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    peaks = {"fp32": flops, "tf32": None, "bf16": None, "fp16": None, "fp8": None}
    cache = f"L3 {l3 / 2 ** 20:g} MiB" if l3 else "L3 size unknown"
    src_text = (f"measured by dtlib.measure.measure_cpu on {platform.node() or 'this machine'} "
                f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads): "
                f"torch fp32 {n}x{n} matmul, best of {repeats}; memory bandwidth from a "
                f"{copy_bytes / 2 ** 20:g} MiB torch copy ({cache}; read + write counted, STREAM "
                f"Copy convention), best of {repeats}")
    return Accelerator(name, peaks, int(mem), bandwidth, src_text)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)
