"""The rank grid, context and expert parallelism: what lesson 09 runs on real ranks.

* :func:`single_process_config` - the same training on one process (the reference of every layout);
* :func:`compare_with_single_process` - a :class:`~dtlib.trainer.TrainConfig` trained on its rank
  grid and on one process: the two loss curves, the largest loss and weight differences against
  the float32 tolerances :data:`LOSS_TOL` and :data:`PARAM_TOL`, and both ``params_sha256``;
* :func:`ring_attention_run` - ring attention on ``cp`` ranks against single-process causal
  attention: output and gradient errors, sends per rank, unmasked pairs per rank;
* :func:`moe_dispatch_run` - an MoE layer on ``ep`` ranks: the tokens each rank sends to each
  other rank, the load of every expert and the assignments dropped for capacity;
* :func:`activation_memory_vs_seq` - activation memory per GPU against sequence length for
  several context-parallel sizes (:func:`dtlib.analytic.memory.memory_per_gpu`).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter
from dtlib.models.gpt import MLP, tiny_gpt_config
from dtlib.models.moe import MoE
from dtlib.parallel.context import causal_work, ring_attention, shard_sequence
from dtlib.parallel.expert import ExpertParallelMoE
from dtlib.trainer import TrainConfig, run, train

__all__ = ["single_process_config", "compare_with_single_process", "LOSS_TOL", "PARAM_TOL", "PARAM_TOL_ADAM",
           "ring_attention_run", "moe_dispatch_run", "activation_memory_vs_seq"]

# float32 sums in another order (gradients averaged over ranks, attention by blocks, TP partial
# sums) differ by ~1e-7. With SGD (update = lr x gradient) the weights stay within ~1e-7 after a
# few steps; a gradient summed instead of averaged, a missing one or a shifted batch is off by
# > 1e-3. (Adam's update g/sqrt(v) is scale-invariant, so it would hide a wrong average, and it
# turns noise in a near-zero gradient into a step of up to lr: AdamW runs get PARAM_TOL_ADAM.)
LOSS_TOL, PARAM_TOL, PARAM_TOL_ADAM = 1e-5, 1e-6, 1e-4


def single_process_config(config: TrainConfig) -> TrainConfig:
    """``config`` on one process: no parallelism, the whole global batch in one micro-batch
    (the same sequences per step, so the same training up to float32 summation order)."""
    return config.with_(dp=1, tp=1, pp=1, cp=1, ep=1, zero=0, sequence_parallel=False, schedule="1f1b",
                        virtual_stages=1, micro_batch_size=config.global_batch, num_microbatches=1)


def compare_with_single_process(config: TrainConfig, timeout: float = 120.0) -> dict[str, Any]:
    """Train ``config`` on its ranks (``dtlib.launch(train, world_size, ...)`` through
    :func:`dtlib.trainer.run`) and the same global batches on one process (no launch). Returns both
    loss curves (``parallel``, ``single``), ``max_loss_diff``, ``max_param_diff``, both
    ``params_sha256`` (``parallel_sha256``, ``single_sha256``: equal only if every sum happened in
    the same order), ``equal`` (both differences within :data:`LOSS_TOL` and the weight tolerance
    of the optimizer) and ``tokens_per_s``. The single process runs first: the ranks, forked
    afterwards, inherit what it imported."""
    single = train(0, 1, single_process_config(config), keep_params=True)
    parallel = run(config, timeout=timeout, keep_params=True)
    loss_diff = max(abs(a - b) for a, b in zip(parallel["losses"], single["losses"]))
    diff = max((parallel["params"][n] - single["params"][n]).abs().max().item() for n in single["params"])
    param_tol = PARAM_TOL if config.optimizer == "sgd" else PARAM_TOL_ADAM
    return {"parallel": parallel["losses"], "single": single["losses"], "max_loss_diff": loss_diff,
            "max_param_diff": diff, "parallel_sha256": parallel["params_sha256"],
            "single_sha256": single["params_sha256"], "equal": loss_diff <= LOSS_TOL and diff <= param_tol,
            "tokens_per_s": parallel["tokens_per_s"]}


def _ring(rank: int, world_size: int, seq: int, zigzag: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 2, seq, 8) for _ in range(4))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = full[0] @ full[1].transpose(-2, -1) / math.sqrt(8)
    scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    ref = F.softmax(scores, -1) @ full[2]
    ref.backward(dout)
    local = [shard_sequence(t, rank, world_size, dim=2, zigzag=zigzag).requires_grad_() for t in (q, k, v)]
    with CollectiveCounter() as counter:
        out = ring_attention(*local, group=None, zigzag=zigzag)
        out.backward(shard_sequence(dout, rank, world_size, dim=2, zigzag=zigzag))
    expect = [shard_sequence(t, rank, world_size, dim=2, zigzag=zigzag) for t in (ref, *[f.grad for f in full])]
    error = max((a - e).abs().max().item() for a, e in zip([out, *[t.grad for t in local]], expect))
    return {"error": error, "sends": counter.counts["send"], "bytes_sent": counter.bytes("send")}


def ring_attention_run(cp: int = 4, seq: int = 32, zigzag: bool = True, timeout: float = 60.0) -> dict[str, Any]:
    """Ring attention on ``cp`` ranks, forward and backward, against single-process attention:
    the largest error on any rank, point-to-point sends per rank, and the causal work per rank
    (:func:`~dtlib.parallel.context.causal_work`) with this split."""
    ranks = launch(_ring, cp, args=(seq, zigzag), timeout=timeout)
    return {"error": max(r["error"] for r in ranks), "sends": [r["sends"] for r in ranks],
            "bytes_sent": [r["bytes_sent"] for r in ranks], "work": causal_work(cp, seq, zigzag)}


def _moe(rank: int, world_size: int, experts: int, top_k: int, capacity_factor: float | None) -> dict:
    cfg = tiny_gpt_config(hidden=16, heads=2)
    torch.manual_seed(0)
    moe = ExpertParallelMoE(MoE(16, experts, top_k, lambda: MLP(cfg), capacity_factor))
    x = torch.randn(4, 16, 16, generator=torch.Generator().manual_seed(rank))
    with CollectiveCounter() as counter:
        moe(x)
    routing = moe.last_routing
    return {"sent_to": moe.last_counts, "load": routing.load(experts).tolist(), "dropped": routing.dropped,
            "assignments": routing.keep.numel(), "all_to_all": counter.counts["all_to_all"]}


def moe_dispatch_run(ep: int = 4, experts: int = 8, top_k: int = 2, capacity_factor: float | None = 1.0,
                     timeout: float = 60.0) -> dict[str, Any]:
    """One forward of an MoE layer (untrained router) with its experts on ``ep`` ranks:
    ``sent_to[r][s]`` tokens rank r sends to rank s, ``load[e]`` assignments expert e processes,
    ``dropped`` assignments over capacity, out of ``assignments``."""
    ranks = launch(_moe, ep, args=(experts, top_k, capacity_factor), timeout=timeout)
    load = [sum(r["load"][e] for r in ranks) for e in range(experts)]
    return {"sent_to": [r["sent_to"] for r in ranks], "load": load,
            "dropped": sum(r["dropped"] for r in ranks), "assignments": sum(r["assignments"] for r in ranks),
            "all_to_all_per_rank": ranks[0]["all_to_all"]}


def activation_memory_vs_seq(model: str, seqs: Sequence[int], cps: Sequence[int], tp: int = 8,
                             recompute: str = "selective") -> dict[int, list[float]]:
    """Activation bytes per GPU (one micro-batch, ``tp``-way tensor parallelism with sequence
    parallelism) for each sequence length and context-parallel size ``cp``."""
    out = {}
    for cp in cps:
        layout = Parallelism(tp=tp, cp=cp, sequence_parallel=True, recompute=recompute)
        out[cp] = [memory_per_gpu(model, layout, seq=s, dropout=False).activations for s in seqs]
    return out
