"""Job placement: a layout's ranks mapped onto a cluster's GPUs, and the bytes each network tier carries.

A cluster here is the three tiers of a GPU pod (NVIDIA DGX SuperPOD reference architecture: NVLink
inside a node, a leaf (rack) switch joining the nodes of a rack, spine switches joining the racks,
the spine uplinks often oversubscribed):

* ``nvlink`` - both GPUs in one node;
* ``leaf``   - different nodes, same rack (one leaf switch);
* ``spine``  - different racks (leaf -> spine -> leaf).

A *placement* is a list ``gpu[rank]``: rank ``r`` runs on GPU ``gpu[r]``, node ``gpu[r] //
gpus_per_node``, rack ``node // nodes_per_rack``. Megatron-LM numbers ranks TP fastest, then CP,
DP, PP (``megatron/core/parallel_state.py``, ``RankGenerator(order="tp-cp-ep-dp-pp")``), so the
identity placement keeps each TP group on consecutive GPUs -- inside a node when ``tp`` divides
the GPUs per node. A scheduler that numbers GPUs in another order (here ``"naive"``: DP fastest,
TP slowest) or hands out random free GPUs (``"random"``) spreads TP -- the collective on the
critical path of every layer -- across the slow tiers.

Traffic model (per training step, per rank): each group kind's collective is a ring (NCCL's ring
all-reduce / all-gather / reduce-scatter: every rank sends to the next rank of its group); a
pipeline group is a chain (stage ``i`` sends activations to ``i+1`` and gradients back).
``volumes[kind]`` is what one rank sends to its neighbour per step; :func:`step_volumes` derives it
from a transformer's shape. Pure Python: no torch (``tests/test_packaging.py``).
"""
from __future__ import annotations

import random as _random
from dataclasses import dataclass
from typing import Sequence

from dtlib.analytic import validate
from dtlib.analytic.hardware import get_link

__all__ = ["ClusterSpec", "Layout", "TIERS", "PLACEMENTS", "place", "groups", "traffic", "tier_bytes",
           "node_matrix", "check_placement", "step_volumes", "tier_report", "tp_inter_node_bytes"]

