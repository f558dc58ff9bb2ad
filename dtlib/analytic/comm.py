"""Communication: an alpha-beta cost model, nccl-tests bandwidths, and what each strategy moves.

Time of a collective of ``S`` bytes over ``n`` ranks on a link of latency alpha (s per step) and
bandwidth B (bytes/s per rank per direction), Thakur, Rabenseifner & Gropp 2005, "Optimization of
Collective Communication Operations in MPICH", Sec. 4 (``lg`` = ceil(log2 n)):

=================  ===========================================  ==================================
collective         ring (bandwidth-optimal)                     tree (latency-optimal)
=================  ===========================================  ==================================
all-reduce         2(n-1) alpha + 2(n-1)/n S/B                  2 lg alpha + 2(n-1)/n S/B (Rabenseifner)
reduce-scatter     (n-1) alpha + (n-1)/n S/B                    lg alpha + (n-1)/n S/B (rec. halving)
all-gather         (n-1) alpha + (n-1)/n S/B                    lg alpha + (n-1)/n S/B (rec. doubling)
all-to-all         (n-1) alpha + (n-1)/n S/B (pairwise)         lg alpha + lg S/(2B) (Bruck)
broadcast          (n-1) alpha + S/B (pipelined chain)          lg (alpha + S/B) (binomial tree)
p2p                alpha + S/B                                  same
=================  ===========================================  ==================================

At scale NCCL does not run these textbook algorithms with one alpha: :func:`nccl_latency` and
:func:`nccl_time` follow its own cost model (``src/graph/tuning.cc``, see :data:`NCCL_TUNING`), in
which a ring all-reduce pays a per-hop latency on each of its 2(n-1) steps (NVLink hops inside a
node, network hops between nodes) and a tree 2 log2(nodes) network hops, and NCCL runs whichever
of ring and tree is faster for the message.

``S`` is the full buffer, as nccl-tests counts it (for all-gather the gathered output, for
reduce-scatter the input). algbw = S/t and busbw = algbw x factor, factors from nccl-tests
``doc/PERFORMANCE.md``: all-reduce 2(n-1)/n; reduce-scatter, all-gather, all-to-all (n-1)/n;
broadcast, reduce, p2p 1.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from dtlib.analytic import validate
from dtlib.analytic.hardware import Cluster, Link, get_link
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.layout import Parallelism, check_pipeline, chunks_per_rank
from dtlib.analytic.measured import MeasuredLink
from dtlib.analytic.precision import Precision, get_precision

__all__ = ["COLLECTIVES", "ALGORITHMS", "collective_time", "bytes_sent_per_rank", "bus_factor",
           "flat_link", "flat_vs_hierarchical",
           "algbw", "busbw", "hierarchical_time", "strategy_volumes", "bubble_fraction",
           "comm_report", "tp_layer_times", "NCCL_TUNING", "nccl_latency", "nccl_time", "cp_kv_width",
           "cp_kv_bytes"]

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "p2p")
ALGORITHMS = ("ring", "tree")


def _check(op: str, algorithm: str = "ring", **sizes: Any) -> None:
    """The collective and algorithm names; counts (``ranks``, ``nodes``, ``local``, ``calls``: integers
    >= 1) and byte counts (finite, >= 0)."""
    validate.one_of("op", op, COLLECTIVES)
    validate.one_of("algorithm", algorithm, ALGORITHMS)
    for name, value in sizes.items():
        if name in ("ranks", "nodes", "local", "calls"):  # counts
            validate.array(name, value, integer=True, minimum=1, exclusive=False)
        else:
            validate.array(name, value, minimum=0, exclusive=False)


def _link(link: "Link | str") -> Link:
    return get_link(link) if isinstance(link, str) else link


def collective_time(op: str, nbytes: Any, ranks: Any, link: "Link | str",
                    algorithm: str = "ring") -> Any:
    """Alpha-beta time (s) of ``op`` on ``nbytes`` over ``ranks`` (see the module table).
    One rank takes no time; arrays broadcast. A calibrated link
    (:class:`~dtlib.analytic.measured.MeasuredLink`) gives its measured time instead."""
    _check(op, algorithm, nbytes=nbytes, ranks=ranks)
    lk = _link(link)
    if isinstance(lk, MeasuredLink):
        return lk.seconds(op, nbytes, ranks)
    a, n, S = lk.latency, np.asarray(ranks), np.asarray(nbytes, dtype=float)
    B = lk.group_bandwidth(n)  # a full mesh: every peer's link at once (Link.mesh_peers)
    lg = np.ceil(np.log2(np.maximum(n, 1)))
    frac = (n - 1) / n
    if op == "p2p":
        t = a + S / lk.bandwidth
    elif algorithm == "ring":
        steps = {"all_reduce": 2 * (n - 1), "broadcast": n - 1}.get(op, n - 1)
        volume = {"all_reduce": 2 * frac * S, "broadcast": S}.get(op, frac * S)
        t = steps * a + volume / B
    else:
        t = {"all_reduce": 2 * lg * a + 2 * frac * S / B,
             "reduce_scatter": lg * a + frac * S / B, "all_gather": lg * a + frac * S / B,
             "all_to_all": lg * a + lg * S / (2 * B), "broadcast": lg * (a + S / B)}[op]
    t = np.where((n == 1) & (op != "p2p"), 0.0, t)
    return float(t) if t.ndim == 0 else t


def bytes_sent_per_rank(op: str, nbytes: Any, ranks: Any) -> Any:
    """Bytes each rank sends with the ring algorithm (bandwidth term x B)."""
    _check(op, nbytes=nbytes, ranks=ranks)
    n = ranks
    return {"all_reduce": 2 * (n - 1) / n * nbytes, "broadcast": (n > 1) * nbytes,
            "p2p": nbytes}.get(op, (n - 1) / n * nbytes)


def bus_factor(op: str, ranks: Any) -> Any:
    """nccl-tests' busbw / algbw factor (doc/PERFORMANCE.md, "Summary")."""
    _check(op, ranks=ranks)
    n = ranks
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "p2p": 1.0}.get(op, (n - 1) / n)


