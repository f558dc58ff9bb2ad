"""Megatron-Core's tensor-parallel layers next to dtlib's and next to the full-width layer.

:func:`compare_parallel_layers` builds, on ``tp`` ranks, the same MLP three times from the same
full weights -- Megatron-Core's ``ColumnParallelLinear -> GELU -> RowParallelLinear``, dtlib's
(:mod:`dtlib.parallel.tensor`) and the full ``nn.Linear`` pair on every rank -- runs one forward
and backward through each, and returns how far the outputs and the (gathered) weight gradients
differ, with the collectives each issued (:class:`dtlib.measure.CollectiveCounter`). It also
counts the collectives of one Megatron ``TransformerLayer`` (local spec) next to one dtlib
TinyGPT block (:func:`dtlib.experiments.tensor.block_behaviour`): the same Megatron layout
(Shoeybi et al. 2019, Sec. 3; Korthikanti et al. 2022, Sec. 4.2.2) should issue the same calls.
Megatron's tensors are ``[s, b, h]``, dtlib's ``[b, s, h]``: inputs are transposed between them.
"""
from __future__ import annotations

from dtlib.extras import require

require("frameworks", "megatron.core", feature=__name__)

from typing import Any

import torch
import torch.nn.functional as F

from dtlib.analytic import validate
from dtlib.frameworks.megatron_cpu import cpu_shims, gpt_block_spec
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter

__all__ = ["compare_parallel_layers"]

HIDDEN, BATCH, SEQ = 16, 2, 8


def _full_pair(seed: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(seed)
    return torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)


def _run(forward: Any, x: torch.Tensor, weight: torch.Tensor) -> dict[str, Any]:
    """One forward and backward of ``forward(x)`` with loss ``sum(y * weight)``: the output and
    the collectives of each pass. ``x`` requires a gradient, as a layer's input inside a model
    does (otherwise dtlib skips the input-gradient all-reduce that Megatron always issues)."""
    x = x.clone().requires_grad_()
    with CollectiveCounter() as fwd:
        y = forward(x)
    with CollectiveCounter() as bwd:
        (y * weight).sum().backward()
    return {"y": y.detach(), "forward": dict(fwd.counts), "backward": dict(bwd.counts)}


def _gather(t: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _worker(rank: int, world_size: int, sequence_parallel: bool, seed: int) -> dict[str, Any]:
    with cpu_shims():
        return _compare(world_size, sequence_parallel, seed)


def _compare(tp: int, sequence_parallel: bool, seed: int) -> dict[str, Any]:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import TransformerConfig

    from dtlib.parallel import tensor as dtlib_tp

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        group = parallel_state.get_tensor_model_parallel_group()
        rank = parallel_state.get_tensor_model_parallel_rank()
        config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                                   hidden_dropout=0.0, attention_dropout=0.0,
                                   tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
                                   use_cpu_initialization=True, gradient_accumulation_fusion=False)
        fc1, fc2 = _full_pair(seed)
        g = torch.Generator().manual_seed(seed + 1)
        x_sbh = torch.randn(SEQ, BATCH, HIDDEN, generator=g)  # the full input, [s, b, h]
        weight_sbh = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
        shard = (lambda t, dim: t.chunk(tp, dim)[rank]) if sequence_parallel else (lambda t, dim: t)

        # the full-width layer, in one process
        full = _run(lambda x: fc2(F.gelu(fc1(x))), x_sbh, weight_sbh)

        # Megatron-Core's pair, loaded with this rank's slabs of the same weights
        zeros = torch.nn.init.zeros_
        col = tensor_parallel.ColumnParallelLinear(HIDDEN, 4 * HIDDEN, config=config, init_method=zeros,
                                                   bias=True, gather_output=False)
        row = tensor_parallel.RowParallelLinear(4 * HIDDEN, HIDDEN, config=config, init_method=zeros,
                                                bias=True, input_is_parallel=True, skip_bias_add=False)
        with torch.no_grad():
            col.weight.copy_(fc1.weight.chunk(tp, 0)[rank])
            col.bias.copy_(fc1.bias.chunk(tp, 0)[rank])
            row.weight.copy_(fc2.weight.chunk(tp, 1)[rank])
            row.bias.copy_(fc2.bias)
        megatron = _run(lambda x: row(F.gelu(col(x)[0]))[0], shard(x_sbh, 0), shard(weight_sbh, 0))

        # dtlib's pair (batch-first [b, s, h]) from the same full layers
        dcol = dtlib_tp.ColumnParallelLinear.from_linear(fc1, group=group,
                                                         sequence_parallel=sequence_parallel)
        drow = dtlib_tp.RowParallelLinear.from_linear(fc2, group=group, input_is_parallel=True,
                                                      sequence_parallel=sequence_parallel)
        dtlib = _run(lambda x: drow(F.gelu(dcol(x))), shard(x_sbh.transpose(0, 1), 1),
                     shard(weight_sbh.transpose(0, 1), 1))

        full_grads = {"fc1.weight": fc1.weight.grad, "fc2.weight": fc2.weight.grad}
        megatron_grads = {"fc1.weight": _gather(col.weight.grad, 0, group),
                          "fc2.weight": _gather(row.weight.grad, 1, group)}
        dtlib_grads = {"fc1.weight": _gather(dcol.weight.grad, 0, group),
                       "fc2.weight": _gather(drow.weight.grad, 1, group)}
        megatron_y = _gather(megatron["y"], 0, group) if sequence_parallel else megatron["y"]
        dtlib_y = _gather(dtlib["y"], 1, group) if sequence_parallel else dtlib["y"]

        def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
            return max((a[k] - b[k]).abs().max().item() for k in a)
        return {
            "megatron_vs_full_output": (megatron_y - full["y"]).abs().max().item(),
            "dtlib_vs_megatron_output": (dtlib_y.transpose(0, 1) - megatron_y).abs().max().item(),
            "megatron_vs_full_grad": diff(megatron_grads, full_grads),
            "dtlib_vs_megatron_grad": diff(dtlib_grads, megatron_grads),
            "megatron_collectives": {"forward": megatron["forward"], "backward": megatron["backward"]},
            "dtlib_collectives": {"forward": dtlib["forward"], "backward": dtlib["backward"]},
            "megatron_layer_collectives": _layer_collectives(config, shard(x_sbh, 0)),
            "dtlib_block_collectives": _dtlib_block_collectives(group, sequence_parallel, seed),
        }
    finally:
        parallel_state.destroy_model_parallel()


