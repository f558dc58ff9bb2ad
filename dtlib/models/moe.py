"""A mixture-of-experts MLP: top-k router, capacity with token dropping, load-balancing loss.

Routing follows the Switch Transformer (Fedus et al. 2022) and GShard (Lepikhin et al. 2021):

* the router is a bias-free ``hidden x experts`` linear layer; ``probs = softmax(x W_r)``; each
  token goes to its ``top_k`` experts, weighted by their router probabilities (not renormalised,
  as Switch eq. 2; Mixtral renormalises over the top k);
* capacity (Switch eq. 3): each expert takes at most ``ceil(capacity_factor * tokens * top_k /
  experts)`` tokens of a *routing group*; later assignments are dropped (the token passes through
  the residual connection only). First choices are served before second choices (GShard
  Alg. 1), then tokens in sequence order. ``capacity_factor=None`` drops nothing;
* load-balancing loss (Switch eq. 4-6): ``experts * sum_i f_i * P_i`` with ``f_i`` the fraction
  of assignments routed to expert i and ``P_i`` its mean router probability.

A routing group is one sequence (GShard Sec. 2.2 routes "groups" of tokens independently): the
routing of a sequence then does not depend on how a batch is split over data-parallel ranks or
micro-batches, which keeps parallel training equal to single-process training.

:meth:`MoE.mix` runs the experts on the tokens routed to them; the expert-parallel version
(:mod:`dtlib.parallel.expert`) overrides only that step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MoE", "Routing", "route"]


@dataclass
class Routing:
    """Where each token goes: ``experts``/``weights``/``keep`` are ``[tokens, top_k]`` (``keep``
    False = dropped for capacity); ``aux_loss`` is the load-balancing loss of these tokens."""
    experts: torch.Tensor
    weights: torch.Tensor
    keep: torch.Tensor
    aux_loss: torch.Tensor

    @property
    def dropped(self) -> int:
        """Assignments dropped for lack of capacity."""
        return int((~self.keep).sum())

    def load(self, num_experts: int) -> torch.Tensor:
        """Assignments each expert processes (after dropping)."""
        return torch.bincount(self.experts[self.keep], minlength=num_experts)


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Tokens an expert accepts per routing group (Switch Transformer eq. 3, times top_k)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None) -> Routing:
    """Route ``logits`` ``[groups, tokens, experts]`` (one group per sequence); returns the
    routing of the flattened ``groups * tokens`` tokens."""
    g, s, e = logits.shape
    probs = F.softmax(logits.float(), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)              # [g, s, k]
    assigned = F.one_hot(experts, e)                          # [g, s, k, e]
    if capacity_factor is None:
        keep = torch.ones_like(experts, dtype=torch.bool)
    else:
        # position of each assignment in its expert's queue: first choices first, then by token
        queue = assigned.transpose(1, 2).reshape(g, top_k * s, e)
        position = (queue.cumsum(1) - 1) * queue
        position = position.view(g, top_k, s, e).transpose(1, 2).sum(-1)  # [g, s, k]
        keep = position < capacity(s, e, top_k, capacity_factor)
    # Switch eq. 4-6 per group, averaged over groups: f from the assignments before dropping
    f = assigned.sum(2).float().mean(1) / top_k                # [g, e]
    p = probs.mean(1)                                          # [g, e]
    aux = e * (f * p).sum(-1).mean()
    return Routing(experts.reshape(-1, top_k), weights.reshape(-1, top_k).to(logits.dtype),
                   keep.reshape(-1, top_k), aux)


class MoE(nn.Module):
    """``num_experts`` MLPs (made by ``make_expert``) and a top-k router over them.

    After each forward, ``aux_loss`` holds the load-balancing loss (add ``coef * aux_loss`` to the
    training loss; Switch uses 1e-2) and ``last_routing`` the routing (dropped tokens, load)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, make_expert: Callable[[], nn.Module],
                 capacity_factor: float | None = None):
        super().__init__()
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"capacity_factor must be > 0 (or None: no dropping), got {capacity_factor}")
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(num_experts))
        self.aux_loss: torch.Tensor | None = None
        self.last_routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        routing = route(self.router(x), self.top_k, self.capacity_factor)
        self.aux_loss, self.last_routing = routing.aux_loss, routing
        return self.mix(x.reshape(b * s, h), routing).view(b, s, h)

    def mix(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``sum_k weight_k * expert_k(x)`` over each token's kept assignments."""
        token, slot = routing.keep.nonzero(as_tuple=True)
        expert = routing.experts[token, slot]
        out = torch.zeros_like(x)
        for e in expert.unique().tolist():
            rows = token[expert == e]
            w = routing.weights[rows, slot[expert == e]]
            out = out.index_add(0, rows, w[:, None] * self.experts[e](x[rows]))
        return out
