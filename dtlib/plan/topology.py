"""The fabric between nodes: fat-trees of k-port switches, rail-optimised wiring, oversubscription.

A fat-tree (Leiserson 1985; the k-ary folded Clos of Al-Fares et al. 2008, "A Scalable, Commodity
Data Center Network Architecture", Sec. 3) built from k-port switches:

* one tier: one switch, up to k endpoints;
* two tiers (leaf-spine): each leaf gives ``down`` ports to endpoints and ``k - down`` to spines;
  at most k leaves, so up to ``k x down`` endpoints;
* three tiers: pods of k/2 leaves and k/2 aggregation switches, at most k pods joined by core
  switches, so up to ``k x k/2 x down`` endpoints (k^3/4 without oversubscription, Al-Fares Sec. 3.2).

Non-blocking means ``down = k/2``. An oversubscription ``o`` gives each leaf ``down = k o/(1+o)``
ports down for ``k/(1+o)`` up, and divides the bandwidth leaving a leaf by ``o`` (Meta's 24,576-GPU
clusters: 7:1 above a 3,072-GPU pod; dtlib's shared notes). Endpoints are NICs: one per GPU.

Rail-optimised (NVIDIA DGX SuperPOD reference architecture): NIC i of every node goes to the leaf
of rail i, so GPU i of up to ``down`` nodes is one switch away, and traffic between different
ranks crosses NVLink first (PXN). The switch count equals the plain fat-tree's; what changes is
which collectives stay under one leaf: a data-parallel group of same-rank GPUs over at most
``down`` nodes never meets the oversubscription.

Scale: :func:`weak_scaling` grows the data-parallel size at a fixed per-GPU batch and layout,
builds the fat-tree each cluster needs, and times the step; the DP collectives then grow through
NCCL's latency terms (ring 2(n-1) hops, tree 2 log2 N network hops, :func:`dtlib.analytic.comm.nccl_latency`)
and, once the group outgrows one leaf, the fabric's oversubscription (docs/hardware.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster, replace_nodes
from dtlib.analytic.layout import Parallelism
from dtlib.plan.steptime import StepOptions, step_time

__all__ = ["FatTree", "fat_tree", "leaf_reach_nodes", "seen_oversubscription", "dp_time_vs_oversubscription",
           "weak_scaling"]


@dataclass(frozen=True)
class FatTree:
    """Switch counts per tier, links, and bisection bandwidth (bytes/s, one direction)."""
    endpoints: int
    radix: int
    tiers: int
    down_ports: int
    leaf: int
    spine: int
    core: int
    links: int
    max_endpoints: int
    bisection_bandwidth: float
    oversubscription: float
    rail_optimised: bool

    @property
    def switches(self) -> int:
        return self.leaf + self.spine + self.core

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"switches": self.switches}


def _down_ports(k: int, oversubscription: float) -> int:
    return max(1, min(k - 1, round(k * oversubscription / (1 + oversubscription))))


def fat_tree(endpoints: int, radix: int = 64, link_bandwidth: float = 50e9, oversubscription: float = 1.0,
             rail_optimised: bool = False) -> FatTree:
    """The smallest fat-tree of ``radix``-port switches for ``endpoints`` NICs (e.g. 64 for an
    NVIDIA Quantum-2 NDR switch, 144 for Quantum-X800; ``link_bandwidth`` 50e9 B/s = NDR 400 Gb/s).
    Raises if even three tiers are too few."""
    validate.integer("endpoints", endpoints)
    if validate.integer("radix", radix, minimum=4) % 2:
        raise ValueError(f"radix must be an even number of switch ports >= 4, got {radix}")
    validate.number("oversubscription", oversubscription, minimum=1, exclusive=False)
    validate.number("link_bandwidth", link_bandwidth)
    k, n = radix, endpoints
    down = _down_ports(k, oversubscription)
    up = k - down
    bisection = n * link_bandwidth / (2 * oversubscription)
    if n <= k:
        return FatTree(n, k, 1, k, 1, 0, 0, n, k, n * link_bandwidth / 2, 1.0, rail_optimised)
    leaves = math.ceil(n / down)
    if n <= k * down:
        spines = math.ceil(leaves * up / k)
        return FatTree(n, k, 2, down, leaves, spines, 0, n + leaves * up, k * down, bisection,
                       oversubscription, rail_optimised)
    per_pod = (k // 2) * down
    if n > k * per_pod:
        raise ValueError(f"{n} endpoints exceed a three-tier fat-tree of {k}-port switches "
                         f"({k * per_pod} at oversubscription {oversubscription:g}); use larger switches")
    pods = math.ceil(n / per_pod)
    aggregation = pods * (k // 2)
    core = math.ceil(aggregation * (k // 2) / k)
    return FatTree(n, k, 3, down, leaves, aggregation, core, n + leaves * up + aggregation * (k // 2),
                   k * per_pod, bisection, oversubscription, rail_optimised)


def leaf_reach_nodes(tree: FatTree, gpus_per_node: int) -> int:
    """Nodes whose same-rank GPUs share one leaf: ``down`` on rails, ``down / gpus_per_node``
    when a node's NICs all land on one leaf (the plain fat-tree)."""
    return tree.down_ports if tree.rail_optimised else max(1, tree.down_ports // gpus_per_node)


def seen_oversubscription(tree: FatTree, layout: Parallelism, cluster: Cluster) -> float:
    """The oversubscription ``layout``'s data-parallel group meets on ``tree``: none while the
    nodes it spans (its ``dp x cp`` ranks, ``gpus_per_node / tp`` of them per node) hang under one
    leaf (:func:`leaf_reach_nodes`), the tree's otherwise."""
    ranks = layout.dp * layout.cp
    local = max(1, min(ranks, cluster.gpus_per_node // layout.tp)) if layout.tp <= cluster.gpus_per_node else 1
    nodes_spanned = math.ceil(ranks / local)
    return 1.0 if nodes_spanned <= leaf_reach_nodes(tree, cluster.gpus_per_node) else tree.oversubscription


def dp_time_vs_oversubscription(model: TransformerConfig, layout: Parallelism, cluster: Cluster,
                                oversubscriptions: list[float], tree: FatTree | None = None,
                                options: StepOptions = StepOptions()) -> dict[str, list[float]]:
    """Data-parallel collective time (before and after overlap) and step time for each
    oversubscription. With ``tree`` given, a DP group whose nodes fit under one leaf
    (:func:`leaf_reach_nodes`) does not see the oversubscription."""
    out: dict[str, list[float]] = {"oversubscription": [], "dp_comm_unhidden": [], "dp_comm": [], "step_time": []}
    for o in oversubscriptions:
        seen = o if tree is None else min(o, seen_oversubscription(replace(tree, oversubscription=o), layout, cluster))
        r = step_time(model, layout, cluster, options=StepOptions(**(asdict(options) | {"oversubscription": seen})))
        out["oversubscription"].append(float(o))
        out["dp_comm_unhidden"].append(r.dp_comm_unhidden)
        out["dp_comm"].append(r.breakdown["dp_comm"])
        out["step_time"].append(r.step_time)
    return out


def weak_scaling(model: TransformerConfig, layout: Parallelism, cluster: Cluster, nodes: "list[int]", *,
                 options: StepOptions = StepOptions(), radix: int = 64, oversubscription: float = 1.0,
                 rail_optimised: bool = True) -> dict[str, list[float]]:
    """Step time of ``layout`` (tp, pp, cp, micro-batches fixed: the same per-GPU batch) as the
    data-parallel size grows to fill ``cluster``'s GPUs on each node count in ``nodes``.

    Each cluster gets the fat-tree of ``radix``-port switches its NICs need (:func:`fat_tree`,
    ``oversubscription`` above the leaf, ``rail_optimised`` wiring); the DP group meets the
    oversubscription once it outgrows a leaf (:func:`seen_oversubscription`). Returns per node
    count: ``gpus``, ``dp``, ``step_time``, ``dp_comm`` (exposed), ``dp_comm_unhidden``, the
    ``oversubscription`` seen, and ``growth`` = step time / the first one - 1."""
    per_node = layout.tp * layout.pp * layout.cp
    out: dict[str, list[float]] = {k: [] for k in ("nodes", "gpus", "dp", "step_time", "dp_comm",
                                                   "dp_comm_unhidden", "oversubscription", "growth")}
    for count in nodes:
        c = replace_nodes(cluster, validate.integer("nodes", count))
        if c.world_size % per_node:
            raise ValueError(f"{c.world_size} GPUs do not hold whole tp x pp x cp = {per_node} groups; "
                             f"valid: node counts making nodes x {cluster.gpus_per_node} a multiple of {per_node}")
        scaled = layout.with_(dp=c.world_size // per_node)
        tree = fat_tree(c.nodes * c.nics_per_node, radix, c.inter.bandwidth, oversubscription, rail_optimised)
        seen = seen_oversubscription(tree, scaled, c)
        r = step_time(model, scaled, c, options=replace(options, oversubscription=seen))
        for key, value in (("nodes", count), ("gpus", c.world_size), ("dp", scaled.dp), ("step_time", r.step_time),
                           ("dp_comm", r.breakdown["dp_comm"]), ("dp_comm_unhidden", r.dp_comm_unhidden),
                           ("oversubscription", seen), ("growth", r.step_time / (out["step_time"] or [r.step_time])[0] - 1)):
            out[key].append(float(value))
    return out