def _layer_collectives(config: Any, x: torch.Tensor) -> dict[str, dict[str, int]]:
    """The collectives of one Megatron ``TransformerLayer`` (GPT local spec), forward and backward."""
    from megatron.core.transformer.spec_utils import build_module

    spec = gpt_block_spec(config, None)
    layer_spec = spec.layer_specs[0] if hasattr(spec, "layer_specs") else spec
    layer = build_module(layer_spec, config=config, layer_number=1)
    mask = torch.ones(SEQ, SEQ).triu(diagonal=1).bool()[None, None]
    out = _run(lambda t: layer(t, attention_mask=mask)[0], x, torch.ones_like(x))
    return {"forward": out["forward"], "backward": out["backward"]}


def _dtlib_block_collectives(group: Any, sequence_parallel: bool, seed: int) -> dict[str, dict[str, int]]:
    """The collectives of one dtlib TinyGPT block of the same shape, forward and backward."""
    from dtlib.experiments.tensor import block_behaviour
    from dtlib.models import TinyGPT, tiny_gpt_config
    from dtlib.parallel.tensor import tensor_parallel

    torch.manual_seed(seed)
    model = tensor_parallel(TinyGPT(tiny_gpt_config(layers=1, hidden=HIDDEN, heads=4, seq=SEQ, vocab=32)),
                            group=group, sequence_parallel=sequence_parallel,
                            sequence_parallel_grads="manual")
    calls = block_behaviour(model, BATCH, seed)
    count = lambda pairs: {name: sum(1 for n, _ in pairs if n == name) for name, _ in pairs}
    return {"forward": count(calls["forward"]), "backward": count(calls["backward"])}


def compare_parallel_layers(tp: int = 2, sequence_parallel: bool = False, seed: int = 0,
                            timeout: float = 60.0) -> dict[str, Any]:
    """Rank 0's comparison of Megatron-Core's column/row-parallel MLP with the full-width layer
    and with dtlib's, on ``tp`` ranks (keys ``megatron_vs_full_output``, ``..._grad``,
    ``dtlib_vs_megatron_output``, ``..._grad``: largest absolute differences; and the collectives
    of each pair, of one Megatron ``TransformerLayer`` and of one dtlib block, forward and backward)."""
    validate.integer("tp", tp, minimum=2, maximum=8)
    validate.boolean("sequence_parallel", sequence_parallel)
    validate.integer("seed", seed, minimum=0)
    if HIDDEN * 4 % tp or 4 % tp or (sequence_parallel and SEQ % tp):
        raise ValueError(f"tp must divide the 4 heads, the MLP width {4 * HIDDEN} and (with sequence "
                         f"parallelism) the sequence {SEQ}; valid tp: 2, 4")
    from dtlib.frameworks.megatron_core import _import_megatron

    _import_megatron()
    # gloo even on GPUs: a comparison on CPU tensors (the full layers live on the CPU)
    return launch(_worker, tp, args=(sequence_parallel, seed), backend="gloo", timeout=timeout,
                  output="none")[0]