def algbw(nbytes: Any, seconds: Any) -> Any:
    """nccl-tests algorithm bandwidth S / t (bytes/s)."""
    validate.array("nbytes", nbytes, minimum=0, exclusive=False)
    validate.array("seconds", seconds)
    return nbytes / seconds


def busbw(op: str, nbytes: Any, seconds: Any, ranks: Any) -> Any:
    """nccl-tests bus bandwidth: algbw x :func:`bus_factor`."""
    return algbw(nbytes, seconds) * bus_factor(op, ranks)


def hierarchical_time(op: str, nbytes: float, cluster: Cluster, algorithm: str = "ring") -> dict[str, float]:
    """Two-level collective over the whole cluster (as NCCL/Horovod hierarchical all-reduce):
    all-reduce = intra-node reduce-scatter, inter-node all-reduce of S/g per GPU (the g GPUs of a
    node in parallel, sharing its NICs), intra-node all-gather. reduce-scatter / all-gather use
    the matching half. Returns the time of each phase and the total."""
    _check(op, algorithm, nbytes=nbytes)
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"hierarchical collectives cover all-reduce, reduce-scatter and all-gather, not {op!r}")
    g, nodes = cluster.gpus_per_node, cluster.nodes
    inter = Link(cluster.inter.name, cluster.inter_bandwidth_per_gpu, cluster.inter.latency,
                 cluster.inter.source + "; shared by the GPUs of a node")
    phases = {}
    if op in ("all_reduce", "reduce_scatter"):
        phases["intra reduce_scatter"] = collective_time("reduce_scatter", nbytes, g, cluster.intra, algorithm)
    phases[f"inter {op}"] = collective_time(op, nbytes / g, nodes, inter, algorithm)
    if op in ("all_reduce", "all_gather"):
        phases["intra all_gather"] = collective_time("all_gather", nbytes, g, cluster.intra, algorithm)
    phases["total"] = sum(phases.values())
    return phases


