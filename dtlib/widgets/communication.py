"""Communication explorers: ``"bucket_overlap"`` (bucket size -> buckets formed and the overlap
timeline, a real run) and ``"alpha_beta"`` (ranks, link, message size -> modelled time and bus
bandwidth)."""
from __future__ import annotations

import ipywidgets as W
import numpy as np

from dtlib.analytic.comm import busbw, collective_time
from dtlib.analytic.hardware import LINKS, get_link
from dtlib.analytic.units import MiB, format_bytes
from dtlib.experiments.communication import overlap_records
from dtlib.viz.comm import plot_alpha_beta
from dtlib.viz.timeline import plot_overlap_timeline
from dtlib.widgets.base import Explorer, register

__all__ = ["bucket_overlap_explorer", "alpha_beta_explorer"]


def _overlap_result(bucket_mb: float, ranks: int) -> dict:
    name = f"BucketedDDP, {bucket_mb:g} MiB buckets, {ranks} ranks"
    run = overlap_records({name: bucket_mb}, world_size=ranks, warmup=1, repeats=1)[name]
    rec = run["record"]
    return {"name": name, "record": rec, "n_buckets": len(run["buckets"]),
            "bucket_mib": [round(b["bytes"] / MiB, 3) for b in run["buckets"]],
            "overlapped": rec.overlapped_buckets}


@register("bucket_overlap")
def bucket_overlap_explorer() -> Explorer:
    """Bucket size -> how many buckets form, and when each one's all-reduce starts (a real run
    of BucketedDDP on a 6-layer MLP with 1 MiB per layer)."""
    return Explorer(
        {"bucket_mb": W.SelectionSlider(options=[1.0, 2.0, 4.0, 8.0, 25.0], value=2.0,
                                        description="bucket MiB"),
         "ranks": W.IntSlider(value=2, min=2, max=4, description="ranks")},
        compute=_overlap_result,
        plot=lambda r: plot_overlap_timeline({r["name"]: r["record"]}),
        title="Bucketing and overlap, measured: bars left of the dashed line overlap backward")


def _alpha_beta_result(ranks: int, link: str, message: int) -> dict:
    lk = get_link(link)
    sizes = np.logspace(10, 32, 45, base=2)  # 1 KiB .. 4 GiB
    # collective_time's "tree" all-reduce is Rabenseifner's halving-doubling (no tree is built):
    # named for what it is, not for NCCL's double binary tree
    model = {f"{name}, {ranks} ranks": collective_time("all_reduce", sizes, ranks, lk, alg)
             for alg, name in (("ring", "ring"), ("tree", "halving-doubling"))}
    ring = collective_time("all_reduce", message, ranks, lk, "ring")
    tree = collective_time("all_reduce", message, ranks, lk, "tree")
    return {"ranks": ranks, "link": lk.name, "message_bytes": message, "sizes": sizes,
            "model": model, "ring_seconds": ring, "tree_seconds": tree,
            "busbw_ring": busbw("all_reduce", message, ring, ranks),
            # below n * alpha * B the ring's 2(n-1) latency steps cost more than its bytes
            "latency_bound_below_bytes": ranks * lk.latency * lk.bandwidth}


def _alpha_beta_plot(r: dict):
    return plot_alpha_beta(
        r["sizes"], r["model"], r["ranks"], mark=r["message_bytes"],
        title=f"all-reduce over {r['link']}: {format_bytes(r['message_bytes'])} takes "
              f"{1e3 * r['ring_seconds']:.3g} ms (ring) / {1e3 * r['tree_seconds']:.3g} ms (halving-doubling); "
              f"the ring is latency-bound below ~{format_bytes(r['latency_bound_below_bytes'])}")


@register("alpha_beta")
def alpha_beta_explorer() -> Explorer:
    """Ranks, link and message size -> the alpha-beta time and bus bandwidth of the ring and the
    halving-doubling all-reduce (:func:`dtlib.analytic.comm.collective_time`)."""
    sizes = [2 ** k for k in range(10, 33, 2)]
    return Explorer(
        {"ranks": W.SelectionSlider(options=[2, 4, 8, 16, 64, 256, 1024], value=8,
                                    description="ranks"),
         "link": W.Dropdown(options=list(LINKS), value="nvlink4", description="link"),
         "message": W.SelectionSlider(options=[(format_bytes(s), s) for s in sizes],
                                      value=2 ** 26, description="message")},
        compute=_alpha_beta_result, plot=_alpha_beta_plot,
        title="The alpha-beta model: latency-bound small messages, bandwidth-bound large ones")
