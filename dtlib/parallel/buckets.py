"""Flat buffers and buckets: the bookkeeping that DDP, ZeRO and FSDP share.

Every member of the data-parallel family moves *flat* buffers rather than one tensor per
parameter, because a collective has a fixed start-up cost (the alpha of the alpha-beta model):
PyTorch DDP packs gradients into ~25 MB buckets (Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", VLDB, Sec. 3.2.3), DeepSpeed ZeRO and FSDP
flatten parameters into one buffer per unit and shard it evenly (Rajbhandari et al. 2020;
Zhao et al. 2023, "PyTorch FSDP", Sec. 3.2 "FlatParameter").

This module holds the pieces they all need:

* :func:`assign_buckets` - group tensors, in a given order, into buckets that close once they
  hold ~cap bytes (the rule of ``torch.distributed``'s ``_compute_bucket_assignment_by_size``);
* :class:`FlatLayout` - where each tensor lives inside a flat buffer, the padding that makes the
  buffer divisible by the number of shards, and the bounds of each shard;
* :class:`Dim0Layout` - FSDP2's per-parameter sharding: every tensor cut on dim 0 into ``n``
  ``torch.chunk``-style pieces (padded), one flat shard per rank made of its pieces;
* :func:`shard_bounds` - an uneven split into ``n`` near-equal chunks (for collectives on sizes
  that are not divisible by the world size);
* :func:`register_grad_ready_hooks` and :class:`InOrderLauncher` - know when a bucket's last
  gradient is ready during backward, and launch buckets in the same order on every rank.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from dtlib.analytic import validate

__all__ = ["assign_buckets", "shard_bounds", "FlatLayout", "Dim0Layout", "unique_parameters",
           "InOrderLauncher", "register_grad_ready_hooks"]

# PyTorch's bucket_cap_mb is in MiB ("MB" in its docs); so is our bucket_size_mb.


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each of ``world_size`` chunks of ``numel`` elements.

    Sizes differ by at most one and the larger chunks come first, exactly like
    ``torch.tensor_split`` - so any rank can compute every other rank's chunk without talking.
    """
    validate.integer("world_size", world_size)
    validate.integer("numel", numel, minimum=0)
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def assign_buckets(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Group ``tensors`` (in the order given) into buckets; return lists of indices into ``tensors``.

    A bucket is closed as soon as it holds at least ``cap_bytes`` (so its last tensor may take it
    over the cap, and ``cap_bytes=0`` gives one bucket per tensor). Tensors of a
    different dtype or device go into a separate open bucket, because a bucket is one flat
    buffer and a collective moves a single dtype. This is ``torch.distributed``'s rule
    (``_compute_bucket_assignment_by_size``), so bucket counts can be compared with PyTorch's.
    Buckets are sorted by their first tensor - for gradients given in reverse order of use,
    that is the order in which they become ready.
    """
    if cap_bytes < 0:
        raise ValueError(f"cap_bytes must be >= 0, got {cap_bytes}")
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        idx, size = open_buckets.get(key, ([], 0))
        idx.append(i)
        size += t.numel() * t.element_size()
        if size >= cap_bytes:
            closed.append(idx)
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (idx, size)
    closed.extend(idx for idx, _ in open_buckets.values())
    # ordered by first member, so that (for tensors given in ready order) buckets become ready
    # one after the other - the order in which they must be launched
    return sorted(closed, key=lambda b: b[0])


def unique_parameters(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """``params`` without repeats (tied weights appear once), order of first appearance kept."""
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


@dataclass(frozen=True)
class FlatLayout:
    """How ``len(shapes)`` tensors are packed, in order, into one flat buffer split into shards.

    ``padded_numel`` rounds the total up to a multiple of ``world_size`` so that every shard has
    exactly ``shard_numel`` elements: equal shards are what ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` need (FSDP pads its FlatParameter the same way, Zhao et al. 2023).
    """

    shapes: tuple[torch.Size, ...]
    world_size: int = 1

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s shard inside the padded flat buffer."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], world_size: int = 1) -> "FlatLayout":
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        return cls(tuple(t.shape for t in tensors), world_size)

    def flatten(self, tensors: Sequence[torch.Tensor | None], out: torch.Tensor | None = None,
                dtype: torch.dtype | None = None, device: torch.device | None = None) -> torch.Tensor:
        """Copy ``tensors`` into one flat (padded) buffer; a ``None`` entry is written as zeros."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"layout has {len(self.shapes)} tensors, got {len(tensors)}")
        if out is None:
            ref = next((t for t in tensors if t is not None), None)
            if ref is None and (dtype is None or device is None):
                raise ValueError("all tensors are None: pass dtype and device")
            out = torch.empty(self.padded_numel, dtype=dtype or ref.dtype,
                              device=device or ref.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            if t is None:
                out[off:off + n].zero_()
            else:
                out[off:off + n].copy_(t.reshape(-1))
        out[self.numel:].zero_()  # padding must be zero: it is summed by reduce-scatters
        return out

    def flatten_range(self, tensors: Sequence[torch.Tensor | None], lo: int, hi: int,
                      dtype: torch.dtype | None = None,
                      device: torch.device | None = None) -> torch.Tensor:
        """Elements ``[lo, hi)`` of what :meth:`flatten` returns, without building the rest (a
        rank's shard of the flat gradients costs a shard of memory, not a whole bucket)."""
        if not 0 <= lo <= hi <= self.padded_numel:
            raise ValueError(f"need 0 <= lo <= hi <= {self.padded_numel}, got [{lo}, {hi})")
        if len(tensors) != len(self.shapes):
            raise ValueError(f"layout has {len(self.shapes)} tensors, got {len(tensors)}")
        ref = next((t for t in tensors if t is not None), None)
        if ref is None and (dtype is None or device is None):
            raise ValueError("all tensors are None: pass dtype and device")
        out = torch.zeros(hi - lo, dtype=dtype or ref.dtype, device=device or ref.device)
        for t, off, n in zip(tensors, self.offsets, self.numels):
            a, b = max(lo, off), min(hi, off + n)
            if t is not None and a < b:
                out[a - lo:b - lo].copy_(t.reshape(-1)[a - off:b - off])
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the original tensors (no copy).

        One ``torch.split`` instead of a slice per tensor: under autograd its backward is a
        single concatenation, not one zero-filled full-size buffer per tensor.
        """
        if flat.dim() != 1 or flat.numel() < self.numel:
            raise ValueError(f"need a 1-D buffer of >= {self.numel} elements, got {tuple(flat.shape)}")
        pieces = torch.split(flat, [*self.numels, flat.numel() - self.numel])
        return [piece.view(shape) for piece, shape in zip(pieces, self.shapes)]


@dataclass(frozen=True)
class Dim0Layout:
    """Tensors sharded on dim 0 over ``world_size`` ranks, each rank's pieces packed into one flat shard.

    PyTorch FSDP2's layout (``fully_shard``: every parameter a DTensor with placement ``Shard(0)``,
    per-parameter sharding RFC, pytorch/pytorch#114299): tensor ``i`` of shape ``(R, *rest)`` is cut
    like ``torch.chunk`` into pieces of ``c = ceil(R / N)`` rows, so rank ``r`` holds rows
    ``[r c, min((r + 1) c, R))`` - the last ranks may hold fewer, possibly 0 rows - and a piece
    keeps the tensor's number of dimensions. Each piece is padded to ``c`` rows and rank ``r``'s
    flat shard is its padded pieces one after the other: ``shard_numel`` elements on every rank,
    what ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` need, so a unit still costs one
    collective. The all-gather output is therefore *rank-major*; :meth:`to_param_major` copies it
    into the unsharded buffer in which each tensor's padded rows are contiguous (so the tensors
    are views of it: FSDP2's ``foreach_all_gather_copy_out``), and :meth:`to_rank_major` is the
    inverse for gradients before the reduce-scatter (FSDP2's ``chunk_cat``). Tensors need >= 1
    dimension.
    """

    shapes: tuple[torch.Size, ...]
    world_size: int = 1

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], world_size: int = 1) -> "Dim0Layout":
        validate.integer("world_size", world_size)
        scalars = [i for i, t in enumerate(tensors) if t.dim() == 0]
        if scalars:
            raise ValueError(f"tensors {scalars} are 0-d: only tensors with >= 1 dimension are "
                             "sharded on dim 0")
        return cls(tuple(t.shape for t in tensors), world_size)

    @property
    def chunk_rows(self) -> tuple[int, ...]:
        """Rows per piece, ``ceil(R / N)``, the padded size on every rank."""
        return tuple(-(-s[0] // self.world_size) for s in self.shapes)

    @property
    def row_numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s[1:]).numel()) for s in self.shapes)

    @property
    def widths(self) -> tuple[int, ...]:
        """Elements of each tensor's padded piece in a shard."""
        return tuple(c * n for c, n in zip(self.chunk_rows, self.row_numels))

    @property
    def shard_offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for w in self.widths:
            out.append(acc)
            acc += w
        return tuple(out)

    @property
    def shard_numel(self) -> int:
        return sum(self.widths)

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    def rows(self, i: int, rank: int) -> tuple[int, int]:
        """``[start, end)``: the rows of tensor ``i`` that rank ``rank`` holds (maybe empty)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        c, total = self.chunk_rows[i], self.shapes[i][0]
        return min(rank * c, total), min((rank + 1) * c, total)

    def shard_views(self, shard: torch.Tensor, rank: int) -> list[torch.Tensor]:
        """Views of a flat shard (or of a gradient shaped like one): rank ``rank``'s piece of each
        tensor, ``(rows, *rest)`` without the padding."""
        if shard.dim() != 1 or shard.numel() != self.shard_numel:
            raise ValueError(f"need a 1-D shard of {self.shard_numel} elements, got {tuple(shard.shape)}")
        out = []
        for i, (off, n, shape) in enumerate(zip(self.shard_offsets, self.row_numels, self.shapes)):
            start, end = self.rows(i, rank)
            out.append(shard[off:off + (end - start) * n].view(end - start, *shape[1:]))
        return out

    def full_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of a param-major unsharded buffer shaped like the tensors (no copy): one
        ``torch.split`` (padding pieces dropped), whose backward is a single concatenation."""
        if full.dim() != 1 or full.numel() != self.padded_numel:
            raise ValueError(f"need a 1-D buffer of {self.padded_numel} elements, got {tuple(full.shape)}")
        sizes = []
        for shape, w in zip(self.shapes, self.widths):
            n = int(torch.Size(shape).numel())
            sizes += [n, self.world_size * w - n]
        pieces = torch.split(full, sizes)
        return [pieces[2 * i].view(shape) for i, shape in enumerate(self.shapes)]

    def to_param_major(self, gathered: torch.Tensor) -> torch.Tensor:
        """The all-gather output (rank 0's shard, rank 1's, ...) as a new param-major buffer."""
        out = torch.empty_like(gathered)
        ranks = gathered.view(self.world_size, self.shard_numel)
        for off, w in zip(self.shard_offsets, self.widths):
            out[self.world_size * off:self.world_size * (off + w)].view(self.world_size, w).copy_(
                ranks[:, off:off + w])
        return out

    def to_rank_major(self, full: torch.Tensor) -> torch.Tensor:
        """A param-major buffer (e.g. its gradient) as a new rank-major one, ready to reduce-scatter."""
        n = self.world_size
        pieces = [full[n * off:n * (off + w)].view(n, w) for off, w in zip(self.shard_offsets, self.widths)]
        return torch.cat(pieces, dim=1).reshape(-1) if pieces else full.new_empty(0)

    def shard_of(self, tensors: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
        """Rank ``rank``'s flat shard of full ``tensors`` (a new buffer; padding zero)."""
        if len(tensors) != len(self.shapes):
            raise ValueError(f"layout has {len(self.shapes)} tensors, got {len(tensors)}")
        ref = tensors[0]
        out = torch.zeros(self.shard_numel, dtype=ref.dtype, device=ref.device)
        for i, (t, piece) in enumerate(zip(tensors, self.shard_views(out, rank))):
            start, end = self.rows(i, rank)
            piece.copy_(t[start:end])
        return out


class InOrderLauncher:
    """Counts the tensors that arrive in each bucket and launches complete buckets *in order*.

    Bucket ``i`` is launched only after buckets ``0..i-1``: collectives are matched by the order
    in which ranks issue them, so every rank must issue them in the same order even if its
    autograd happens to finish the buckets in another (PyTorch's Reducer does the same).
    """

    def __init__(self, sizes: Sequence[int], launch: Callable[[int], None]):
        if any(s < 1 for s in sizes):
            raise ValueError(f"every bucket needs at least one tensor, got sizes {list(sizes)}")
        self.sizes, self.launch = list(sizes), launch
        self.reset()

    def reset(self) -> None:
        self.pending = list(self.sizes)
        self.next = 0

    def arrive(self, bucket: int) -> bool:
        """One more tensor of ``bucket`` is ready; returns True if that completed the bucket."""
        if self.pending[bucket] <= 0:
            raise RuntimeError(f"bucket {bucket} received more tensors than it holds")
        self.pending[bucket] -= 1
        while self.next < len(self.sizes) and self.pending[self.next] == 0:
            self.next += 1
            self.launch(self.next - 1)
        return self.pending[bucket] == 0

    @property
    def all_launched(self) -> bool:
        return self.next == len(self.sizes)


def register_grad_ready_hooks(params: Sequence[torch.Tensor], owner: object,
                              method: str) -> list[torch.utils.hooks.RemovableHandle]:
    """Call ``owner.<method>(p)`` each time ``p.grad`` has been fully accumulated in a backward.

    ``register_post_accumulate_grad_hook`` fires after the gradient of a leaf is final for this
    backward (once per backward even for a tied weight used twice). The owner is held weakly so
    that a dropped wrapper does not stay alive through its parameters' hooks.
    """
    ref = weakref.ref(owner)

    def hook(p: torch.Tensor) -> None:
        target = ref()
        if target is not None:
            getattr(target, method)(p)

    return [p.register_post_accumulate_grad_hook(hook) for p in params]
