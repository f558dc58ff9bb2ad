"""The step-time model: the breakdown sums to the step, and each term equals its closed form written
out by hand here (alpha-beta ring times, Narayanan's bubble and FLOP count, the roofline update)."""
from dataclasses import replace
import math

import numpy as np
import pytest

from dtlib.analytic.comm import nccl_latency
from dtlib.analytic.flops import megatron_flops_per_step
from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import memory_per_gpu
from dtlib.analytic.presets import get_preset
from dtlib.models import TransformerConfig
from dtlib.plan.calibration import ATTENTION_EFFICIENCY, GEMM_EFFICIENCY, efficiency_source
from dtlib.plan.steptime import TERMS, StepOptions, step_time

GPT = TransformerConfig(name="gpt-small", layers=8, hidden=1024, heads=16, vocab=51200, seq=2048,
                        tied_embeddings=True)
NO_OVERLAP = StepOptions(efficiency=0.5, dp_overlap=0.0, tp_overlap=0.0, cp_overlap=0.0, flash_attention=True,
                        grad_reduce_dtype="fp32")


def ring_all_reduce(nbytes, n, link):
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


@pytest.mark.parametrize("layout", [
    Parallelism(dp=16, zero=1, micro_batch_size=2, num_microbatches=4),
    Parallelism(dp=2, tp=4, pp=2, micro_batch_size=1, num_microbatches=8, recompute="full", sequence_parallel=True),
    Parallelism(dp=2, tp=2, pp=4, schedule="interleaved", virtual_stages=2, num_microbatches=8, zero=3),
    Parallelism(dp=4, cp=2, tp=2, recompute="selective", num_microbatches=2),
])
def test_breakdown_sums_to_the_step_and_every_term_is_finite_and_non_negative(layout):
    r = step_time(GPT, layout, cluster("h100-sxm", layout.gpus // 8, 8), options=NO_OVERLAP)
    assert set(r.breakdown) == set(TERMS)
    assert all(math.isfinite(v) and v >= 0 for v in r.breakdown.values())
    assert r.step_time == pytest.approx(sum(r.breakdown.values()), rel=1e-12)
    assert r.tokens_per_second == pytest.approx(layout.global_batch * GPT.seq / r.step_time)


def test_compute_is_narayanan_eq3_over_peak_times_fraction():
    # one GPU, full recompute: hardware FLOPs are eq. (3) of Narayanan et al. 2021
    layout = Parallelism(micro_batch_size=4, recompute="full")
    c = cluster("a100-80gb", 1, 1)
    r = step_time(GPT, layout, c, options=StepOptions(efficiency=0.5))
    flops = megatron_flops_per_step(4, 2048, 8, 1024, 51200, recompute=True)
    assert r.hardware_flops == pytest.approx(flops, rel=1e-9)
    assert r.breakdown["compute"] == pytest.approx(flops / (312e12 * 0.5), rel=1e-9)
    # a single GPU has nothing to communicate
    assert r.breakdown["tp_comm"] == r.breakdown["dp_comm"] == r.breakdown["pp_bubble"] == 0


def test_fp8_speeds_up_only_the_weight_matmuls():
    layout = Parallelism(dp=8, micro_batch_size=1)
    c = cluster("h100-sxm", 1, 8)
    bf16 = step_time(GPT, layout, c, options=StepOptions(efficiency=0.5))
    fp8 = step_time(GPT, layout, c, options=StepOptions(efficiency=0.5, dtype="fp8"))
    s, h, L, V = 2048, 1024, 8, 51200
    weights = 3 * 2 * L * 12 * h * h                       # per token: 3 x forward of 12 h^2 per layer
    rest = 3 * (4 * s * h * L + 2 * h * V)                 # attention products and the LM head
    tokens = 8 * s
    expected = tokens * (weights / 1979e12 + rest / 989.5e12) / (8 * 0.5)
    assert fp8.breakdown["compute"] == pytest.approx(expected, rel=1e-9)
    assert 1 < bf16.breakdown["compute"] / fp8.breakdown["compute"] < 2


def test_pipeline_bubble_is_the_closed_form_of_the_pipelined_work():
    c = cluster("h100-sxm", 1, 8)
    for schedule, v in (("1f1b", 1), ("interleaved", 2)):
        layout = Parallelism(dp=1, tp=2, pp=4, num_microbatches=8, schedule=schedule, virtual_stages=v)
        b = step_time(GPT, layout, c, options=NO_OVERLAP).breakdown
        pipelined = b["compute"] + b["elementwise"] + b["launch"] + b["tp_comm"] + b["cp_comm"] + b["ep_comm"]
        assert b["pp_bubble"] == pytest.approx((4 - 1) / (v * 8) * pipelined, rel=1e-12)


def test_tp_comm_counts_four_all_reduces_per_layer_and_micro_batch_six_with_full_recompute():
    c = cluster("h100-sxm", 1, 8)
    link = c.intra
    act = 2 * 2048 * 1024 * 2      # b s h x 2 bytes, micro-batch 2
    # outside the layers, never recomputed: the embedding's and the output layer's all-reduces, and the
    # loss's 3 of fp32 [b, s] statistics (Megatron-Core, dtlib.plan.vocab_parallel)
    outside = 3 * (2 * ring_all_reduce(act, 8, link) + 3 * ring_all_reduce(2 * 2048 * 4, 8, link))
    for recompute, calls in (("none", 4), ("full", 6)):
        layout = Parallelism(dp=1, tp=8, micro_batch_size=2, num_microbatches=3, recompute=recompute)
        r = step_time(GPT, layout, c, options=NO_OVERLAP)
        assert r.breakdown["tp_comm"] == pytest.approx(calls * 8 * 3 * ring_all_reduce(act, 8, link) + outside,
                                                       rel=1e-12)
    # overlap hides the collectives behind the layers' GEMMs, never more than their time: at tp 8 on this
    # small model the GEMMs are shorter than the all-reduces, so half overlap hides half the GEMM time
    raw = r.breakdown["tp_comm"]
    half = step_time(GPT, layout, c, options=StepOptions(efficiency=0.5, tp_overlap=0.5)).breakdown
    assert half["compute"] < raw
    assert half["tp_comm"] == pytest.approx(raw - 0.5 * half["compute"], rel=1e-12)
    slow = step_time(GPT, layout, c, options=StepOptions(efficiency=0.01, tp_overlap=1.0)).breakdown
    # GEMMs long enough: all of it hidden but the embedding's and the loss's, which have no GEMM beside them
    unhidden = 3 * (ring_all_reduce(act, 8, link) + 3 * ring_all_reduce(2 * 2048 * 4, 8, link))
    assert slow["compute"] > raw and slow["tp_comm"] == pytest.approx(unhidden, rel=1e-12)


def test_dp_all_reduce_is_hierarchical_and_overlap_hides_at_most_the_last_backward():
    c = cluster("h100-sxm", 4, 8)  # 4 nodes: 8 GPUs each reduce-scatter, 4 nodes all-reduce, all-gather
    layout = Parallelism(dp=32, micro_batch_size=1, num_microbatches=2)
    r = step_time(GPT, layout, c, options=NO_OVERLAP)
    params = memory_per_gpu(GPT, layout).parameters / 2          # parameters on a GPU (2 bytes each)
    grads = params * 4                                           # fp32 gradients (NO_OVERLAP's precision)
    calls = math.ceil(params / 40e6)                             # Megatron buckets: max(40M, 1M x 32) params
    bucket = grads / calls
    intra, nic = c.intra, c.inter
    rs = 7 / 8 * bucket / intra.bandwidth                        # intra-node phases: bandwidth only
    net = 2 * 3 / 4 * (bucket / 8) / nic.bandwidth               # 4 nodes all-reduce S/8
    # NCCL tuning.cc latencies (Simple): 62 ring steps of which 6 cross nodes, x1.4 across nodes;
    # tree 2 (7 NVLink + log2(4) network hops); base 8.4 us; tree bandwidth x 0.92
    ring = 1.4 * (8.4e-6 + 56 * intra.latency + 6 * nic.latency) + 2 * rs + net
    tree = 8.4e-6 + 2 * (7 * intra.latency + 2 * nic.latency) + 2 * rs + net / 0.92
    expected = calls * min(ring, tree)
    assert r.breakdown["dp_comm"] == pytest.approx(expected, rel=1e-9)
    overlapped = step_time(GPT, layout, c, options=replace(NO_OVERLAP, dp_overlap=1.0))
    fwd = 2 * 8 * 12 * 1024 ** 2 + 4 * 2048 * 1024 * 8 + 2 * 1024 * 51200
    last_backward = r.breakdown["compute"] / 2 * (2 * fwd) / (3 * fwd)
    # the last bucket's all-reduce starts when the backward has ended: it is never hidden
    assert overlapped.breakdown["dp_comm"] == pytest.approx(max(expected - last_backward, expected / calls), rel=1e-9)
    assert overlapped.dp_comm_unhidden == pytest.approx(expected, rel=1e-9)


def test_oversubscription_slows_only_the_inter_node_phase():
    c = cluster("h100-sxm", 4, 8)
    layout = Parallelism(dp=32)
    one = step_time(GPT, layout, c, options=NO_OVERLAP)
    four = step_time(GPT, layout, c, options=replace(NO_OVERLAP, oversubscription=4))
    assert four.breakdown["dp_comm"] > one.breakdown["dp_comm"]
    assert four.breakdown["compute"] == one.breakdown["compute"]
    inside = cluster("h100-sxm", 1, 8)  # one node: nothing crosses the fabric
    a = step_time(GPT, Parallelism(dp=8), inside, options=NO_OVERLAP)
    b = step_time(GPT, Parallelism(dp=8), inside, options=replace(NO_OVERLAP, oversubscription=4))
    assert a.breakdown["dp_comm"] == b.breakdown["dp_comm"]


def test_optimizer_is_memory_bound_on_the_owned_shard():
    c = cluster("h100-sxm", 1, 8)
    # the gradient norm and the loss: two scalar all-reduces over the 8 GPUs, NCCL's latency only
    # (one node: ring 8.4 us + 14 NVLink hops of 3.4 us; tree 8.4 us + 2 x 7 hops: the same)
    sync = 2 * (8.4e-6 + 14 * 3.4e-6)
    for zero, owners in ((0, 1), (1, 8)):
        layout = Parallelism(dp=8, zero=zero)
        r = step_time(GPT, layout, c, options=NO_OVERLAP)
        params = memory_per_gpu(GPT, layout.with_(zero=0)).parameters / 2
        touched = 2 * (4 + 8) + 4 + 2   # master + Adam read and written, fp32 grad read, bf16 param written
        assert r.breakdown["optimizer"] == pytest.approx(params / owners * touched / 3.35e12 + sync, rel=1e-9)
    # at 16,384 GPUs on 2,048 nodes the tree's 2 log2(2048) network hops set it
    big = step_time(GPT, Parallelism(dp=16384, zero=1), cluster("h100-sxm", 2048, 8), options=NO_OVERLAP)
    shard = memory_per_gpu(GPT, Parallelism(dp=8)).parameters / 2 / 16384
    tree = 8.4e-6 + 2 * (7 * 3.4e-6 + 11 * 14e-6)
    assert big.breakdown["optimizer"] == pytest.approx(shard * (2 * (4 + 8) + 4 + 2) / 3.35e12 + 2 * tree, rel=1e-9)


def test_flash_attention_removes_the_score_traffic():
    c = cluster("a100-80gb", 1, 8)
    layout = Parallelism(dp=8)
    flash = step_time(GPT, layout, c, options=StepOptions(efficiency=0.5, flash_attention=True), dropout=False)
    eager = step_time(GPT, layout, c, options=StepOptions(efficiency=0.5, flash_attention=False), dropout=False)
    # the s x s scores: softmax output, its dropout mask and output are not stored without dropout,
    # so 2 bytes x a s^2 b per layer, written, read and their gradient written
    scores = 2 * 16 * 2048 * 2048 * 1 * 8
    assert eager.breakdown["elementwise"] - flash.breakdown["elementwise"] == pytest.approx(
        3 * scores / 2.039e12, rel=1e-9)


def test_default_compute_is_the_shape_model_with_the_fitted_global_efficiencies():
    # no per-family constant: the same two numbers for every GPU, and they say where they come from
    layout = Parallelism(dp=8, micro_batch_size=2)
    for gpu in ("a100-80gb", "h100-sxm"):
        c = cluster(gpu, 1, 8)
        default = step_time(GPT, layout, c)
        pinned = step_time(GPT, layout, c, options=StepOptions(gemm_efficiency=GEMM_EFFICIENCY,
                                                               attention_efficiency=ATTENTION_EFFICIENCY))
        assert default.breakdown == pinned.breakdown and default.efficiency is None
        slower = step_time(GPT, layout, c, options=StepOptions(gemm_efficiency=GEMM_EFFICIENCY / 2))
        assert slower.breakdown["compute"] > 1.5 * default.breakdown["compute"]
    assert "fitted" in efficiency_source() and f"{GEMM_EFFICIENCY:.2f}" in efficiency_source()


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="fp4"), "dtype must be one of"),
    (dict(efficiency=0.0), "efficiency must be a finite number > 0 and <= 1, got 0.0"),
    (dict(efficiency=1.5), "efficiency must be"),
    (dict(dp_overlap=-0.1), "dp_overlap must be a finite number >= 0 and <= 1, got -0.1"),
    (dict(flash_attention="yes"), "flash_attention must be True or False"),
    (dict(oversubscription=0.5), "oversubscription must be a finite number >= 1"),
    (dict(oversubscription=float("inf")), "oversubscription must be a finite number >= 1"),
    (dict(attention="sparse"), "attention must be one of"),
    (dict(precision="fp64"), "unknown precision"),
])
def test_bad_options_say_what_is_valid(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepOptions(**kwargs)


def test_layout_must_use_the_cluster_and_a_shape():
    with pytest.raises(ValueError, match="uses dp x tp x pp x cp = 4 GPUs but the cluster has 8"):
        step_time(GPT, Parallelism(dp=4), cluster("h100-sxm", 1, 8))
    with pytest.raises(ValueError, match="model must be a TransformerConfig"):
        step_time(7e9, Parallelism(dp=8), cluster("h100-sxm", 1, 8))
    with pytest.raises(ValueError, match="has no fp8 peak"):
        step_time(GPT, Parallelism(dp=8), cluster("a100-80gb", 1, 8), options=StepOptions(dtype="fp8"))


def test_moe_layers_pay_all_to_all_and_dense_layers_do_not():
    moe = get_preset("llama3-8b").with_(name="moe", moe_experts=8, moe_top_k=2, layers=4, seq=1024)
    c = cluster("h100-sxm", 1, 8)
    r = step_time(moe, Parallelism(dp=8, ep=4), c, options=NO_OVERLAP)
    assert r.breakdown["ep_comm"] > 0
    act = 1 * 1024 * 4096 * 2 * 2   # b s h x 2 bytes x top_k
    link = c.intra
    # NCCL runs the 3 peers' rounds in one batch: one latency (dtlib.plan.moe.P2P_PER_BATCH)
    one = link.latency + 3 / 4 * act / link.bandwidth
    probs = link.latency + 3 / 4 * act / (4096 * 2) * 4 / link.bandwidth  # top_k fp32 router probabilities
    # per MoE layer: the tokens' 4 all-to-alls, the probabilities' 2 (alltoall dispatcher, dtlib.plan.moe),
    # the token counts all-gathered over the 4 EP ranks and the host's block before the forward's
    metadata = nccl_latency("all_gather", "ring", 4, 1, link, c.inter) + c.gpu.kernel_launch_s
    assert r.breakdown["ep_comm"] == pytest.approx(4 * (4 * one + 2 * probs + metadata), rel=1e-9)
    dense = step_time(moe.with_(moe_experts=0, moe_top_k=0), Parallelism(dp=8), c, options=NO_OVERLAP)
    assert dense.breakdown["ep_comm"] == 0
    assert np.isfinite(r.step_time)
