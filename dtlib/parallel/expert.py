"""Expert parallelism: the experts of an MoE layer sharded over ``ep`` ranks, tokens sent to them
and back with two all-to-alls (GShard, Lepikhin et al. 2021, Sec. 2.2; Switch Transformer,
Fedus et al. 2022, Sec. 2.2; Megatron-core's ``MoEAlltoAllTokenDispatcher``).

Each rank routes its own tokens with the (replicated) router, exactly as the single-process
:class:`~dtlib.models.moe.MoE` does, then:

1. sorts its kept assignments by expert; expert ``e`` lives on EP rank ``e // (experts / ep)``;
2. exchanges the per-expert counts (an even ``all_to_all_single`` of integers), so every rank knows
   how many tokens it will receive from each peer (the splits of step 3 are uneven);
3. **dispatch**: ``all_to_all_single`` of the token activations with those splits;
4. runs its local experts on what it received;
5. **combine**: the reverse ``all_to_all_single`` brings each output back to the token's rank,
   which adds them up weighted by the router probabilities.

Both token all-to-alls are differentiable (:func:`all_to_all`): the backward of an all-to-all is
the all-to-all with input and output splits swapped.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlib.models.moe import MoE, Routing

__all__ = ["all_to_all", "ExpertParallelMoE", "expert_parallel"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        grad_in = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(grad_in, grad.contiguous(), input_splits, output_splits, group=ctx.group)
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any = None) -> torch.Tensor:
    """Differentiable uneven ``all_to_all_single`` along dim 0: rows ``input_splits[r]`` go to rank
    ``r``; ``output_splits[r]`` rows arrive from rank ``r``."""
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


class ExpertParallelMoE(MoE):
    """An :class:`~dtlib.models.moe.MoE` holding only this EP rank's experts.

    Shares the router and the local experts with the wrapped layer, under the same names
    (``router.weight``, ``experts.<global index>.*``), so checkpoints and the single-process
    model line up. ``last_counts`` holds the tokens this rank sent to each peer at the last step."""

    def __init__(self, moe: MoE, group: Any = None):
        nn.Module.__init__(self)
        self.group = dist.group.WORLD if group is None else group
        ep, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if moe.num_experts % ep:
            raise ValueError(f"expert parallel size ep={ep} must divide the {moe.num_experts} experts")
        self.num_experts, self.top_k, self.capacity_factor = moe.num_experts, moe.top_k, moe.capacity_factor
        self.ep, self.local = ep, moe.num_experts // ep
        self.first = rank * self.local
        self.router = moe.router
        self.experts = nn.ModuleDict({str(e): moe.experts[e]
                                      for e in range(self.first, self.first + self.local)})
        self.aux_loss, self.last_routing, self.last_counts = None, None, None

    def mix(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        token, slot = routing.keep.nonzero(as_tuple=True)
        expert = routing.experts[token, slot]
        order = torch.argsort(expert, stable=True)  # grouped by expert, hence by destination rank
        token, slot, expert = token[order], slot[order], expert[order]
        send_counts = torch.bincount(expert, minlength=self.num_experts)
        recv_counts = torch.empty_like(send_counts)  # [source rank, local expert]
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        input_splits = send_counts.view(self.ep, self.local).sum(1).tolist()
        output_splits = recv_counts.view(self.ep, self.local).sum(1).tolist()
        self.last_counts = input_splits
        received = all_to_all(x[token], output_splits, input_splits, self.group)
        local_expert = torch.arange(self.local, device=x.device).repeat(self.ep)
        local_expert = local_expert.repeat_interleave(recv_counts)
        outputs = torch.zeros_like(received)
        for j in range(self.local):
            rows = (local_expert == j).nonzero(as_tuple=True)[0]
            outputs = outputs.index_copy(0, rows, self.experts[str(self.first + j)](received[rows]))
        back = all_to_all(outputs, input_splits, output_splits, self.group)
        weights = routing.weights[token, slot]
        return torch.zeros_like(x).index_add(0, token, weights[:, None] * back)


def expert_parallel(model: nn.Module, group: Any = None) -> nn.Module:
    """Shard every :class:`~dtlib.models.moe.MoE` of ``model`` over ``group`` (in place): each
    rank keeps ``experts / ep`` experts and exchanges tokens with :class:`ExpertParallelMoE`."""
    for name, module in list(model.named_modules()):
        if type(module) is MoE:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                    ExpertParallelMoE(module, group))
    return model
