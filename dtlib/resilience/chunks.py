"""Where each rank's values sit in the full model: the chunks a sharded checkpoint is made of.

A checkpoint stores every parameter (and its optimizer state) in its **full shape**, as chunks:
boxes of the full tensor, each written by one rank that holds it. Any other layout then reads its
own boxes back, whatever the saving split was -- DCP (``torch.distributed.checkpoint``) plans the
reads from the chunk lists, which is what makes a checkpoint *reshard*. This module says which
boxes a rank holds and hands DCP views into the tensors it trains:

* **replicated** (one process, DDP, the replicated parameters of TP): the whole tensor, one box at
  offset 0; DCP writes it once (its save plans drop the duplicates of the other replicas);
* **tensor parallelism** (:mod:`dtlib.parallel.tensor`): slabs along Megatron's
  ``partition_dim``, one per segment of a fused weight (Q/K/V rows, gate/up), at the rank's offset
  in the full tensor; a row-parallel slab is a strided view (columns), written as one chunk;
* **dim-0 rows** (:class:`~dtlib.parallel.FSDP`'s parameters and optimizer state, FSDP2's
  ``Shard(0)``): one box of whole rows at the rank's first row (``fsdp_shard`` on the parameter),
  of the TP-local tensor when FSDP shards a tensor-parallel slab further;
* **a flat shard** (:class:`~dtlib.parallel.ShardedOptimizer`'s optimizer state): a range of the
  flattened tensor, which can start and end mid-row, cut into at most a few boxes per dimension
  (:func:`boxes`: a partial row, whole rows, a partial row);
* **pipeline and expert parallelism**: the rank holds only some names (its stages, its experts).

DCP's own sharded types do not fit: a DTensor shard is regular (no mid-row cut), a ShardedTensor
(deprecated) must be contiguous and cover the tensor exactly once per save. :class:`Chunks`
implements DCP's ``_Checkpointable`` hooks (``__create_write_items__``, ``__create_chunk_list__``,
as DTensor does) and two small planners look the views up, so DCP's planning, deduplication and
resharding reads are used as they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["Segment", "Span", "Chunks", "boxes", "segments", "model_spans", "optimizer_spans",
           "state_dict", "inner", "SavePlanner", "LoadPlanner", "CPUStager"]


@dataclass(frozen=True)
class Segment:
    """Slab ``[local_start, local_start + length)`` along ``dim`` of a rank's tensor is slab
    ``[full_start, full_start + length)`` of the full tensor ``name`` (shape ``full_shape``)."""
    name: str
    dim: int
    local_start: int
    length: int
    full_start: int
    full_shape: tuple[int, ...]


@dataclass(frozen=True)
class Span:
    """Elements ``[lo, hi)`` of a rank's tensor of ``shape`` (flattened, made of ``segments``)
    are ``owner.reshape(-1)[owner_start : owner_start + hi - lo]``. ``owner`` is the tensor the
    optimizer steps: its state tensors have its shape, so the same span locates them too."""
    owner: torch.Tensor
    owner_start: int
    lo: int
    hi: int
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]


def segments(name: str, shape: tuple[int, ...], param: Any, tp: tuple[int, int]) -> tuple[Segment, ...]:
    """How a rank's tensor ``name`` of ``shape`` lies in the full model. Under tensor parallelism
    (``tp`` = (size, rank)) Megatron's attributes say it -- ``tensor_model_parallel`` and
    ``partition_dim`` -- with dtlib's ``split_sizes`` (fused segments, each split on its own) and
    ``full_names`` (a fused gate/up is two tensors of TinyGPT): rank r holds the r-th slab of each
    segment (see :class:`~dtlib.parallel.tensor.ColumnParallelLinear`)."""
    size, rank = tp
    if not getattr(param, "tensor_model_parallel", False) or size == 1:
        return (Segment(name, 0, 0, shape[0] if shape else 1, 0, shape),)
    dim = param.partition_dim
    local_sizes = param.split_sizes or [shape[dim]]
    full_names = getattr(param, "full_names", None)
    prefix, leaf = name.rsplit(".", 2)[0], name.rsplit(".", 1)[1]
    out = []
    local_start, full_start = 0, 0
    for i, n in enumerate(local_sizes):
        if full_names:  # its own tensor of the full model
            seg_name, seg_base, seg_total = f"{prefix}.{full_names[i]}.{leaf}", 0, n * size
        else:  # rows of the same fused tensor (Q, K, V)
            seg_name, seg_base, seg_total = name, full_start, sum(local_sizes) * size
        full_shape = shape[:dim] + (seg_total,) + shape[dim + 1:]
        out.append(Segment(seg_name, dim, local_start, n, seg_base + rank * n, full_shape))
        local_start += n
        full_start += n * size
    return tuple(out)


def boxes(lo: int, hi: int, shape: tuple[int, ...]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Elements ``[lo, hi)`` of a row-major tensor of ``shape`` as boxes ``(flat start, offsets,
    sizes)``, each contiguous in memory: the end of a row, whole rows, the start of a row
    (recursively in more dimensions). A flat shard is cut like this into chunks DCP can store."""
    if lo >= hi:
        return []
    if not shape:
        return [(0, (), ())]
    row_numel = math.prod(shape[1:])
    out = []
    row = lo // row_numel
    if lo % row_numel:  # the end of row `row`
        end = min(hi, (row + 1) * row_numel)
        for f, o, s in boxes(lo - row * row_numel, end - row * row_numel, shape[1:]):
            out.append((row * row_numel + f, (row, *o), (1, *s)))
        lo, row = end, row + 1
    whole = (hi - lo) // row_numel
    if whole:
        out.append((lo, (row, *[0] * (len(shape) - 1)), (whole, *shape[1:])))
        lo, row = lo + whole * row_numel, row + whole
    if lo < hi:  # the start of row `row`
        for f, o, s in boxes(0, hi - lo, shape[1:]):
            out.append((row * row_numel + f, (row, *o), (1, *s)))
    return out


