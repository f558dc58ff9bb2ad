"""Gradient clipping by the global norm, right for every layout (sharded, split, replicated).

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` computes the norm of the
gradients *this process holds*. That is the global norm only when every rank holds every gradient
whole (plain data parallelism, after the all-reduce). Under sharding or model parallelism it is not:

* FSDP / ZeRO-3: each rank holds the rows of its shard, so each computes a smaller norm of its
  own and clips with its own factor: the replicas' updates differ from one process's;
* ZeRO-2: the full gradients are freed during backward (only the reduce-scattered shard is kept,
  inside the optimizer), so ``p.grad`` is ``None``, the norm is 0 and nothing is clipped;
* tensor parallelism: each rank sees its slabs of the split weights plus the whole replicated ones
  (norm weights, row-parallel biases): different factors per TP rank, and the replicated
  weights, which must stay equal, drift apart;
* pipeline parallelism: each rank sees its stage's parameters only (and a tied embedding lives on
  two stages).

The global norm is ``(sum over every gradient element of the model, counted once, of |g|^p)^(1/p)``.
:func:`grad_norm` follows Megatron-LM's convention (``megatron/core/optimizer/clip_grads.py``,
``get_grad_norm_fp32``, with the filter of ``MegatronOptimizer.get_main_grads_for_grad_norm``):
each rank sums ``|g|^p`` over the gradient elements it *owns*, and one all-reduce (SUM; MAX for
the inf-norm) over the ranks holding the model adds them up. A rank owns:

* a piece of a sharded gradient (FSDP's dim-0 rows, ZeRO-2's gradient shard): always -- the pieces
  of the data-parallel ranks are disjoint;
* a gradient split by tensor parallelism (``tensor_model_parallel``, Megatron's attribute), an
  expert's gradient on its expert-parallel rank, a pipeline stage's gradients: always -- disjoint
  over TP, EP and PP;
* a gradient replicated over a group (data-parallel replicas after the all-reduce, context-parallel
  ranks, the replicated parameters of a TP group, an expert's expert-data-parallel replicas): on
  the group's rank 0 only (Megatron's ``param_is_not_tensor_parallel_duplicate``);
* a tied embedding held by the first and the last pipeline stage: on the first (Megatron's
  ``param_is_not_shared``: the last stage's copy is ``shared``).

:func:`clip_grad_norm_` then scales every gradient this rank holds (owned or not, so replicas stay
equal) by ``max_norm / (norm + 1e-6)`` when that is below 1: the coefficient of both
``torch.nn.utils.clip_grad_norm_`` and Megatron's ``clip_grad_by_total_norm_fp32``, so the result
equals one process clipping with PyTorch. The sums are taken in float64 (Megatron and PyTorch use
the gradients' dtype; float64 makes the norm independent of how the world is cut, up to rounding).
Clip after the gradients are synchronised (after ``finish_gradient_synchronization``, the
sequence-parallel and tied-embedding sums) and before ``optimizer.step()``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.analytic import validate
from dtlib.parallel.expert import ExpertParallelMoE
from dtlib.parallel.pipeline import GPTStage, PipelineExecutor

__all__ = ["grad_norm", "clip_grad_norm_", "clip_grads_by_total_norm_"]


@dataclass
class _Piece:
    """A gradient tensor this rank holds, and whether its elements count here."""
    tensor: torch.Tensor
    owned: bool


def _world(group: Any) -> Any:
    """A wrapper's group: ``None`` there means the default group (torch.distributed's convention)."""
    return dist.group.WORLD if group is None else group


def _first_in(group: Any) -> bool:
    """Whether this rank is rank 0 of ``group`` (``None``: no replicas, so yes)."""
    return group is None or dist.get_rank(group) == 0


def _sources(parameters: Any) -> list[Any]:
    """``parameters`` as a list of gradient holders: one holder (a tensor, a module, a
    ShardedOptimizer, a PipelineExecutor) or an iterable of them."""
    if isinstance(parameters, (torch.Tensor, nn.Module, PipelineExecutor)) or hasattr(parameters, "held_gradients"):
        return [parameters]
    return list(parameters)


def _pieces(parameters: Any, dp_group: Any, tp_group: Any, expert_dp_group: Any,
            shared: Iterable[torch.Tensor]) -> list[_Piece]:
    """The gradients this rank holds, each marked owned or not (see the module docstring)."""
    sources: list[tuple[Any, Any]] = []  # (source, the group its plain gradients are replicated over)
    for s in _sources(parameters):
        if isinstance(s, PipelineExecutor):  # its dp_group averages the stages' gradients
            replicas = _world(s.dp_group) if s.dp_group is not None else dp_group
            sources += [(chunk, replicas) for chunk in s.chunks]
        else:
            sources.append((s, dp_group))
    modules = [m for s, _ in sources if isinstance(s, nn.Module) for m in s.modules()]
    if tp_group is None:  # a model converted by tensor_parallel knows its group
        state = next((m.tensor_parallel_state for m in modules
                      if getattr(m, "tensor_parallel_state", None) is not None), None)
        tp_group = _world(state.group) if state is not None and state.size > 1 else None
    experts = {id(p) for m in modules if isinstance(m, ExpertParallelMoE) for p in m.experts.parameters()}
    duplicates = {id(p) for p in shared}
    stages = [m for m in modules if isinstance(m, GPTStage)]
    if stages and not any(s.first for s in stages) and stages[0].cfg.tied_embeddings:
        # the last stage's copy of the tied embedding; the first stage counts it
        duplicates.update(id(s.lm_head.weight) for s in stages if s.last)
    tp_first = _first_in(tp_group)

    def owned(p: torch.Tensor, replicas: Any) -> bool:
        if id(p) in duplicates or getattr(p, "shared", False):
            return False
        if not tp_first and not getattr(p, "tensor_model_parallel", False):
            return False  # replicated over TP: counted on TP rank 0
        return _first_in(expert_dp_group if id(p) in experts else replicas)

    held: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
    for s, replicas in sources:
        if hasattr(s, "held_gradients"):  # FSDP, ShardedOptimizer, BucketedDDP/NaiveDDP know theirs
            held += s.held_gradients()
        elif isinstance(s, nn.Module):
            held += [(p, p.grad, replicas) for p in s.parameters() if p.grad is not None]
        elif isinstance(s, torch.Tensor):
            held += [(s, s.grad, replicas)] if s.grad is not None else []
        else:
            raise TypeError(f"parameters must be tensors, modules, FSDP, a data-parallel wrapper, a "
                            f"ShardedOptimizer or a PipelineExecutor, got {type(s).__name__}")
    out: list[_Piece] = []
    seen: set[int] = set()
    for p, grad, replicas in held:
        if id(p) not in seen:  # a parameter reached through two sources counts once
            seen.add(id(p))
            out.append(_Piece(grad, owned(p, replicas)))
    return out


def _device(pieces: list[_Piece], group: Any) -> torch.device:
    if pieces:
        return pieces[0].tensor.device
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_norm_type(norm_type: float) -> float:
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not (
            norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
        raise ValueError(f"norm_type must be a positive number or math.inf, got {norm_type!r}")
    return float(norm_type)


def _norm(pieces: list[_Piece], norm_type: float, group: Any) -> float:
    """Megatron's ``get_grad_norm_fp32`` on the owned pieces, in float64, reduced over ``group``."""
    total = torch.zeros((), dtype=torch.float64, device=_device(pieces, group))
    for piece in pieces:
        if not piece.owned or piece.tensor.numel() == 0:
            continue
        g = piece.tensor.detach().double()
        if norm_type == math.inf:
            total = torch.maximum(total, g.abs().max())
        else:
            total += g.abs().pow(norm_type).sum() if norm_type != 2 else g.pow(2).sum()
    if dist.is_available() and dist.is_initialized():
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(total, op=op, group=group)
    value = total.item()
    return value if norm_type == math.inf else value ** (1.0 / norm_type)


