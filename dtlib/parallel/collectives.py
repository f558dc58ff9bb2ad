"""Collectives built from point-to-point messages: ring reduce-scatter, all-gather, all-reduce.

The ring algorithm (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters
of workstations"; the algorithm NCCL and Horovod use for large messages): split the buffer into
``n`` chunks, and pass chunks around a ring ``0 -> 1 -> ... -> n-1 -> 0``.

* reduce-scatter: ``n - 1`` steps; at each step every rank sends one chunk to its right
  neighbour and adds the chunk it receives from its left neighbour into its own copy. After the
  last step rank ``r`` holds chunk ``r`` reduced over all ranks.
* all-gather: ``n - 1`` more steps passing the finished chunks around.
* all-reduce = reduce-scatter + all-gather: each rank sends ``2 (n - 1) / n`` of the buffer,
  independent of ``n`` for large ``n`` - why the ring is bandwidth-optimal.

:func:`ring_schedule` is the single source of truth for who sends which chunk when: the
collectives below execute it and :mod:`dtlib.viz.ring` draws it.

:func:`hierarchical_all_reduce` is the two-level scheme used across nodes (e.g. Jia et al. 2018,
"Highly Scalable Deep Learning Training System with Mixed-Precision", Sec. 3.3; NCCL's tree/ring
split): reduce-scatter inside each node over the fast link, all-reduce the 1/node_size shard
across nodes over the slow link, all-gather inside the node.

Chunks need not be equal: :func:`~dtlib.parallel.buckets.shard_bounds` splits any size into
near-equal chunks (so sizes not divisible by the world size, and even sizes < world size, work).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from dtlib.analytic import validate
from dtlib.parallel.buckets import shard_bounds

__all__ = ["ring_schedule", "ring_progress", "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce",
           "hierarchical_all_reduce", "node_groups", "broadcast_coalesced", "all_gather_into",
           "reduce_scatter_into", "all_reduce_coalesced"]

Step = list[tuple[int, int, int]]  # (sender, receiver, chunk index) for every rank in one step

# in-place combine(acc, incoming) for each reduction; AVG is SUM followed by a division
_COMBINE: dict[object, Callable[[torch.Tensor, torch.Tensor], object]] = {
    dist.ReduceOp.SUM: lambda acc, x: acc.add_(x),
    dist.ReduceOp.AVG: lambda acc, x: acc.add_(x),
    dist.ReduceOp.PRODUCT: lambda acc, x: acc.mul_(x),
    dist.ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    dist.ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
}


def ring_schedule(world_size: int, phase: str) -> list[Step]:
    """Who sends which chunk to whom at each step of the ring.

    ``phase="reduce_scatter"``: at step ``s`` rank ``r`` sends chunk ``(r - s - 1) mod n`` to
    ``r + 1``; after ``n - 1`` steps rank ``r`` owns the reduced chunk ``r``.
    ``phase="all_gather"``: rank ``r`` starts with chunk ``r`` and at step ``s`` forwards chunk
    ``(r - s) mod n``.
    """
    n = validate.integer("world_size", world_size)
    shift = {"reduce_scatter": 1, "all_gather": 0}
    validate.one_of("phase", phase, shift)
    return [[(r, (r + 1) % n, (r - s - shift[phase]) % n) for r in range(n)] for s in range(n - 1)]


def ring_progress(world_size: int, steps: int) -> list[list[frozenset[int]]]:
    """Which ranks' inputs each rank's copy of each chunk holds after ``steps`` steps of a ring
    all-reduce (reduce-scatter steps first, then all-gather): ``out[rank][chunk]``.

    Replays :func:`ring_schedule`, so a drawing of it shows what the code does. After
    ``n - 1`` steps chunk ``r`` of rank ``r`` holds all ``n`` inputs; after ``2 (n - 1)`` all do.
    """
    n = validate.integer("world_size", world_size)
    validate.integer("steps", steps, minimum=0, maximum=2 * (n - 1))  # reduce-scatter + all-gather
    held = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    plan = ring_schedule(n, "reduce_scatter") + ring_schedule(n, "all_gather")
    for s, step in enumerate(plan[:steps]):
        sent = [(dst, chunk, held[src][chunk]) for src, dst, chunk in step]  # simultaneous
        for dst, chunk, contrib in sent:
            # reduce-scatter adds the incoming partial sum; all-gather overwrites with the result
            held[dst][chunk] = held[dst][chunk] | contrib if s < n - 1 else contrib
    return held


def _check(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if op not in _COMBINE:
        raise ValueError(f"op must be one of dist.ReduceOp.SUM, AVG, PRODUCT, MAX, MIN; got {op}")
    if op == dist.ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}")
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(f"rank {dist.get_rank()} is not a member of this group: only the ranks "
                         "passed to dist.new_group may call its collectives")
    backend = dist.get_backend(group)
    if backend == "nccl" and tensor.device.type != "cuda":
        raise ValueError(f"the NCCL backend needs CUDA tensors, got one on {tensor.device}; "
                         "move it with .to(dtlib.launcher.get_device())")
    if backend == "gloo" and tensor.device.type != "cpu":
        raise ValueError(f"gloo point-to-point needs CPU tensors, got one on {tensor.device}; "
                         "use backend='nccl' for GPU tensors or move it to the CPU")


def _peer(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """Global rank of ``group_rank`` (send/recv address peers by global rank)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
              group: dist.ProcessGroup | None) -> None:
    """Send to ``dst`` while receiving from ``src``; both non-blocking, so the ring cannot
    deadlock (every rank sends before it waits). Empty chunks are skipped on both sides: the
    sender and the receiver compute the same chunk sizes."""
    works = []
    if send.numel():
        works.append(dist.isend(send, _peer(group, dst), group=group))
    if recv.numel():
        works.append(dist.irecv(recv, _peer(group, src), group=group))
    for w in works:
        w.wait()


