"""Tensor parallelism: what lesson 05 measures on real ranks.

* :func:`measure_tensor_parallel` - a TinyGPT split over ``world_size`` ranks
  (:func:`dtlib.parallel.tensor_parallel`, with or without sequence parallelism) next to the same
  model in one process: the loss of each and the largest gradient difference; the collectives of
  one transformer block, forward and backward (:class:`dtlib.measure.CollectiveCounter`); and the
  bytes the block saves for backward on each rank (:func:`dtlib.measure.saved_activation_bytes`)
  next to :func:`predicted_layer_bytes`.
* :func:`predicted_layer_bytes` - Korthikanti et al. 2022, Table 2, through
  :func:`dtlib.analytic.activations.layer_bytes` for TinyGPT in fp32 without dropout, plus the
  per-token statistics the paper neglects (LayerNorm keeps its mean and 1/std, RMSNorm its 1/std).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dtlib.analytic.activations import layer_bytes
from dtlib.analytic.config import TransformerConfig
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter, saved_activation_bytes
from dtlib.models import TinyGPT
from dtlib.parallel.tensor import (allreduce_sequence_parallel_grads, check_tensor_parallel_sizes,
                                   full_grad_dict, tensor_parallel, vocab_parallel_cross_entropy)

__all__ = ["predicted_layer_bytes", "block_behaviour", "measure_tensor_parallel"]

FP32 = 4


def predicted_layer_bytes(cfg: TransformerConfig, micro_batch_size: int, tp: int = 1,
                          sequence_parallel: bool = False) -> float:
    """Bytes one TinyGPT block keeps for backward on one rank (fp32, no dropout): Table 2's terms
    plus 4 bytes per token and statistic for both norms (on the rank's ``s/t`` tokens with SP)."""
    rmsnorm = cfg.norm == "rmsnorm"
    formula = layer_bytes(cfg.seq, micro_batch_size, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn,
                          tp=tp, sequence_parallel=sequence_parallel,
                          swiglu=cfg.activation == "swiglu", dropout=False, act_bytes=FP32,
                          norm_saved=2 if rmsnorm else 1)  # composite nn.RMSNorm keeps 2 (lesson 3)
    tokens = cfg.seq * micro_batch_size / (tp if sequence_parallel else 1)
    statistics = 2 * (1 if rmsnorm else 2) * FP32 * tokens
    return formula + statistics


def block_behaviour(model: TinyGPT, micro_batch_size: int, seed: int = 2) -> dict[str, Any]:
    """Run block 0 of a :func:`tensor_parallel` model on a random input (this rank's sequence
    shard with SP): the collectives of its forward and of its backward as ``(name, bytes)``
    lists, and the bytes it saves for backward."""
    state = model.tensor_parallel_state
    cfg, block = model.cfg, model.blocks[0]

    def block_input() -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(micro_batch_size, cfg.seq, cfg.hidden, generator=g)
        if state.sequence_parallel:
            x = x.chunk(state.size, dim=1)[state.rank]
        return x.clone().requires_grad_()

    x = block_input()
    with CollectiveCounter() as forward:
        y = block(x)
    with CollectiveCounter() as backward:
        y.square().sum().backward()
    saved = saved_activation_bytes(model, lambda: block(block_input()))["bytes"]
    return {"forward": forward.calls, "backward": backward.calls, "saved_bytes": saved}


def _worker(rank: int, world_size: int, cfg: TransformerConfig, sequence_parallel: bool,
            micro_batch_size: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab, (micro_batch_size, cfg.seq + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    torch.manual_seed(seed)
    single = TinyGPT(cfg)
    single_loss = F.cross_entropy(single(x).flatten(0, 1), y.flatten())
    single_loss.backward()
    torch.manual_seed(seed)
    # Megatron's way, by hand: the block's collectives alone (no end-of-backward sum), then the
    # sequence-parallel gradients summed once, as finalize_model_grads does
    model = tensor_parallel(TinyGPT(cfg), sequence_parallel=sequence_parallel, sequence_parallel_grads="manual")
    loss = vocab_parallel_cross_entropy(model(x), y)
    loss.backward()
    allreduce_sequence_parallel_grads(model)
    grads = full_grad_dict(model)
    ref = dict(single.named_parameters(remove_duplicate=False))
    grad_diff = max((grads[k] - ref[k].grad).abs().max().item() for k in grads)
    local = sum(p.numel() for p in model.parameters())
    return {"loss": loss.item(), "single_process_loss": single_loss.item(),
            "max_grad_diff": grad_diff, "local_parameters": local,
            "parameters": sum(p.numel() for p in single.parameters()),
            **block_behaviour(model, micro_batch_size),
            "predicted_bytes": predicted_layer_bytes(cfg, micro_batch_size, world_size,
                                                     sequence_parallel)}


def measure_tensor_parallel(cfg: TransformerConfig, world_size: int = 2,
                            sequence_parallel: bool = False, micro_batch_size: int = 2,
                            seed: int = 0, timeout: float = 60.0) -> dict[str, Any]:
    """Rank 0's view of a TinyGPT of shape ``cfg`` split over ``world_size`` ranks (keys:
    ``loss``, ``single_process_loss``, ``max_grad_diff``, ``local_parameters``, ``parameters``,
    ``forward`` and ``backward`` collectives of block 0, its ``saved_bytes`` and
    ``predicted_bytes``). The sizes must divide by ``world_size`` (checked before ranks start)."""
    if not isinstance(cfg, TransformerConfig):
        raise ValueError(f"cfg must be a TransformerConfig, got {type(cfg).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 2 <= world_size <= 8:
        raise ValueError(f"world_size must be an integer in 2..8, got {world_size!r}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) \
            or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be a positive integer, got {micro_batch_size!r}")
    check_tensor_parallel_sizes(cfg, world_size, sequence_parallel)
    return launch(_worker, world_size, args=(cfg, sequence_parallel, micro_batch_size, seed),
                  timeout=timeout, output="none")[0]