def grad_norm(parameters: Any, norm_type: float = 2.0, *, dp_group: Any = None, tp_group: Any = None,
              expert_dp_group: Any = None, shared: Iterable[torch.Tensor] = (), group: Any = None) -> float:
    """The norm of the whole model's gradient (every element counted once), the same number on
    every rank; a collective over ``group`` (default: all ranks), which every rank there calls.

    ``parameters``: what this rank trains -- tensors, modules, :class:`~dtlib.parallel.FSDP`
    wrappers, a :class:`~dtlib.parallel.BucketedDDP`/:class:`~dtlib.parallel.NaiveDDP`, a
    :class:`~dtlib.parallel.ShardedOptimizer` (stage 2: its gradient shards), a
    :class:`~dtlib.parallel.pipeline.PipelineExecutor` (its stages; the last stage's copy of a tied
    embedding is not counted), or a list of these. What is sharded, split or replicated is read from
    them; the rest is said here:

    * ``dp_group``: the group over which plain tensors and modules hold equal (averaged) gradients
      -- the data-parallel group, with context parallelism the dp x cp ranks (Megatron's "data
      parallel group with context parallel"); ``None``: no such replicas. The wrappers know theirs.
    * ``tp_group``: the tensor-parallel group; found on a model converted by
      :func:`~dtlib.parallel.tensor_parallel` when not given. Parameters that are not
      ``tensor_model_parallel`` count on its rank 0 only.
    * ``expert_dp_group``: the replicas of an expert (Megatron's expert-data-parallel group) for the
      experts of :class:`~dtlib.parallel.ExpertParallelMoE` layers; ``None``: one copy each.
    * ``shared``: parameters whose gradient another rank holds and counts (Megatron's
      ``param.shared``; an attribute ``shared = True`` on a parameter does the same).
    """
    norm_type = _check_norm_type(norm_type)
    return _norm(_pieces(parameters, dp_group, tp_group, expert_dp_group, shared), norm_type, group)


@torch.no_grad()
def clip_grads_by_total_norm_(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (total_norm + 1e-6)`` if that is below 1
    (``torch.nn.utils.clip_grad_norm_``'s coefficient; Megatron's ``clip_grad_by_total_norm_fp32``).
    A non-finite norm leaves the gradients alone, as Megatron does."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0, *, dp_group: Any = None,
                    tp_group: Any = None, expert_dp_group: Any = None, shared: Iterable[torch.Tensor] = (),
                    group: Any = None) -> float:
    """Clip the whole model's gradient to norm ``max_norm``, in place, on every layout; return the
    norm before clipping (as ``torch.nn.utils.clip_grad_norm_``). A collective over ``group``.

    The norm is :func:`grad_norm`'s (same arguments: what is sharded, split or replicated); every
    gradient this rank holds, a ZeRO-2 gradient shard included, is scaled by the same coefficient,
    so a run clips exactly as one process clipping with ``torch.nn.utils.clip_grad_norm_``.
    Megatron-LM and nanoGPT clip at 1.0 by default (``--clip-grad 1.0``, ``grad_clip = 1.0``)."""
    max_norm = validate.number("max_norm", max_norm)
    norm_type = _check_norm_type(norm_type)
    pieces = _pieces(parameters, dp_group, tp_group, expert_dp_group, shared)
    total = _norm(pieces, norm_type, group)
    clip_grads_by_total_norm_([p.tensor for p in pieces], max_norm, total)
    return total