def _view(t: torch.Tensor, start: int, sizes: tuple[int, ...], dim: int, a: int, n: int) -> torch.Tensor:
    box = t.reshape(-1)[start:start + math.prod(sizes)].view(sizes)
    return box.narrow(dim, a, n) if sizes else box


def _span_chunks(span: Span) -> list[tuple[str, tuple[int, ...], tuple[int, ...], Callable]]:
    """``(name, full shape, offsets in it, view of an owner-shaped tensor)`` for every chunk of ``span``."""
    out = []
    for f, offsets, sizes in boxes(span.lo, span.hi, span.shape):
        start = span.owner_start + f - span.lo
        for seg in span.segments:
            if not sizes:  # a 0-d tensor
                out.append((seg.name, (), (), partial(_view, start=start, sizes=(), dim=0, a=0, n=1)))
                continue
            d = seg.dim
            a = max(offsets[d], seg.local_start)
            b = min(offsets[d] + sizes[d], seg.local_start + seg.length)
            if a >= b:
                continue
            full_offsets = list(offsets)  # other dimensions are not split: local == full
            full_offsets[d] = seg.full_start + a - seg.local_start
            view = partial(_view, start=start, sizes=sizes, dim=d, a=a - offsets[d], n=b - a)
            out.append((seg.name, seg.full_shape, tuple(full_offsets), view))
    return out