def flat_link(cluster: Cluster) -> Link:
    """The link that paces one flat ring (or tree) over every GPU of ``cluster``, unaware of nodes.

    In one node it is the intra-node link. Across nodes each step of the ring waits for every
    rank's send (Thakur, Rabenseifner & Gropp 2005, Sec. 4), so the slowest hop sets the pace: the
    inter-node hop, at the NIC bandwidth per GPU and the network's latency. NCCL avoids this by
    running one ring per NIC along the topology (its channels, ``src/graph/tuning.cc``), which
    brings it close to :func:`hierarchical_time`.
    """
    if cluster.nodes == 1:
        return cluster.intra
    intra, inter = cluster.intra, cluster.inter
    return Link(inter.name, min(intra.bandwidth, cluster.inter_bandwidth_per_gpu),
                max(intra.latency, inter.latency),
                f"slowest hop of a ring spanning nodes ({intra.name} within, {inter.name} across): "
                + inter.source)


def flat_vs_hierarchical(op: str, nbytes: float, clusters: "list[Cluster]",
                         algorithm: str = "ring") -> dict[str, list[float]]:
    """Seconds of ``op`` on each cluster: one flat collective (:func:`flat_link`) vs two-level."""
    return {"flat": [collective_time(op, nbytes, c.world_size, flat_link(c), algorithm) for c in clusters],
            "hierarchical": [hierarchical_time(op, nbytes, c, algorithm)["total"] for c in clusters]}


# NCCL's tuning model, src/graph/tuning.cc (NVIDIA/nccl at 5067397, 2026), Simple protocol (the one
# large gradient buckets use): ncclTunerConstantsDefaults.baseLatencies (Tree and Ring 8.4 us),
# hwLatencies (NVLink: Ring 3.4, Tree 4.0 us; NET: Ring and Tree 14 us -- dtlib's links carry these
# as Link.latency, see dtlib.analytic.hardware), getNetOverhead (1 us x 3 for Simple: a multi-node
# ring's intra-node hop costs at least 3 us), the ring "plateau" factor 1.4 on multi-node all-reduce
# latency (ncclTopoGetAlgoTime, compute capability >= 8.0), and tree all-reduce bus bandwidth x 0.92
# (ncclTopoTuneModel's "various model refinements").
NCCL_TUNING: dict[str, float] = {"base_latency": 8.4e-6, "net_overhead": 3e-6, "ring_plateau": 1.4,
                                 "tree_bandwidth": 0.92}


def nccl_latency(op: str, algorithm: str, ranks: Any, nodes: Any, intra: "Link | str",
                 inter: "Link | str") -> Any:
    """NCCL's latency (s) of one ``op`` call over ``ranks`` GPUs spread over ``nodes`` nodes
    (``src/graph/tuning.cc``, :data:`NCCL_TUNING`): ring, with s = 2(n-1) steps for all-reduce and
    n-1 for reduce-scatter / all-gather, of which 2(N-1) (or N-1) cross the network,
    ``base + (s - s_net) max(alpha_intra, 3 us if N > 1) + s_net alpha_net`` (all-reduce across
    nodes x 1.4); tree (all-reduce only), ``base + 2((n/N - 1) alpha_intra + floor(log2 N) alpha_net)``.
    One rank takes no time; arrays broadcast."""
    _check(op, algorithm, ranks=ranks, nodes=nodes)
    if op not in ("all_reduce", "reduce_scatter", "all_gather"):
        raise ValueError(f"NCCL's latency model here covers all_reduce, reduce_scatter and all_gather, not {op!r}")
    a_in, a_net = _link(intra).latency, _link(inter).latency
    n = np.asarray(ranks, dtype=float)
    N = np.minimum(np.asarray(nodes, dtype=float), n)
    base = NCCL_TUNING["base_latency"]
    if algorithm == "ring":
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        net_steps = 2 * (N - 1) if op == "all_reduce" else N - 1
        hop = np.where(N > 1, np.maximum(a_in, NCCL_TUNING["net_overhead"]), a_in)
        t = base + (steps - net_steps) * hop + net_steps * a_net
        if op == "all_reduce":
            t = t * np.where(N > 1, NCCL_TUNING["ring_plateau"], 1.0)
    else:
        if op != "all_reduce":
            raise ValueError(f"NCCL runs {op} as a ring (or PAT/NVLS/CollNet), not a tree; use algorithm='ring'")
        t = base + 2 * ((n / N - 1) * a_in + np.floor(np.log2(np.maximum(N, 1))) * a_net)
    t = np.where(n <= 1, 0.0, t)
    return float(t) if t.ndim == 0 else t


