"""PyTorch's own tensor parallelism on a TinyGPT: the reference :mod:`dtlib.parallel.tensor` is
checked and timed against (tests/test_tensor_parallel.py, benchmarks/bench_tensor_parallel.py).

The plan is torchtitan's (``torchtitan/models/llama/parallelize_llama.py``, ``apply_tp``):
``RowwiseParallel`` for the token embedding, ``ColwiseParallel`` for QKV, up and gate and the LM
head, ``RowwiseParallel`` for the attention projection and down, ``SequenceParallel`` for the
norms and ``PrepareModuleInput`` to gather the sequence before attention and the MLP. Two
adaptations to TinyGPT: modules exchange plain local tensors (TinyGPT's residual adds and
position embeddings are plain tensors, and DTensor refuses to add a plain tensor to a DTensor),
and the fused QKV weight is reordered so that each rank's *contiguous* block of rows is
``[its Q heads; its K heads; its V heads]``, since ``ColwiseParallel`` shards rows contiguously
(Megatron-LM stores QKV grouped by head for the same reason).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dtlib.models.gpt import TinyGPT

__all__ = ["parallelize_tinygpt", "dtensor_full_grads"]


def _qkv_sizes(model: TinyGPT) -> list[int]:
    cfg = model.cfg
    kv_dim = cfg.kv_heads * cfg.head_dim
    return [cfg.hidden, kv_dim, kv_dim]


def _rank_major(t: torch.Tensor, sizes: list[int], n: int) -> torch.Tensor:
    """Rows [Q; K; V] -> [Q_0; K_0; V_0; Q_1; ...] (rank r's heads together)."""
    parts = [p.chunk(n) for p in t.split(sizes)]
    return torch.cat([torch.cat([p[r] for p in parts]) for r in range(n)])


def _segment_major(t: torch.Tensor, sizes: list[int], n: int) -> torch.Tensor:
    """The inverse of :func:`_rank_major`."""
    per_rank = [c.split([s // n for s in sizes]) for c in t.chunk(n)]
    return torch.cat([torch.cat([r[i] for r in per_rank]) for i in range(len(sizes))])


def parallelize_tinygpt(model: TinyGPT, mesh: Any, sequence_parallel: bool = False,
                        loss_parallel: bool = False) -> TinyGPT:
    """Apply ``parallelize_module`` to ``model`` over the 1-D ``mesh``; return it.

    The logits come back replicated ``[b, s, v]`` (a plain tensor), or with ``loss_parallel`` as a
    DTensor sharded on the vocabulary, for ``F.cross_entropy`` inside
    ``torch.distributed.tensor.parallel.loss_parallel()``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    n, sizes = mesh.size(), _qkv_sizes(model)
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between,
                                   output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        plan["norm_f"] = SequenceParallel(use_local_output=True)
    for i, block in enumerate(model.blocks):
        qkv = block.attn.qkv
        with torch.no_grad():
            qkv.weight.copy_(_rank_major(qkv.weight, sizes, n))
            if qkv.bias is not None:
                qkv.bias.copy_(_rank_major(qkv.bias, sizes, n))
        block.attn.heads, block.attn.kv_heads = model.cfg.heads // n, model.cfg.kv_heads // n
        p = f"blocks.{i}."
        plan.update({p + "attn.qkv": ColwiseParallel(),
                     p + "attn.proj": RowwiseParallel(output_layouts=between),
                     p + "mlp.up": ColwiseParallel(),
                     p + "mlp.down": RowwiseParallel(output_layouts=between)})
        if model.cfg.activation == "swiglu":
            plan[p + "mlp.gate"] = ColwiseParallel()
        if sequence_parallel:
            gather = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({p + "norm1": SequenceParallel(use_local_output=True),
                         p + "norm2": SequenceParallel(use_local_output=True),
                         p + "attn": PrepareModuleInput(**gather),
                         p + "mlp": PrepareModuleInput(**gather)})
    return parallelize_module(model, mesh, plan)


def dtensor_full_grads(model: nn.Module, mesh: Any) -> dict[str, torch.Tensor]:
    """Full gradients of a :func:`parallelize_tinygpt` model under TinyGPT's names and row order
    (``full_tensor()`` also sums the partial gradients of sequence-parallel norms)."""
    from torch.distributed.tensor import DTensor
    sizes = _qkv_sizes(model)
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = _segment_major(g, sizes, mesh.size()) if ".attn.qkv." in name else g
    return out
