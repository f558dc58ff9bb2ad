"""The conjugate communication operators of tensor and sequence parallelism, as
``torch.autograd.Function``s (Megatron-LM ``core/tensor_parallel/mappings.py``).

Entering and leaving a tensor-parallel region (Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3):

* ``f`` = :func:`copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward;
* ``g`` = :func:`reduce_from_tensor_model_parallel_region`: all-reduce forward, identity backward.

With sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) the region is entered from and
left to sequence shards:

* ``f-bar`` = :func:`gather_from_sequence_parallel_region`: all-gather forward, reduce-scatter
  backward;
* ``g-bar`` = :func:`reduce_scatter_to_sequence_parallel_region`: reduce-scatter forward,
  all-gather backward.

Also the last-dimension split and gather (a row-parallel layer given the full input, a
column-parallel layer's ``gather_output``), and :class:`SequenceParallelLinear`, a linear layer on
the all-gathered sequence that keeps only its input's shard for backward. Tensors are batch-first
``[b, s, h]`` as in TinyGPT, so the sequence dimension is 1 (Megatron uses ``[s, b, h]``, dim 0).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtlib.parallel.collectives import all_gather_into, reduce_scatter_into

__all__ = ["copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
           "gather_from_sequence_parallel_region", "reduce_scatter_to_sequence_parallel_region",
           "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
           "SequenceParallelLinear", "rank_chunk", "SEQ_DIM"]

SEQ_DIM = 1  # [batch, seq, hidden]


# ---- collectives on a dimension (helpers of the operators) ------------------------------------
def _size(group: Any) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    out = x.contiguous().clone()  # never reduce autograd's own buffer in place
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    x0 = x.movedim(dim, 0).contiguous()  # the backend gathers along dimension 0
    out = x0.new_empty((_size(group) * x0.shape[0], *x0.shape[1:]))
    all_gather_into(out, x0, group)
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk along ``dim``."""
    x0 = x.movedim(dim, 0).contiguous()
    out = x0.new_empty((x0.shape[0] // _size(group), *x0.shape[1:]))
    reduce_scatter_into(out, x0, group)
    return out.movedim(0, dim).contiguous()


def rank_chunk(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication)."""
    return x.chunk(_size(group), dim)[dist.get_rank(group)].contiguous()


# ---- the conjugate operators (Shoeybi et al. Sec. 3; Korthikanti et al. Sec. 4.2.2) ------------
class _CopyToRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    """f-bar: all-gather along ``dim`` forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    """g-bar: reduce-scatter along ``dim`` forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dimension forward, all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return rank_chunk(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, -1, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    """All-gather the last dimension forward, keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return rank_chunk(grad, -1, ctx.group), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``f``: enter a tensor-parallel region with a replicated input; the input's gradient is the
    sum of every rank's contribution, so backward all-reduces it."""
    return _CopyToRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``g``: leave a tensor-parallel region by summing the partial outputs (all-reduce); the
    gradient of a sum reaches every term unchanged, so backward is the identity."""
    return _ReduceFromRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Any = None,
                                         dim: int = SEQ_DIM) -> torch.Tensor:
    """``f-bar``: sequence shards -> the full sequence (all-gather); backward reduce-scatters."""
    return _GatherFromSequenceRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any = None,
                                               dim: int = SEQ_DIM) -> torch.Tensor:
    """``g-bar``: partial sums of the full sequence -> this rank's summed shard (reduce-scatter);
    backward all-gathers."""
    return _ReduceScatterToSequenceRegion.apply(x, group, dim)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension (input of a row-parallel layer that was given
    the full input); backward all-gathers the slices."""
    return _ScatterToRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather the last dimension (a column-parallel layer's ``gather_output``)."""
    return _GatherFromRegion.apply(x, group)


class SequenceParallelLinear(torch.autograd.Function):
    """``all_gather(x) @ W^T + b`` saving only the local shard of ``x``; backward gathers it again
    for the weight gradient and reduce-scatters the input gradient (Megatron-LM's
    ``LinearWithGradAccumulationAndAsyncCommunication`` with ``sequence_parallel=True``)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather(x, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        full = _all_gather(x, SEQ_DIM, ctx.group)
        grad_input = _reduce_scatter(grad @ weight, SEQ_DIM, ctx.group)
        grad_weight = grad.flatten(0, -2).T @ full.flatten(0, -2)
        grad_bias = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias, None