def nccl_time(op: str, nbytes: Any, ranks: Any, local: Any, intra: "Link | str", inter: "Link | str",
              calls: Any = 1) -> dict[str, Any]:
    """Seconds of ``op`` on ``nbytes`` in all, sent as ``calls`` equal calls (gradient buckets) over
    ``ranks`` GPUs of which ``local`` share a node, as NCCL times them: per call, its latency
    (:func:`nccl_latency`) plus the two-level bandwidth time of :func:`hierarchical_time` (intra-node
    reduce-scatter, inter-node ``op`` of S/local on ``inter``, intra-node all-gather; the tree's
    network phase at 0.92 of the ring's bandwidth); NCCL runs the faster of ring and tree per call.
    ``inter`` is one GPU's share of the network (NICs shared, oversubscription applied by the caller).
    With ``inter.in_network_reduction`` (SHARP) an all-reduce across nodes may also run as NCCL's CollNet.
    Returns ``ring``, ``tree`` (inf where NCCL has no tree), ``collnet`` (inf without SHARP) and ``best``;
    arrays broadcast. On a calibrated link (:class:`~dtlib.analytic.measured.MeasuredLink`) each call is the
    measured collective of the whole group (its latency measured with it), not NCCL's model."""
    _check(op, nbytes=nbytes, ranks=ranks, local=local, calls=calls)
    lin, lnet = _link(intra), _link(inter)
    if isinstance(lin, MeasuredLink):
        return _measured_time(op, nbytes, ranks, local, lin, lnet, calls)
    free_in, free_net = replace(lin, latency=0.0), replace(lnet, latency=0.0)
    n, g = np.asarray(ranks, dtype=float), np.maximum(np.asarray(local, dtype=float), 1)
    nodes = np.maximum(np.ceil(n / g), 1)
    per_call = np.asarray(nbytes, dtype=float) / np.maximum(np.asarray(calls, dtype=float), 1)
    intra_bw = 0 * per_call
    if op in ("all_reduce", "reduce_scatter"):
        intra_bw = intra_bw + collective_time("reduce_scatter", per_call, g, free_in)
    if op in ("all_reduce", "all_gather"):
        intra_bw = intra_bw + collective_time("all_gather", per_call, g, free_in)
    net_bw = collective_time(op, per_call / g, nodes, free_net)
    calls = np.maximum(np.asarray(calls, dtype=float), 1)
    ring = calls * (nccl_latency(op, "ring", n, nodes, lin, lnet) + intra_bw + net_bw)
    if op == "all_reduce":
        tree = calls * (nccl_latency(op, "tree", n, nodes, lin, lnet) + intra_bw
                        + net_bw / NCCL_TUNING["tree_bandwidth"])
    else:
        tree = np.full_like(ring, np.inf)
    collnet = np.full_like(ring, np.inf)
    if op == "all_reduce" and lnet.in_network_reduction:
        # SHARP (Graham et al. 2016, "Scalable Hierarchical Aggregation Protocol"): each GPU's S/local share
        # goes up the switches' aggregation tree once and the sum comes down once, instead of the ring's
        # 2(N-1)/N; latency: NCCL's base, the intra-node ring hops, one network hop up and one down
        latency = np.where(n <= 1, 0.0, NCCL_TUNING["base_latency"] + 2 * (n / nodes - 1) * lin.latency
                           + 2 * lnet.latency)
        collnet = np.where(nodes > 1, calls * (latency + intra_bw + per_call / g / lnet.bandwidth), np.inf)
    out = {"ring": ring, "tree": tree, "collnet": collnet, "best": np.minimum(np.minimum(ring, tree), collnet)}
    return {k: (float(v) if np.ndim(v) == 0 else v) for k, v in out.items()}