class Chunks:
    """The boxes of one full tensor that this rank holds, as views into the tensors it trains.

    DCP's ``_Checkpointable`` hooks: saved as chunks of the full tensor (``size()`` is the full
    shape, which DCP checks against the checkpoint's), read back box by box."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = torch.Size(shape), dtype
        self.views: dict[tuple[int, ...], torch.Tensor] = {}

    def size(self) -> torch.Size:
        return self.shape

    def box(self, offsets: Any) -> torch.Tensor:
        return self.views[tuple(offsets)]

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size(o), v.shape),
                                                      properties, self.shape))
                for o, v in self.views.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), v.shape) for o, v in self.views.items()]

    def staged(self) -> "Chunks":
        """A copy of the values as they are now (an asynchronous save writes it later)."""
        copy = Chunks(self.shape, self.dtype)
        copy.views = {o: v.detach().to("cpu", copy=True) for o, v in self.views.items()}
        return copy


class SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the boxes of a :class:`Chunks`."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.box(index.offset) if isinstance(obj, Chunks) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which reads into the boxes (views) of a :class:`Chunks`."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up walks the state dict in place and replaces values of types it does not
        # know with None: set up the plain entries, then put the Chunks back (top-level keys);
        # byte entries are loaded into the caller's dict (DCP writes them into original_state_dict)
        mine = {k: v for k, v in state_dict.items() if isinstance(v, Chunks)}
        super().set_up_planner({k: v for k, v in state_dict.items() if k not in mine}, metadata, is_coordinator)
        self.original_state_dict = state_dict
        self.state_dict.update(mine)
        self.mappings.update({k: (k,) for k in mine})

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.box(index.offset) if isinstance(obj, Chunks) else super().lookup_tensor(index)


class CPUStager(AsyncStager):
    """Staging for ``dcp.async_save``: copy every value to CPU memory before returning, so training
    may change the originals while a background thread writes the copy (DCP's default stager does
    not know :class:`Chunks`)."""
    _synchronize_after_execute = False

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in state.items():
            if isinstance(value, Chunks):
                out[key] = value.staged()
            elif torch.is_tensor(value):
                out[key] = value.detach().to("cpu", copy=True)
            else:
                out[key] = value
        return out


# ---- spans of a model and of its optimizer ------------------------------------------------------
def inner(model: nn.Module) -> nn.Module:
    """The user's model inside dtlib's wrappers (DDP and FSDP keep it as ``.module``)."""
    from dtlib.parallel.ddp import _DataParallel
    from dtlib.parallel.fsdp import FSDP
    return model.module if isinstance(model, (_DataParallel, FSDP)) else model


def model_spans(model: nn.Module) -> list[Span]:
    """Every state-dict entry of ``model`` (every name of a tied tensor) as this rank holds it.

    A parameter sharded by :class:`~dtlib.parallel.FSDP` (wrapped or not: a pipeline stage's FSDP
    leaves the model's own parameters sharded) is rows ``[start, start + rows)`` of its full shape
    (``fsdp_shard``): one box of whole rows."""
    inner_model = inner(model)
    tp_state = getattr(inner_model, "tensor_parallel_state", None)
    tp = (tp_state.size, tp_state.rank) if tp_state is not None else (1, 0)
    spans: list[Span] = []
    for name, t in inner_model.state_dict(keep_vars=True).items():
        sharded = getattr(t, "fsdp_shard", None)
        if sharded is not None:  # dim-0 rows of the (TP-local) tensor: elements [lo, hi) of it
            shape, start = sharded
            row = math.prod(shape[1:])
            spans.append(Span(t, 0, start * row, (start + t.shape[0]) * row, tuple(shape),
                              segments(name, tuple(shape), t, tp)))
        else:
            shape = tuple(t.shape)
            spans.append(Span(t, 0, 0, t.numel(), shape, segments(name, shape, t, tp)))
    return spans


def optimizer_spans(optimizer: Any, spans: list[Span]) -> tuple[Any, list[Span]]:
    """The torch optimizer that holds the state, and the spans of its parameters' state."""
    from dtlib.parallel.zero import ShardedOptimizer
    by_owner: dict[int, list[Span]] = {}
    for s in spans:
        by_owner.setdefault(id(s.owner), []).append(s)
    if isinstance(optimizer, ShardedOptimizer):
        # the state lives on each bucket's flat shard: cut it at the parameters' boundaries
        out = []
        for b in optimizer.buckets:
            lo, hi = b.layout.shard_range(optimizer.rank)
            for p, off, n in zip(b.params, b.layout.offsets, b.layout.numels):
                start, end = max(lo, off), min(hi, off + n)
                if start >= end:
                    continue
                if id(p) not in by_owner:
                    raise ValueError("the ShardedOptimizer steps a tensor that is not one of the model's "
                                     "parameters: build it on model.parameters()")
                for s in by_owner[id(p)]:
                    out.append(Span(b.shard, start - lo, start - off, end - off, s.shape, s.segments))
        return optimizer.optim, out
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a dtlib ShardedOptimizer, "
                        f"got {type(optimizer).__name__}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [p for p in params if id(p) not in by_owner]
    if missing:
        raise ValueError(f"the optimizer steps {len(missing)} tensors that are not the model's "
                         "parameters: build it on model.parameters() (of the wrapper, for FSDP)")
    return optimizer, [s for p in params for s in by_owner[id(p)]]


def state_dict(spans: list[Span], optim: Any = None, optim_spans: list[Span] = ()) -> dict[str, Any]:
    """The DCP state dict of this rank: ``model.<name>`` and ``optim.<name>.<key>`` as
    :class:`Chunks` of the full tensors (views: loading writes into the model and optimizer)."""
    out: dict[str, Any] = {}

    def add(prefix: str, suffix: str, span: Span, tensor: torch.Tensor) -> None:
        for name, shape, offsets, view in _span_chunks(span):
            chunks = out.setdefault(f"{prefix}.{name}{suffix}", Chunks(shape, tensor.dtype))
            chunks.views[offsets] = view(tensor.detach())

    for s in spans:
        add("model", "", s, s.owner)
    if optim is not None:
        for s in optim_spans:
            for key, value in optim.state.get(s.owner, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == s.owner.shape:
                    add("optim", f".{key}", s, value)
                elif torch.is_tensor(value):  # a scalar such as Adam's step: equal on every rank
                    for seg in s.segments:
                        out[f"optim.{seg.name}.{key}"] = value
    return out
