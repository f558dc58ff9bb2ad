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
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dtlib.analytic import validate
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster
from dtlib.analytic.layout import Parallelism
from dtlib.plan.steptime import StepOptions, step_time

__all__ = ["FatTree", "fat_tree", "leaf_reach_nodes", "dp_time_vs_oversubscription"]


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


def dp_time_vs_oversubscription(model: TransformerConfig, layout: Parallelism, cluster: Cluster,
                                oversubscriptions: list[float], tree: FatTree | None = None,
                                options: StepOptions = StepOptions()) -> dict[str, list[float]]:
    """Data-parallel collective time (before and after overlap) and step time for each
    oversubscription. With ``tree`` given, a DP group whose nodes fit under one leaf
    (:func:`leaf_reach_nodes`) does not see the oversubscription."""
    ranks = layout.dp * layout.cp
    local = max(1, min(ranks, cluster.gpus_per_node // layout.tp)) if layout.tp <= cluster.gpus_per_node else 1
    nodes_spanned = math.ceil(ranks / local)
    out: dict[str, list[float]] = {"oversubscription": [], "dp_comm_unhidden": [], "dp_comm": [], "step_time": []}
    for o in oversubscriptions:
        seen = 1.0 if tree is not None and nodes_spanned <= leaf_reach_nodes(tree, cluster.gpus_per_node) else o
        r = step_time(model, layout, cluster, options=StepOptions(**(asdict(options) | {"oversubscription": seen})))
        out["oversubscription"].append(float(o))
        out["dp_comm_unhidden"].append(r.dp_comm_unhidden)
        out["dp_comm"].append(r.breakdown["dp_comm"])
        out["step_time"].append(r.step_time)
    return out