def _measured_time(op: str, nbytes: Any, ranks: Any, local: Any, intra: MeasuredLink, inter: Link,
                   calls: Any) -> dict[str, Any]:
    """:func:`nccl_time` on a calibrated machine: per call, the measured collective over the group
    inside a node; across nodes the same two levels as :func:`hierarchical_time` (intra-node
    reduce-scatter, ``op`` of S/local across nodes, intra-node all-gather), each phase measured."""
    n, g = np.asarray(ranks, dtype=float), np.maximum(np.asarray(local, dtype=float), 1)
    nodes = np.maximum(np.ceil(n / g), 1)
    calls = np.maximum(np.asarray(calls, dtype=float), 1)
    per_call = np.asarray(nbytes, dtype=float) / calls
    t = collective_time(op, per_call, n.astype(int), intra)
    if np.any(nodes > 1):  # (a profile of one node has no other phases measured)
        across = collective_time(op, per_call / g, nodes.astype(int), inter)
        if op in ("all_reduce", "reduce_scatter"):
            across = across + collective_time("reduce_scatter", per_call, g.astype(int), intra)
        if op in ("all_reduce", "all_gather"):
            across = across + collective_time("all_gather", per_call, g.astype(int), intra)
        t = np.where(nodes > 1, across, t)
    t = calls * t
    return {k: (float(t) if np.ndim(t) == 0 else t) for k in ("ring", "tree", "best")}


def bubble_fraction(pp: Any, num_microbatches: Any, virtual_stages: Any = 1, schedule: str = "1f1b",
                    forward_share: Any = 1 / 3, weight_share: Any = 1 / 3) -> Any:
    """Pipeline bubble time / ideal time: (p-1)/m for GPipe and 1F1B, (p-1)/(v m) interleaved
    (Narayanan et al. 2021, Sec. 2.2). The layout must follow the pipeline rules of
    :data:`dtlib.analytic.layout.RULES` (the same as :func:`~dtlib.analytic.layout.in_flight`).

    DualPipe (DeepSeek-V3 report, Table 2; deepseek-ai/DualPipe's README): a bubble of
    (p/2 - 1)(F&B + B - 3W) against 1F1B's (p-1)(F+B), with F a stage's forward of one micro-batch,
    B its full backward, W the backward's weight-gradient part and F&B a forward and a backward run
    overlapped; overlap hides communication, not compute, so F&B = F + B. In units of F + B, with
    ``forward_share`` F/(F+B) and ``weight_share`` W/(F+B) (default 1/3 each: the backward twice the
    forward, half of it weight gradients), the bubble is (p/2 - 1)(2 - f - 3w)/m. DualPipeV (DualPipe cut in
    half, the README's table: the same bubble over its 2p stages of half a rank's work each):
    (p - 1)(2 - f - 3w)/(2m).
    """
    check_pipeline(pp, num_microbatches, virtual_stages, schedule)
    if schedule in ("dualpipe", "dualpipev"):
        # Table 2's count holds while the weight gradients are no longer than the input gradients (W <= B,
        # w <= (1 - f)/2): replaying the schedules with W > B idles more than it says
        validate.array("forward_share", forward_share, minimum=0, maximum=1)
        validate.array("weight_share", weight_share, minimum=0, exclusive=False,
                       maximum=(1 - np.max(forward_share)) / 2)
    if schedule == "dualpipe":
        return (pp / 2 - 1) * (2 - forward_share - 3 * weight_share) / num_microbatches
    if schedule == "dualpipev":  # DualPipe's bubble with 2 pp stages of half a rank's work each
        return (pp - 1) * (2 - forward_share - 3 * weight_share) / (2 * num_microbatches)
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * num_microbatches)