TIERS = ("nvlink", "leaf", "spine")
PLACEMENTS = ("megatron", "naive", "random")


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` nodes of ``gpus_per_node`` GPUs, ``nodes_per_rack`` nodes under each leaf switch,
    the spine uplinks ``oversubscription``:1 (1 = non-blocking). Bandwidths in bytes/s per GPU, one
    direction (defaults: NVLink 4 on an H100 as NCCL models it, 370.8 GB/s (``dtlib.analytic.hardware``),
    one 400 Gb/s NIC per GPU 50 GB/s)."""
    nodes: int
    gpus_per_node: int = 8
    nodes_per_rack: int = 4
    oversubscription: float = 1.0
    nvlink_bandwidth: float = get_link("nvlink4").bandwidth
    nic_bandwidth: float = 50e9

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "nodes_per_rack"):
            validate.integer(name, getattr(self, name))
        validate.number("oversubscription", self.oversubscription, minimum=1, exclusive=False)
        validate.number("nvlink_bandwidth", self.nvlink_bandwidth)
        validate.number("nic_bandwidth", self.nic_bandwidth)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def racks(self) -> int:
        return -(-self.nodes // self.nodes_per_rack)

    def node(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def rack(self, gpu: int) -> int:
        return self.node(gpu) // self.nodes_per_rack

    def tier(self, a: int, b: int) -> str:
        """The slowest tier a message from GPU ``a`` to GPU ``b`` crosses."""
        if self.node(a) == self.node(b):
            return "nvlink"
        return "leaf" if self.rack(a) == self.rack(b) else "spine"


@dataclass(frozen=True)
class Layout:
    """Parallel sizes; the world size is ``dp x tp x pp x cp`` (the same grid as
    :class:`dtlib.parallel.mesh.ParallelLayout`, restated here so the planner needs no torch)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            validate.integer(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Megatron's order: ``rank = tp + TP (cp + CP (dp + DP pp))``."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        return {"tp": tp, "cp": cp, "dp": rest % self.dp, "pp": rest // self.dp}


def groups(layout: Layout) -> dict[str, list[list[int]]]:
    """For ``tp``, ``cp``, ``dp`` and ``pp``: the groups of ranks that differ only in that
    coordinate, each in ring/chain order (by that coordinate)."""
    out: dict[str, list[list[int]]] = {}
    coords = [layout.coordinates(r) for r in range(layout.world_size)]
    for kind in ("tp", "cp", "dp", "pp"):
        by_key: dict[tuple[int, ...], list[int]] = {}
        for r, c in enumerate(coords):
            by_key.setdefault(tuple(c[k] for k in ("tp", "cp", "dp", "pp") if k != kind), []).append(r)
        out[kind] = [sorted(g, key=lambda r: coords[r][kind]) for g in by_key.values()]
    return out


def place(layout: Layout, cluster: ClusterSpec, how: str = "megatron", seed: int = 0) -> list[int]:
    """``gpu[rank]`` for ``how`` in :data:`PLACEMENTS`: ``"megatron"`` (rank r on GPU r: TP
    consecutive), ``"naive"`` (the GPUs numbered DP fastest, then PP, CP and TP slowest: what a
    mesh built with its dimensions in the wrong order does), ``"random"`` (a seeded shuffle of the
    first ``world_size`` GPUs: a scheduler handing out whatever is free)."""
    validate.one_of("how", how, PLACEMENTS)
    n = layout.world_size
    if n > cluster.gpus:
        raise ValueError(f"the layout needs {n} GPUs but the cluster has {cluster.gpus} "
                         f"({cluster.nodes} nodes x {cluster.gpus_per_node})")
    if how == "megatron":
        return list(range(n))
    if how == "random":
        gpus = list(range(n))
        _random.Random(seed).shuffle(gpus)
        return gpus
    out = []
    for r in range(n):
        c = layout.coordinates(r)
        out.append(c["dp"] + layout.dp * (c["pp"] + layout.pp * (c["cp"] + layout.cp * c["tp"])))
    return out


def check_placement(gpu: Sequence[int], layout: Layout, cluster: ClusterSpec) -> list[int]:
    """Raise a one-line ValueError unless ``gpu`` gives each rank its own GPU of the cluster."""
    gpu = list(gpu)
    if len(gpu) != layout.world_size:
        raise ValueError(f"a placement needs one GPU per rank: {layout.world_size} entries, got {len(gpu)}")
    for r, g in enumerate(gpu):
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < cluster.gpus:
            raise ValueError(f"rank {r}'s GPU must be an integer in 0..{cluster.gpus - 1}, got {g!r}")
    if len(set(gpu)) != len(gpu):
        twice = sorted({g for g in gpu if gpu.count(g) > 1})
        raise ValueError(f"two ranks on one GPU: GPU(s) {twice[:5]} appear more than once")
    return gpu


def traffic(layout: Layout, volumes: dict[str, float]) -> list[tuple[int, int, str, float]]:
    """Every message of a step as ``(src_rank, dst_rank, kind, bytes)``: rings for tp, cp and dp
    (each rank to the next of its group), a chain both ways for pp."""
    out = []
    for kind, gs in groups(layout).items():
        v = float(volumes.get(kind, 0.0))
        if v <= 0:
            continue
        for g in gs:
            n = len(g)
            if n < 2:
                continue
            if kind == "pp":
                for i in range(n - 1):
                    out.append((g[i], g[i + 1], kind, v))      # activations forward
                    out.append((g[i + 1], g[i], kind, v))      # their gradients back
            else:
                for i in range(n):
                    out.append((g[i], g[(i + 1) % n], kind, v))
    return out


def tier_bytes(layout: Layout, cluster: ClusterSpec, gpu: Sequence[int],
               volumes: dict[str, float]) -> dict[str, dict[str, float]]:
    """Bytes per step crossing each tier, per group kind: ``{kind: {tier: bytes}}`` (every kind
    and tier present, zeros included)."""
    gpu = check_placement(gpu, layout, cluster)
    out = {k: {t: 0.0 for t in TIERS} for k in ("tp", "cp", "dp", "pp")}
    for src, dst, kind, v in traffic(layout, volumes):
        out[kind][cluster.tier(gpu[src], gpu[dst])] += v
    return out


def tp_inter_node_bytes(layout: Layout, cluster: ClusterSpec, gpu: Sequence[int], volume: float = 1.0) -> float:
    """Bytes of tensor-parallel traffic that leave a node (0 when every TP group is inside one)."""
    t = tier_bytes(layout, cluster, gpu, {"tp": volume})["tp"]
    return t["leaf"] + t["spine"]


def node_matrix(layout: Layout, cluster: ClusterSpec, gpu: Sequence[int], volumes: dict[str, float],
                nodes: int | None = None) -> list[list[float]]:
    """``m[a][b]``: bytes per step from node ``a`` to node ``b`` (the diagonal stays in NVLink);
    the first ``nodes`` nodes (default: those the layout occupies)."""
    gpu = check_placement(gpu, layout, cluster)
    n = nodes if nodes is not None else max(cluster.node(g) for g in gpu) + 1
    m = [[0.0] * n for _ in range(n)]
    for src, dst, _kind, v in traffic(layout, volumes):
        a, b = cluster.node(gpu[src]), cluster.node(gpu[dst])
        if a < n and b < n:
            m[a][b] += v
    return m


def step_volumes(hidden: int, layers: int, seq: int, micro_batch_size: int, num_microbatches: int,
                 params: float, layout: Layout, bytes_per_value: int = 2) -> dict[str, float]:
    """What one rank sends to its ring/chain neighbour per step, by kind (bf16 by default).

    * tp: Megatron's 4 all-reduces per layer (2 forward, 2 backward; Shoeybi et al. 2019, Sec. 3) of
      ``b x s x h`` activations, a ring all-reduce sending ``2 (t-1)/t`` of the message per rank,
      for the layers of this stage and every micro-batch;
    * dp: one all-reduce of this rank's gradients, ``params / (tp x pp)`` values, ``2 (d-1)/d`` of them;
    * pp: one ``b x s x h`` activation per micro-batch (and its gradient back);
    * cp: ring attention passes the K/V of its chunk around the ring, ``2 x b x (s/c) x h`` per
      layer per hop, ``c - 1`` hops forward and as many backward.
    """
    L = layout
    act = micro_batch_size * seq * hidden * bytes_per_value
    layers_here = layers / L.pp
    out = {"tp": 0.0, "dp": 0.0, "pp": 0.0, "cp": 0.0}
    if L.tp > 1:
        out["tp"] = 4 * layers_here * num_microbatches * 2 * (L.tp - 1) / L.tp * act / L.cp
    if L.dp > 1:
        out["dp"] = 2 * (L.dp - 1) / L.dp * params / (L.tp * L.pp) * bytes_per_value
    if L.pp > 1:
        out["pp"] = num_microbatches * act / (L.tp * L.cp) * L.tp  # each TP rank sends its copy
    if L.cp > 1:
        out["cp"] = 2 * (L.cp - 1) * layers_here * num_microbatches * 2 * act / (L.cp * L.tp)
    return out


def tier_report(layout: Layout, cluster: ClusterSpec, volumes: dict[str, float],
                placements: Sequence[str] = PLACEMENTS, seed: int = 0) -> dict[str, dict[str, float]]:
    """For each placement: bytes per step over each tier (all kinds together), and ``seconds``:
    the slowest tier's time if every GPU sends at once (NVLink at its bandwidth, a node's NICs
    shared by its GPUs, a rack's spine uplinks divided by the oversubscription)."""
    out = {}
    for how in placements:
        gpu = place(layout, cluster, how, seed)
        per = tier_bytes(layout, cluster, gpu, volumes)
        total = {t: sum(per[k][t] for k in per) for t in TIERS}
        # busiest link of each tier: bytes leaving a GPU over NVLink, a node over its NICs, a rack
        # over its (oversubscribed) uplinks
        out_gpu: dict[int, float] = {}
        out_node: dict[int, float] = {}
        out_rack: dict[int, float] = {}
        for src, dst, _k, v in traffic(layout, volumes):
            a, b = gpu[src], gpu[dst]
            t = cluster.tier(a, b)
            if t == "nvlink":
                out_gpu[a] = out_gpu.get(a, 0.0) + v
            else:
                out_node[cluster.node(a)] = out_node.get(cluster.node(a), 0.0) + v
                if t == "spine":
                    out_rack[cluster.rack(a)] = out_rack.get(cluster.rack(a), 0.0) + v
        rack_bw = cluster.nodes_per_rack * cluster.gpus_per_node * cluster.nic_bandwidth / cluster.oversubscription
        seconds = max([max(out_gpu.values(), default=0) / cluster.nvlink_bandwidth,
                       max(out_node.values(), default=0) / (cluster.gpus_per_node * cluster.nic_bandwidth),
                       max(out_rack.values(), default=0) / rack_bw])
        out[how] = {**total, "seconds": seconds}
    return out
