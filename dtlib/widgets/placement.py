"""Placement explorer ``"placement"``: a layout's ranks on a cluster of racks -> the bytes each
network tier carries per step and the traffic between nodes (:mod:`dtlib.plan.placement`)."""
from __future__ import annotations

import ipywidgets as W

from dtlib.plan.placement import TIERS, ClusterSpec, Layout, node_matrix, place, step_volumes, tier_bytes, tier_report
from dtlib.viz.cluster import plot_placement_traffic
from dtlib.widgets.base import Explorer, register

__all__ = ["placement_explorer"]


def _result(how: str, tp: int, pp: int, gpus_per_node: int, nodes_per_rack: int, oversubscription: float) -> dict:
    dp = max(1, 32 // (tp * pp))
    layout = Layout(dp=dp, tp=tp, pp=pp)
    nodes = -(-layout.world_size // gpus_per_node)
    cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node, nodes_per_rack=nodes_per_rack,
                          oversubscription=oversubscription)
    # a 7B-like model: hidden 4096, 32 layers, seq 4096, micro-batch 1, 8 micro-batches, bf16
    volumes = step_volumes(4096, 32, 4096, 1, 8, 7e9, layout)
    gpu = place(layout, cluster, how, seed=0)
    per = tier_bytes(layout, cluster, gpu, volumes)
    report = tier_report(layout, cluster, volumes, placements=(how,))[how]
    return {"how": how, "layout": layout, "cluster": cluster, "matrix": node_matrix(layout, cluster, gpu, volumes),
            "tiers": {t: sum(per[k][t] for k in per) for t in TIERS}, "seconds": report["seconds"],
            "tp_off_node": per["tp"]["leaf"] + per["tp"]["spine"]}


def _plot(r: dict):
    L = r["layout"]
    return plot_placement_traffic(
        {r["how"]: r}, r["cluster"].nodes_per_rack,
        title=f"dp{L.dp} x tp{L.tp} x pp{L.pp} on {r['cluster'].nodes} nodes: TP bytes leaving a node "
              f"{r['tp_off_node'] / 1e9:.1f} GB, busiest link {1e3 * r['seconds']:.0f} ms per step")


@register("placement")
def placement_explorer() -> Explorer:
    """Which placement keeps tensor parallelism in NVLink, and what the spine then carries."""
    return Explorer(
        {"how": W.Dropdown(options=["megatron", "naive", "random"], value="naive", description="placement"),
         "tp": W.Dropdown(options=[1, 2, 4, 8], value=8, description="tp"),
         "pp": W.Dropdown(options=[1, 2, 4], value=1, description="pp"),
         "gpus_per_node": W.Dropdown(options=[4, 8], value=8, description="GPUs per node"),
         "nodes_per_rack": W.Dropdown(options=[1, 2], value=2, description="nodes per rack"),
         "oversubscription": W.FloatSlider(value=1.0, min=1.0, max=8.0, step=1.0, description="spine oversubscription")},
        compute=_result, plot=_plot,
        title="Placing 32 ranks: bytes per step between nodes (Megatron order vs naive vs random)")