def cp_kv_width(*, heads: Any, kv_heads: Any, head_dim: Any, kv_lora_rank: Any = 0, qk_nope_head_dim: Any = 0,
                qk_rope_head_dim: Any = 0, v_head_dim: Any = 0, **_model: Any) -> Any:
    """K plus V elements per token of one layer, all heads (before tensor parallelism), as the
    context-parallel ring passes them (scalars or arrays; the keys of
    :meth:`~dtlib.analytic.config.TransformerConfig.numbers`).

    GQA/MHA: ``kv_heads`` K and V heads of ``head_dim`` each (Ainslie et al. 2023; Transformer
    Engine's ``DotProductAttention`` exchanges the ``kv_heads`` groups, not the repeated heads).
    MLA (``kv_lora_rank > 0``): the latent is decompressed before core attention, so the ring passes
    every head's K of ``qk_nope_head_dim + qk_rope_head_dim`` (the shared rope key expanded to each
    head) and V of ``v_head_dim`` (Megatron-Core ``MLASelfAttention.get_query_key_value_tensors``,
    core_v0.16.1: ``key = cat([k_no_pe, k_pos_emb.expand(..., heads, ...)])``, ``value`` of
    ``v_head_dim``, handed to ``TEDotProductAttention`` with ``k_channels``/``v_channels``).
    """
    gqa = 2 * kv_heads * head_dim
    mla = heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)
    latent = np.asarray(kv_lora_rank) > 0
    return np.where(latent, mla, gqa) if latent.ndim else (mla if latent else gqa)


def cp_kv_bytes(n: dict[str, Any], act_bytes: Any) -> Any:
    """Bytes of one layer's K and V all-gathered over the context-parallel group per micro-batch
    (the gathered buffer, as nccl-tests counts it): ``micro_batch_size x seq`` tokens of
    :func:`cp_kv_width` elements, each TP rank holding its ``1/tp`` of the heads. ``n``: layout and
    model numbers (:meth:`Parallelism.numbers` with :meth:`TransformerConfig.numbers`). What
    ``dtlib comm`` (:func:`strategy_volumes`) and ``dtlib plan`` (:mod:`dtlib.plan.steptime`) both use."""
    return n["micro_batch_size"] * n["seq"] * cp_kv_width(**n) * act_bytes / n["tp"]


