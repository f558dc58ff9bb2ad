"""Data-parallel fine-tuning on a few nodes: DDP's gradient buckets, fp16 compression, a flat or a
hierarchical all-reduce, and the predicted weak-scaling efficiency.

PyTorch DDP (Li et al. 2020, "PyTorch Distributed", VLDB, Sec. 3.2.3) all-reduces the gradients in
buckets of ``bucket_cap_mb`` (25 MB by default) as backward produces them, so backward hides the
all-reduces except what is left when it ends: with ``n`` buckets of time ``t_b`` each, the
exposed time is ``max(n t_b - backward, t_b)`` -- the last bucket can only start once backward is
over. Small buckets pay the latency ``n`` times; large ones leave a long last bucket. fp16
compression (DDP's ``fp16_compress_hook``) halves the bytes. Efficiency = time of one GPU's step /
time of the N-GPU step at the same per-GPU batch (weak scaling, as
:func:`dtlib.experiments.scaling_efficiency.scaling_efficiency` measures it).
"""
from __future__ import annotations

import math
from typing import Any, Callable

from dtlib.analytic.comm import collective_time, flat_link, hierarchical_time
from dtlib.analytic.config import TransformerConfig
from dtlib.analytic.hardware import Cluster, cluster
from dtlib.analytic.layout import Parallelism
from dtlib.plan.steptime import StepOptions, step_time

__all__ = ["bucket_exposed_time", "all_reduce_timer", "fine_tuning_efficiency", "DDP_BUCKET_BYTES"]

DDP_BUCKET_BYTES = 25 * 2 ** 20  # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25)


def bucket_exposed_time(grad_bytes: float, bucket_bytes: float, backward: float,
                        all_reduce_time: Callable[[float], float]) -> float:
    """Seconds of all-reduce left after backward with DDP buckets: ``n = ceil(G / bucket)``
    buckets of ``G / n`` bytes, each taking ``all_reduce_time(G / n)`` (see the module docstring)."""
    if not grad_bytes > 0 or not bucket_bytes > 0 or not backward >= 0:
        raise ValueError(f"need grad_bytes > 0, bucket_bytes > 0 and backward >= 0, got "
                         f"{grad_bytes!r}, {bucket_bytes!r}, {backward!r}")
    n = math.ceil(grad_bytes / bucket_bytes)
    one = all_reduce_time(grad_bytes / n)
    return max(n * one - backward, one)


def all_reduce_timer(cl: Cluster, hierarchical: bool = True) -> Callable[[float], float]:
    """Seconds of an all-reduce of ``nbytes`` over all of ``cl``: two-level
    (:func:`dtlib.analytic.comm.hierarchical_time`) or one flat ring (:func:`dtlib.analytic.comm.flat_link`)."""
    if cl.world_size == 1:
        return lambda nbytes: 0.0
    if hierarchical and cl.nodes > 1:
        return lambda nbytes: hierarchical_time("all_reduce", nbytes, cl)["total"]
    return lambda nbytes: collective_time("all_reduce", nbytes, cl.world_size, flat_link(cl))


def fine_tuning_efficiency(model: TransformerConfig, nodes: int, gpus_per_node: int, per_gpu_batch: int, *,
                           gpu: str = "a100-80gb", inter: str = "ib-hdr", fp16_compression: bool = False,
                           hierarchical: bool = True, bucket_bytes: float = DDP_BUCKET_BYTES,
                           options: StepOptions = StepOptions()) -> dict[str, Any]:
    """Predicted weak-scaling efficiency of DDP fine-tuning of ``model`` (fp32 gradients, or fp16
    with compression) on ``nodes`` x ``gpus_per_node`` GPUs; returns the one-GPU step, the
    exposed all-reduce, the efficiency and whether it meets the 80% rule of thumb."""
    one_gpu = cluster(gpu, 1, 1, inter=inter)
    single = step_time(model, Parallelism(micro_batch_size=per_gpu_batch), one_gpu, options=options)
    compute = single.step_time - single.breakdown["optimizer"]
    backward = compute * 2 / 3  # backward is twice the forward (Kaplan et al. 2020, Sec. 2.1)
    grad_bytes = model.num_parameters() * (2 if fp16_compression else 4)
    cl = cluster(gpu, nodes, gpus_per_node, inter=inter)
    exposed = bucket_exposed_time(grad_bytes, bucket_bytes, backward, all_reduce_timer(cl, hierarchical))
    step = single.step_time + exposed
    efficiency = single.step_time / step
    return {"gpus": cl.world_size, "step_1_gpu_s": single.step_time, "exposed_all_reduce_s": exposed,
            "step_s": step, "efficiency": efficiency, "meets_80_percent": efficiency >= 0.8,
            "grad_bytes": grad_bytes, "buckets": math.ceil(grad_bytes / bucket_bytes)}