_WORKSPACE: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _workspace(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable receive buffer: a fresh large CPU allocation is zero-filled by the OS page by
    page on first touch, which for big messages costs as much as the transfer itself."""
    key = (like.dtype, like.device)
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = _WORKSPACE[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def _ring_reduce_scatter_(flat: torch.Tensor, op: dist.ReduceOp,
                          group: dist.ProcessGroup | None) -> None:
    """In place on a contiguous 1-D buffer: afterwards this rank's chunk holds the reduction."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = shard_bounds(flat.numel(), n)
    incoming = _workspace(max(e - s for s, e in bounds), flat)
    for step in ring_schedule(n, "reduce_scatter"):
        _, right, send_c = step[rank]
        left, _, recv_c = step[(rank - 1) % n]
        (s0, s1), (r0, r1) = bounds[send_c], bounds[recv_c]
        buf = incoming[:r1 - r0]
        _exchange(flat[s0:s1], right, buf, left, group)
        _COMBINE[op](flat[r0:r1], buf)


def _ring_all_gather_(flat: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """In place on a contiguous 1-D buffer whose chunk ``rank`` is filled: fill all the others."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = shard_bounds(flat.numel(), n)
    for step in ring_schedule(n, "all_gather"):
        _, right, send_c = step[rank]
        left, _, recv_c = step[(rank - 1) % n]
        (s0, s1), (r0, r1) = bounds[send_c], bounds[recv_c]
        _exchange(flat[s0:s1], right, flat[r0:r1], left, group)  # received straight into place


def ring_reduce_scatter(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over ranks and return this rank's chunk of the flattened result.

    The chunk is ``flat[start:end]`` with ``(start, end) = shard_bounds(tensor.numel(), n)[rank]``
    (a 1-D tensor; sizes differ by at most one). ``tensor`` is not modified.
    """
    _check(tensor, op, group)
    flat = tensor.detach().reshape(-1).clone()
    _ring_reduce_scatter_(flat, op, group)
    start, end = shard_bounds(flat.numel(), dist.get_world_size(group))[dist.get_rank(group)]
    out = flat[start:end].clone()  # clone: do not keep the whole working buffer alive
    if op == dist.ReduceOp.AVG:
        out /= dist.get_world_size(group)
    return out


def ring_all_gather(shard: torch.Tensor, numel: int | None = None,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's 1-D ``shard`` (in rank order) into one flat tensor.

    ``numel``: total size, when shards are uneven (rank ``r``'s shard must then have the size of
    ``shard_bounds(numel, n)[r]``); default ``n * shard.numel()`` (equal shards).
    """
    _check(shard, dist.ReduceOp.SUM, group)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = n * shard.numel() if numel is None else numel
    start, end = shard_bounds(numel, n)[rank]
    if shard.numel() != end - start:
        raise ValueError(f"rank {rank}'s shard has {shard.numel()} elements but a total of "
                         f"{numel} over {n} ranks gives it {end - start} (sizes from shard_bounds)")
    flat = torch.empty(numel, dtype=shard.dtype, device=shard.device)
    flat[start:end] = shard.reshape(-1)
    _ring_all_gather_(flat, group)
    return flat


def ring_all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place (like ``dist.all_reduce``) with a ring; returns it."""
    _check(tensor, op, group)
    n = dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    with torch.no_grad():
        _ring_reduce_scatter_(flat, op, group)
        _ring_all_gather_(flat, group)
        if op == dist.ReduceOp.AVG:
            flat /= n
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
    return tensor


_NODE_GROUPS: dict[int, tuple[object, dist.ProcessGroup, dist.ProcessGroup]] = {}


def node_groups(node_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's (intra-node, inter-node) groups when "nodes" are ``node_size`` consecutive ranks.

    ``dist.new_group`` is itself a collective: every rank creates every group, in the same order.
    The groups are cached per process group, so repeated calls cost nothing.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    validate.divisor("node_size", node_size, world, "the world size")
    cached = _NODE_GROUPS.get(node_size)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1], cached[2]
    intra = inter = None
    for node in range(world // node_size):
        g = dist.new_group(list(range(node * node_size, (node + 1) * node_size)))
        if rank // node_size == node:
            intra = g
    for local in range(node_size):
        g = dist.new_group(list(range(local, world, node_size)))
        if rank % node_size == local:
            inter = g
    _NODE_GROUPS[node_size] = (dist.group.WORLD, intra, inter)
    return intra, inter


def hierarchical_all_reduce(tensor: torch.Tensor, node_size: int,
                            op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    """Two-level all-reduce of ``tensor`` in place over the default group; returns it.

    1. ring reduce-scatter inside the node (fast link): local rank ``l`` owns chunk ``l``;
    2. ring all-reduce of that chunk across nodes (slow link), among the ranks with the same ``l``
       - each sends only ``1/node_size`` of the buffer over the slow link;
    3. ring all-gather inside the node.
    """
    _check(tensor, op, None)
    if op == dist.ReduceOp.AVG:
        hierarchical_all_reduce(tensor, node_size, dist.ReduceOp.SUM)
        return tensor.div_(dist.get_world_size())
    intra, inter = node_groups(node_size)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    with torch.no_grad():
        _ring_reduce_scatter_(flat, op, intra)
        start, end = shard_bounds(flat.numel(), node_size)[dist.get_rank(intra)]
        ring_all_reduce(flat[start:end], op, inter)  # a contiguous view: reduced in place
        _ring_all_gather_(flat, intra)
        if not tensor.is_contiguous():
            tensor.copy_(flat.view_as(tensor))
    return tensor


# ---- thin wrappers over the backend's own collectives, used by DDP, ZeRO and FSDP ------------
def broadcast_coalesced(tensors: Sequence[torch.Tensor], src: int = 0,
                        group: dist.ProcessGroup | None = None) -> None:
    """Overwrite ``tensors`` with rank ``src``'s values (``src`` is a rank in ``group``).

    One broadcast per dtype/device instead of one per tensor (what DDP does at construction with
    ``_sync_module_states``).
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for ts in groups.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, _peer(group, src), group=group)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None,
                         divisor: float = 1.0) -> int:
    """Sum ``tensors`` in place over ``group`` as one flat buffer (one message, as a DDP bucket),
    then divide by ``divisor``; returns the payload's bytes. ``group=None`` without an initialised
    process group (one process) only divides."""
    if not tensors:
        return 0
    with torch.no_grad():
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if dist.is_initialized():
            dist.all_reduce(flat, group=group)
        if divisor != 1:
            flat /= divisor
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return flat.numel() * flat.element_size()


def all_gather_into(output: torch.Tensor, shard: torch.Tensor,
                    group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """The backend's all-gather of equal shards into one flat ``output`` (``n * shard.numel()``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.12
    return fn(output, shard, group=group, async_op=async_op)


def reduce_scatter_into(output: torch.Tensor, flat: torch.Tensor,
                        group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """The backend's sum reduce-scatter of ``flat`` (``n * output.numel()``) into ``output``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, flat, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