def strategy_volumes(cfg: TransformerConfig, layout: Parallelism,
                     precision: "Precision | str" = "zero", seq: int | None = None) -> dict[str, dict[str, float]]:
    """Per step, for each strategy: the collective, its buffer size S per call, calls per step,
    group size, and bytes each GPU sends (ring). Sizes in bytes; gradients/params in the working
    dtype, activations in the activation dtype.

    DP: one gradient all-reduce (for an MoE model, the expert gradients in a second one, ``edp_*``,
    over the expert-data-parallel group; ZeRO 1/2: reduce-scatter + all-gather of the updated parameters,
    same volume; ZeRO-3: parameters all-gathered in forward and again in backward plus a gradient
    reduce-scatter, 1.5x: Rajbhandari et al. 2020, Sec. 7). TP: 2 all-reduces per layer forward and
    2 backward on b*s*h activations, +2 with full recompute (Shoeybi et al. 2019, Sec. 3;
    all-gather + reduce-scatter with sequence parallelism, same volume). PP: each boundary sends activations forward and gradients
    back per micro-batch (x v interleaved). CP: K and V all-gathered per layer forward and their
    gradients reduce-scattered in backward. EP (Megatron-Core ``MoEAlltoAllTokenDispatcher``,
    :mod:`dtlib.plan.moe`): per MoE layer of the stage and micro-batch, a dispatch and a combine
    all-to-all forward and the same backward (+2 with full recompute), each of a rank's
    sequence-parallel shard of ``b s / (cp tp)`` tokens (Megatron-Core runs MoE with TP only
    sequence-parallel), ``top_k`` copies of ``h`` (x the capacity factor when set: padded buffers);
    with ``etp > 1`` each is followed by an all-gather (reduce-scatter on the way back) of ``etp``
    x those bytes over the ETP group (``etp_tokens``).
    """
    from dtlib.analytic.memory import memory_per_gpu, rank_parameters  # local imports avoid a cycle
    from dtlib.analytic.stages import rank_layers

    prec = get_precision(precision)
    s = cfg.seq if seq is None else validate.integer("seq", seq)
    h, m, b = cfg.hidden, layout.num_microbatches, layout.micro_batch_size
    unsharded = layout.with_(zero=0, offload="none")
    held = memory_per_gpu(cfg, unsharded, precision=prec, seq=s)
    params_rank = held.parameters / prec.param
    # the most loaded rank's layers (dtlib.analytic.stages), and its expert parameters, reduced
    # over their own group (below)
    n, balanced = unsharded.numbers(**cfg.numbers(s)), layout.account_for_embedding_and_loss
    stage = rank_layers(n, held.stage, balanced, layout.schedule)
    # DualPipe: a micro-batch runs one of the rank's two stages (its weights are both, in held)
    share = 0.5 if layout.schedule == "dualpipe" else 1.0
    layers_here, moe_here = round(share * stage["layers"]), round(share * stage["moe_layers"])
    expert_rank = float(rank_parameters(n, held.stage, balanced, schedule=layout.schedule)["expert"])
    act = b * (s / layout.cp) * h * prec.activation  # one micro-batch's b x s x h activations
    d = layout.dp * layout.cp  # gradients are reduced over the dp x cp replicas
    out: dict[str, dict[str, float]] = {}

    def add(name, op, size, calls, ranks):
        if ranks < 2 or calls == 0:  # this strategy is not in use
            return
        sent = bytes_sent_per_rank(op, size, ranks) * calls
        out[name] = {"collective": op, "bytes": float(size), "calls": float(calls), "ranks": int(ranks),
                     "bytes_sent_per_gpu": float(sent)}

    # dense gradients over the dp x cp replicas, expert ones over the expert-data-parallel group
    # edp = tp x cp x dp / (etp x ep) (Megatron-Core DistributedDataParallel's expert buffers on
    # expt_dp_group; dtlib.plan.moe.expert_grid): one group of the other, each its own collective
    edp = layout.tp * layout.cp * layout.dp // (layout.etp * layout.ep)
    for group, params, ranks in (("dp", params_rank - expert_rank, d), ("edp", expert_rank, edp)):
        if params == 0:  # a dense model has no expert group
            continue
        grads = params * prec.grad
        if layout.zero == 3:
            add(f"{group}_param_gather", "all_gather", params * prec.param, 2, ranks)
            add(f"{group}_grad_reduce_scatter", "reduce_scatter", grads, 1, ranks)
        elif layout.zero in (1, 2):
            add(f"{group}_grad_reduce_scatter", "reduce_scatter", grads, 1, ranks)
            add(f"{group}_param_all_gather", "all_gather", params * prec.param, 1, ranks)
        else:
            add(f"{group}_grad_all_reduce", "all_reduce", grads, 1, ranks)
    # full recompute repeats the forward, and with it the 2 forward all-reduces per layer
    tp_calls = (4 + 2 * (layout.recompute == "full")) * layers_here * m
    add("tp_activations", "all_reduce", act, tp_calls, layout.tp)
    boundaries = chunks_per_rank(layout.schedule, layout.virtual_stages)
    add("pp_activations", "p2p", act / layout.tp if layout.sequence_parallel else act,
        2 * boundaries * m * (layout.pp > 1), 2)
    add("cp_kv", "all_gather", cp_kv_bytes(layout.numbers(**cfg.numbers(s)), prec.activation),
        2 * layers_here * m, layout.cp)
    if cfg.moe_experts:
        moe_calls = (4 + 2 * (layout.recompute == "full")) * moe_here * m
        padded = cfg.moe_capacity_factor or 1
        dispatched = act / layout.tp * cfg.moe_top_k * padded
        add("ep_tokens", "all_to_all", dispatched, moe_calls, layout.ep)
        add("etp_tokens", "all_gather", dispatched * layout.etp, moe_calls, layout.etp)
    return out


def comm_report(op: str, nbytes: float, ranks: int, link: "Link | str",
                algorithms: tuple[str, ...] = ALGORITHMS) -> dict[str, Any]:
    """Time, algbw and busbw of one collective for each algorithm (the ``dtlib comm`` table)."""
    validate.integer("ranks", ranks)
    validate.number("nbytes", nbytes)
    lk = _link(link)
    rows = {}
    for alg in algorithms:
        t = collective_time(op, nbytes, ranks, lk, alg)
        rows[alg] = {"time": t, "algbw": algbw(nbytes, t) if t > 0 else None,
                     "busbw": busbw(op, nbytes, t, ranks) if t > 0 else None}
    return {"collective": op, "bytes": nbytes, "ranks": ranks, "link": lk.name,
            "link_bandwidth": lk.bandwidth, "link_latency": lk.latency, "algorithms": rows}


def tp_layer_times(hidden: Any, tp: Any, link: "Link | str", gpu: str = "h100-sxm",
                   seq: int = 4096, micro_batch_size: int = 1, ffn: Any = None,
                   act_bytes: int = 2, dtype: str = "bf16") -> dict[str, Any]:
    """Communication vs computation of one GPT layer (forward + backward) split ``tp`` ways.

    Communication: 4 all-reduces of ``b*s*h`` activations per layer, 2 forward and 2 backward
    (Shoeybi et al. 2019, Sec. 3), ring time on ``link``. Computation: 3 x the forward matmul
    FLOPs of the layer (weights ``12h^2`` for a GELU MLP of ``ffn = 4h``, plus attention ``4sh``
    per token; :mod:`dtlib.analytic.flops`), divided over ``tp`` GPUs at ``gpu``'s dense peak.
    The ratio grows like ``tp / h``: with a slow link it soon exceeds 1, which is why TP stays
    within a node's NVLink (Narayanan et al. 2021, Sec. 3.3). Arrays broadcast over ``hidden``
    and ``tp``; ``tp = 1`` communicates nothing.
    """
    from dtlib.analytic.flops import attention_flops_per_token, matmul_params_per_layer
    from dtlib.analytic.hardware import get_gpu
    h, t = np.asarray(hidden, dtype=float), np.asarray(tp, dtype=float)
    if np.any(h < 1) or np.any(t < 1) or seq < 1 or micro_batch_size < 1:
        raise ValueError(f"hidden, tp, seq and micro_batch_size must be >= 1, got hidden={hidden}, "
                         f"tp={tp}, seq={seq}, micro_batch_size={micro_batch_size}")
    f = 4 * h if ffn is None else np.asarray(ffn, dtype=float)
    tokens = seq * micro_batch_size
    message = tokens * h * act_bytes
    comm = 4 * collective_time("all_reduce", message, t, link)
    forward = 2 * matmul_params_per_layer(h, 1, 1, f, 2) + attention_flops_per_token(seq, h, 1)
    compute = 3 * forward * tokens / t / get_gpu(gpu).peak(dtype)
    return {"comm_seconds": comm, "compute_seconds": compute, "ratio": comm / compute,
            "message_bytes": message}
