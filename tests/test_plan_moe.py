"""MoE in the step time and the search: the EP all-to-all moves exactly the routed tokens, on NVLink
while the EP group's ranks share a node and through the NICs otherwise (Megatron-Core's expert
grid), expert gradients are reduced over the expert-data-parallel group, load imbalance scales
only the expert terms, and the search enumerates ep and etp by Megatron-Core's rule.
Hand-written closed forms: the pairwise all-to-all and ring collectives of the alpha-beta table in
dtlib.analytic.comm."""
import math
from dataclasses import replace

import numpy as np
import pytest

from dtlib.analytic.comm import collective_time, nccl_latency, nccl_time
from dtlib.analytic.hardware import Link, cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.memory import stage_parameters
from dtlib.analytic.validate import InvalidArgument
from dtlib.models import TransformerConfig
from dtlib.plan import moe as plan_moe
from dtlib.plan.moe import (all_to_all_time, ep_comm_time, expert_grid, expert_rows, grouped_gemm_overhead,
                            moe_numbers, permutation_bytes)
from dtlib.plan.search import search, to_layout
from dtlib.plan.steptime import StepOptions, step_time
from dtlib.plan.vocab_parallel import vocab_parallel_collectives

MOE = TransformerConfig(name="moe-small", layers=4, hidden=512, heads=8, vocab=4096, seq=1024,
                        activation="swiglu", bias=False, norm="rmsnorm", position="rope",
                        moe_experts=24, moe_top_k=2, moe_ffn=256)
DENSE = MOE.with_(name="dense-small", moe_experts=0, moe_top_k=0, moe_ffn=None)
OPTIONS = StepOptions(flash_attention=True, dp_overlap=0.0)
# the token all-to-alls alone: padded buffers of exactly the balanced load (no metadata step, the same
# bytes) and the flex dispatcher (no probabilities all-to-all)
TOKENS_ONLY, MOE_PADDED = replace(OPTIONS, moe_dispatcher="flex"), MOE.with_(moe_capacity_factor=1.0)


def pairwise(nbytes, n, link):
    """NCCL's all-to-all of nbytes per rank inside one link: (n-1)/n of the buffer and the peers' rounds
    in batches of 8, one latency each (dtlib.plan.moe, not the comm module's (n-1) latencies)."""
    return math.ceil((n - 1) / plan_moe.P2P_PER_BATCH) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def ring_phase(nbytes, n, link):
    """Ring reduce-scatter or all-gather of an nbytes buffer."""
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def nic(c):
    """One GPU's share of the node's NICs (no oversubscription)."""
    return c.inter.latency, c.inter_bandwidth_per_gpu


def _nic_link(c):
    """The NIC share as a link (the step time's inter-node link)."""
    return Link("nic", c.inter_bandwidth_per_gpu, c.inter.latency, "")


def routed_bytes(layout, model=MOE):
    """Bytes one rank dispatches per all-to-all: its sequence-parallel shard of b s tokens, top_k
    copies of h values in bf16."""
    return layout.micro_batch_size * model.seq / (layout.cp * layout.tp) * model.moe_top_k * model.hidden * 2


@pytest.mark.parametrize("layout", [Parallelism(dp=16, ep=8), Parallelism(dp=4, tp=2, cp=2, ep=4,
                                    sequence_parallel=True), Parallelism(dp=2, tp=8, ep=8, sequence_parallel=True,
                                    micro_batch_size=2)])
def test_the_all_to_all_moves_exactly_the_routed_tokens(layout):
    """Summed over the tp x cp x dp ranks of a stage, one call's buffers are every token of the
    step's micro-batch routed top_k times: nothing duplicated across TP or CP ranks, nothing lost."""
    n = MOE.numbers() | layout.numbers()
    r = ep_comm_time(b=layout.micro_batch_size, s=MOE.seq, h=MOE.hidden, tp=layout.tp, cp=layout.cp,
                     dp=layout.dp, ep=layout.ep, moe=moe_numbers(n), load=1.0, act_bytes=2, calls=1, forwards=1,
                     gpus_per_node=8, intra=cluster().intra, inter=cluster().inter, kernel_launch_s=3e-6,
                     dispatcher="alltoall")
    ranks = layout.dp * layout.tp * layout.cp
    tokens = layout.dp * layout.micro_batch_size * MOE.seq
    assert r["bytes_per_call"] * ranks == pytest.approx(tokens * MOE.moe_top_k * MOE.hidden * 2, rel=1e-12)


def extras(layout, c, per, load=1.0, dropless=True):
    """What the alltoall dispatcher adds to the tokens' all-to-alls over ``per`` MoE layers x
    micro-batches inside one node: the probabilities' all-to-all beside each dispatch (2), and,
    dropless, the metadata step before each forward (1)."""
    probs = routed_bytes(layout) / (MOE.hidden * 2) * 4 * load
    return 2 * per * pairwise(probs, layout.ep, c.intra) + dropless * per * metadata(layout, c)


def metadata(layout, c):
    """The alltoall dispatcher's step before each forward all-to-all: the int64 token counts per expert
    all-gathered over the etp x ep group, at NCCL's ring latency (a few KB), then the host's block on
    their copy, after which the all-to-all is launched on an idle GPU (one launch floor)."""
    return nccl_latency("all_gather", "ring", layout.ep * layout.etp, 1, c.intra, c.inter) + c.gpu.kernel_launch_s


def test_ep_comm_is_dispatch_and_combine_forward_and_backward_by_hand():
    """Megatron-Core's alltoall dispatcher per MoE layer and micro-batch: the tokens' dispatch and
    combine all-to-alls forward and backward (4), the probabilities' all-to-all beside each dispatch
    (2: top_k fp32 values per token), and the metadata step before each forward (1)."""
    layout = Parallelism(dp=8, tp=2, ep=4, sequence_parallel=True, num_microbatches=3)
    c = cluster("h100-sxm", 2, 8)
    r = step_time(MOE, layout, c, options=OPTIONS)
    per = MOE.layers * 3  # MoE layers x micro-batches
    probs = routed_bytes(layout) / (MOE.hidden * 2) * 4
    a2a = 4 * per * pairwise(routed_bytes(layout), 4, c.intra) + 2 * per * pairwise(probs, 4, c.intra)
    assert r.breakdown["ep_comm"] == pytest.approx(a2a + per * metadata(layout, c), rel=1e-12)
    full = step_time(MOE, layout.with_(recompute="full"), c, options=OPTIONS)  # every forward once more
    assert full.breakdown["ep_comm"] == pytest.approx(1.5 * a2a + 2 * per * metadata(layout, c), rel=1e-12)
    hidden = step_time(MOE, layout, c, options=StepOptions(flash_attention=True, dp_overlap=0.0, ep_overlap=0.25))
    assert r.breakdown["ep_comm"] < r.breakdown["compute"]  # compute enough to hide what is asked
    # the overlap hides the all-to-alls, not the metadata step before them
    assert hidden.breakdown["ep_comm"] == pytest.approx(0.75 * a2a + per * metadata(layout, c), rel=1e-12)
    # the flex dispatcher carries the probabilities in its dispatch kernel; padded buffers need no metadata
    flex = step_time(MOE, layout, c, options=replace(OPTIONS, moe_dispatcher="flex"))
    assert flex.breakdown["ep_comm"] == pytest.approx(4 * per * pairwise(routed_bytes(layout), 4, c.intra)
                                                      + per * metadata(layout, c), rel=1e-12)
    padded = step_time(MOE.with_(moe_capacity_factor=1.0), layout, c, options=OPTIONS)
    assert padded.breakdown["ep_comm"] == pytest.approx(a2a, rel=1e-12)


def test_an_unknown_dispatcher_is_refused_by_name():
    with pytest.raises(InvalidArgument, match="moe_dispatcher"):
        StepOptions(moe_dispatcher="allgather")
    with pytest.raises(InvalidArgument, match="moe_dispatcher"):
        ep_comm_time(b=1, s=MOE.seq, h=MOE.hidden, tp=1, cp=1, dp=8, ep=8, moe=moe_numbers(MOE.numbers()), load=1.0,
                     act_bytes=2, calls=4, forwards=1, gpus_per_node=8, intra=cluster().intra, inter=cluster().inter,
                     kernel_launch_s=3e-6, dispatcher="deepep")


def test_the_metadata_all_gather_crosses_the_nodes_the_ep_group_spans():
    """ep 16 over 8-GPU nodes: NCCL's ring over 16 ranks on 2 nodes pays one network hop each way more
    than inside one 16-GPU domain."""
    layout = Parallelism(dp=16, ep=16)
    apart, together = cluster("h100-sxm", 2, 8), cluster("h100-sxm", 1, 16)
    r = ep_comm_time(b=1, s=MOE.seq, h=MOE.hidden, tp=1, cp=1, dp=16, ep=16, moe=moe_numbers(MOE.numbers()),
                     load=1.0, act_bytes=2, calls=0, forwards=1, gpus_per_node=8, intra=apart.intra,
                     inter=apart.inter, kernel_launch_s=0.0, dispatcher="alltoall")
    assert r["metadata"] == pytest.approx(nccl_latency("all_gather", "ring", 16, 2, apart.intra, apart.inter))
    assert r["metadata"] > nccl_latency("all_gather", "ring", 16, 1, together.intra, together.inter) > 0


def test_ep_overlap_hides_no_more_than_the_moe_layers_compute():
    """Across a slow fabric the all-to-all outlasts the compute another micro-batch can run beside it
    (DualPipe / --overlap-moe-expert-parallel-comm): full overlap leaves the difference exposed."""
    layout = Parallelism(dp=8, ep=8, num_microbatches=2)
    # one GPU a node, every peer over a 10 Gb/s NIC (a 200 Gb/s one hides behind this small model's compute)
    slow = replace(cluster("h100-sxm", 8, 1, inter="ib-hdr"), inter=Link("10g", 1.25e9, 14e-6, "a 10 Gb/s NIC"))
    exposed = step_time(MOE, layout, slow, options=OPTIONS)
    overlapped = step_time(MOE, layout, slow, options=StepOptions(flash_attention=True, dp_overlap=0.0,
                                                                   ep_overlap=1.0))
    per = MOE.layers * 2
    before = per * (nccl_latency("all_gather", "ring", 8, 8, slow.intra, _nic_link(slow)) + slow.gpu.kernel_launch_s)
    raw, compute = exposed.breakdown["ep_comm"] - before, exposed.breakdown["compute"]
    assert raw > compute > 0  # every layer of MOE is an MoE layer
    assert overlapped.breakdown["ep_comm"] == pytest.approx(raw - compute + before, rel=1e-12)


def test_placement_leaves_nvlink_when_tp_x_ep_crosses_the_node_and_not_in_an_nvl72_rack():
    # tp 2 x ep 12 = 24 consecutive ranks (Megatron-Core: expert-tensor ranks adjacent, then EP)
    layout = Parallelism(dp=36, tp=2, ep=12, etp=2, sequence_parallel=True)
    nbytes = routed_bytes(layout)
    calls = 4 * MOE.layers
    hgx, nvl72 = cluster("h100-sxm", 9, 8), cluster("h100-sxm", 1, 72)
    across = step_time(MOE_PADDED, layout, hgx, options=TOKENS_ONLY).breakdown["ep_comm"]
    inside = step_time(MOE_PADDED, layout, nvl72, options=TOKENS_ONLY).breakdown["ep_comm"]
    etp_phases = calls * ring_phase(2 * nbytes, 2, hgx.intra)  # the ETP all-gather/reduce-scatter, in a node
    # 8-GPU nodes: 4 of the 12 EP ranks share a node; 8/12 of the buffer leaves through the NIC share
    latency, bandwidth = nic(hgx)
    batches = math.ceil(11 / plan_moe.P2P_PER_BATCH)  # NCCL runs 8 peers' p2p rounds at once
    by_hand = batches * latency + max(3 / 12 * nbytes / hgx.intra.bandwidth, 8 / 12 * nbytes / bandwidth)
    assert across == pytest.approx(calls * by_hand + etp_phases, rel=1e-12)
    # a 72-GPU NVLink domain holds the 24 ranks (72 is a multiple of 24): NVLink only
    assert inside == pytest.approx(calls * pairwise(nbytes, 12, nvl72.intra) + etp_phases, rel=1e-12)
    assert across > 3 * inside


def test_a_group_straddling_two_racks_pays_the_nic_even_when_it_is_smaller_than_the_rack():
    """Groups of 16 ranks start at multiples of 16, racks at multiples of 72: the group at ranks
    64-79 has 8 ranks in each rack, so the all-to-all of that layout is paced by the NICs."""
    grid = expert_grid(tp=1, cp=1, dp=144, ep=16, etp=1, gpus_per_node=72)
    assert grid["ep_local"] == 8 and grid["edp"] == 9
    assert expert_grid(tp=1, cp=1, dp=144, ep=8, etp=1, gpus_per_node=72)["ep_local"] == 8  # 72 = 9 x 8
    c = cluster("h100-sxm", 2, 72)
    latency, bandwidth = nic(c)
    t = all_to_all_time(1e6, 16, 8, c.intra, Link("nic share", bandwidth, latency, "one GPU's share"))
    assert t == pytest.approx(2 * latency + max(7 / 16 * 1e6 / c.intra.bandwidth, 8 / 16 * 1e6 / bandwidth))


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group():
    """tp 1, dp 8 in one node: dense gradients all-reduced over 8 ranks, expert ones over
    edp = 8 / ep ranks (reduce-scatter + all-gather inside the node): with ep 1 the same 8 ranks
    as the dense ones, with ep 8 none."""
    c = cluster("h100-sxm", 1, 8)
    prec_grad = 2  # the megatron stack: bf16 gradients (Megatron-Core DDP default)
    for ep, edp in ((1, 8), (4, 2), (8, 1)):
        layout = Parallelism(dp=8, ep=ep)
        r = step_time(MOE, layout, c, options=OPTIONS)
        params = stage_parameters(**(MOE.numbers() | layout.numbers()))["first"]
        dense, expert = params["dense"] * prec_grad, params["expert"] * prec_grad
        # each group as NCCL times it (dtlib.analytic.comm.nccl_time, tested on its own in
        # test_scale_effects), in Megatron's buckets of max(40M, 1M x ranks) parameters
        def reduce(nbytes, ranks):
            calls = math.ceil(nbytes / prec_grad / max(40e6, 1e6 * ranks))
            return float(nccl_time("all_reduce", nbytes, ranks, ranks, c.intra, c.inter, calls)["best"])
        by_hand = reduce(dense, 8) + (edp > 1) * reduce(expert, edp)
        assert expert > 0 and r.dp_comm_unhidden == pytest.approx(by_hand, rel=1e-12)
        assert (r.breakdown["ep_comm"] == 0) == (ep == 1)  # one EP rank: no all-to-all


def test_imbalance_scales_only_the_expert_terms():
    layout = Parallelism(dp=8, ep=8, num_microbatches=2)
    c = cluster("h100-sxm", 1, 8)
    even = step_time(MOE, layout, c, options=OPTIONS)
    skewed = step_time(MOE, layout, c, options=StepOptions(flash_attention=True, dp_overlap=0.0, moe_imbalance=2.0))
    for term in ("tp_comm", "cp_comm", "pp_p2p", "dp_comm", "optimizer"):
        assert skewed.breakdown[term] == even.breakdown[term]
    # elementwise: only the sort of the received rows by local expert grows (8 passes, 1 more load)
    sorted_rows = 8 * routed_bytes(layout) * MOE.layers * 2 / c.gpu.memory_bandwidth
    assert skewed.breakdown["elementwise"] - even.breakdown["elementwise"] == pytest.approx(sorted_rows, rel=1e-9)
    # the all-to-all's bandwidth part doubles, its latency does not
    calls = 4 * MOE.layers * 2
    bandwidth_part = calls * 7 / 8 * routed_bytes(layout) / c.intra.bandwidth
    bandwidth_part += calls / 2 * 7 / 8 * routed_bytes(layout) / (MOE.hidden * 2) * 4 / c.intra.bandwidth  # probs
    assert skewed.breakdown["ep_comm"] - even.breakdown["ep_comm"] == pytest.approx(bandwidth_part, rel=1e-9)
    assert skewed.breakdown["compute"] > even.breakdown["compute"]  # the busiest rank's expert GEMMs
    # a dense model has no experts to unbalance, nor an all-to-all to overlap
    dense = [step_time(DENSE, Parallelism(dp=8), c, options=StepOptions(flash_attention=True, **kw))
             for kw in ({}, {"moe_imbalance": 3.0, "ep_overlap": 0.5})]
    assert dense[0].breakdown == dense[1].breakdown and dense[0].breakdown["ep_comm"] == 0


def test_a_capacity_factor_pads_every_expert_to_capacity_whatever_the_imbalance():
    layout = Parallelism(dp=8, ep=8)
    c = cluster("h100-sxm", 1, 8)
    capped = MOE.with_(moe_capacity_factor=1.25)
    times = [step_time(capped, layout, c, options=StepOptions(flash_attention=True, moe_imbalance=x)).breakdown
             for x in (1.0, 4.0)]
    assert times[0] == times[1]
    calls = 4 * MOE.layers
    assert times[0]["ep_comm"] == pytest.approx(calls * pairwise(1.25 * routed_bytes(layout), 8, c.intra)
                                                + extras(layout, c, MOE.layers, 1.25, dropless=False), rel=1e-12)


def test_dense_layers_of_an_moe_model_cost_what_a_dense_model_s_layers_cost():
    """First-k-dense (DeepSeek): the all-to-all runs in the MoE layers only, and the GEMM time is
    the dense model's for the dense layers plus the all-MoE model's for the rest."""
    layout = Parallelism(dp=8, ep=8)
    c = cluster("h100-sxm", 1, 8)
    mixed = step_time(MOE.with_(moe_dense_layers=1), layout, c, options=OPTIONS)
    all_moe = step_time(MOE, layout, c, options=OPTIONS)
    dense = step_time(DENSE, Parallelism(dp=8), c, options=OPTIONS)
    assert mixed.breakdown["ep_comm"] == pytest.approx(0.75 * all_moe.breakdown["ep_comm"], rel=1e-12)
    gemm = {k: v.breakdown["compute"] for k, v in (("mixed", mixed), ("moe", all_moe), ("dense", dense))}
    assert gemm["mixed"] == pytest.approx(0.25 * gemm["dense"] + 0.75 * gemm["moe"], rel=1e-12)


def test_each_rank_s_expert_gemms_take_its_tokens_routed_top_k_times_gathered_over_etp():
    """Rows of the busiest rank's grouped expert GEMM: b s / (cp tp) tokens, top_k copies each,
    all-gathered over etp, x the load; per local expert, / (experts / ep)."""
    n = MOE.numbers() | Parallelism(dp=2, tp=4, ep=4, etp=2, sequence_parallel=True).numbers()
    rows = expert_rows(2 * 1024, 4, moe_numbers(n), 1.5)
    assert rows == 2 * 1024 / 4 * 2 * 2 * 1.5


def test_more_smaller_experts_at_equal_flops_are_never_faster():
    """Same routed FLOPs per token (top_k x moe_ffn), tokens spread over 4 or 64 local experts:
    the grouped GEMM of 8 rows per expert wastes most of each 128-row tile (and reads 16x the
    expert weights)."""
    c = cluster("h100-sxm", 1, 1)
    few = MOE.with_(moe_experts=4, seq=256)     # 256 x 2 / 4 = 128 rows per expert
    many = MOE.with_(moe_experts=64, seq=256)   # 8 rows per expert
    t = [step_time(m, Parallelism(), c, options=OPTIONS).breakdown["compute"] for m in (few, many)]
    assert t[1] > 1.5 * t[0]


def test_expert_tensor_parallelism_adds_the_etp_gather_and_splits_the_expert_gemms():
    c = cluster("h100-sxm", 1, 8)
    layouts = [Parallelism(dp=4, tp=2, ep=4, etp=etp, sequence_parallel=True) for etp in (1, 2)]
    one, two = (step_time(MOE, layout, c, options=OPTIONS) for layout in layouts)
    calls = 4 * MOE.layers
    nbytes = routed_bytes(Parallelism(dp=4, tp=2, sequence_parallel=True))
    # etp 1: ep 4 spans 4 ranks; etp 2: 8 ranks, still one node; + all-gather / reduce-scatter over 2
    # (the dispatcher's metadata step over the etp x ep group)
    assert one.breakdown["ep_comm"] == pytest.approx(calls * pairwise(nbytes, 4, c.intra)
                                                     + extras(layouts[0], c, MOE.layers), rel=1e-12)
    assert two.breakdown["ep_comm"] == pytest.approx(calls * (pairwise(nbytes, 4, c.intra)
                                                              + ring_phase(2 * nbytes, 2, c.intra))
                                                     + extras(layouts[1], c, MOE.layers), rel=1e-12)
    # expert gradients: edp = tp x dp / (ep x etp) = 2 with etp 1, 1 with etp 2 (none to reduce)
    params = stage_parameters(**(MOE.numbers() | Parallelism(dp=4, tp=2, ep=4, etp=2).numbers()))["first"]
    dense = params["dense"] * 2  # bf16 gradients (the megatron stack's), in Megatron's buckets of 40M parameters
    dense_only = float(nccl_time("all_reduce", dense, 4, 4, c.intra, c.inter,
                                 math.ceil(params["dense"] / 40e6))["best"])
    assert two.dp_comm_unhidden == pytest.approx(dense_only, rel=1e-12)
    assert one.dp_comm_unhidden > dense_only


@pytest.mark.parametrize("options,match", [
    (dict(moe_imbalance=0.5), "moe_imbalance must be a finite number >= 1"),
    (dict(moe_imbalance=math.nan), "moe_imbalance"),
    (dict(ep_overlap=1.5), "ep_overlap must be a finite number >= 0 and <= 1"),
])
def test_bad_options_name_the_field(options, match):
    with pytest.raises(InvalidArgument, match=match):
        StepOptions(**options)


def test_an_imbalance_beyond_every_token_on_one_expert_is_refused():
    with pytest.raises(InvalidArgument, match="moe_imbalance must be between 1 and experts / top_k = 12"):
        step_time(MOE, Parallelism(dp=8, ep=8), cluster("h100-sxm", 1, 8),
                  options=StepOptions(flash_attention=True, moe_imbalance=13))


@pytest.fixture(scope="module")
def moe_search():
    return search(MOE, cluster("h100-sxm", 2, 8), 64, options=OPTIONS, top=10 ** 6)


def test_the_search_enumerates_ep_and_etp_on_megatron_cores_expert_grid(moe_search):
    rows = moe_search.configs
    assert rows and moe_search.fitting == len(rows)
    # valid layouts are candidates that pass the model's rules, each timed with 3 recompute options
    assert 0 < moe_search.searched <= 3 * moe_search.candidates
    for x in rows:
        assert (x["dp"] * x["tp"] * x["cp"]) % (x["ep"] * x["etp"]) == 0 and MOE.moe_experts % x["ep"] == 0
        assert x["tp"] == 1 or x["sequence_parallel"]  # Megatron-Core's MoE layer needs SP with TP
    # folding: EP larger than DP (carved out of tp x dp), and expert tensor parallelism, both searched
    assert any(x["ep"] > x["dp"] for x in rows) and {x["etp"] for x in rows} >= {1, 2, 4}


def test_search_rows_are_the_scalar_step_times(moe_search):
    c = cluster("h100-sxm", 2, 8)
    rows = moe_search.configs[:: max(len(moe_search.configs) // 25, 1)]
    for x in rows:
        assert step_time(MOE, to_layout(x), c, options=OPTIONS).step_time == pytest.approx(x["step_time_s"], rel=1e-12)


def test_a_pinned_expert_grid_that_does_not_divide_the_stage_is_explained():
    r = search(MOE, cluster("h100-sxm", 1, 8), 8, options=OPTIONS, fixed={"tp": 1, "pp": 1, "cp": 1, "ep": 12})
    assert r.configs == [] and "ep x etp = 12x1 must divide the 8 GPUs of a pipeline stage" in r.why
    r = search(DENSE, cluster("h100-sxm", 1, 8), 8, options=OPTIONS, fixed={"etp": 2})
    assert r.configs == [] and "etp=2 needs an MoE model" in r.why


def test_moe_layers_without_shared_experts_skip_the_mlp_tensor_parallel_collectives():
    """Megatron-Core: routed tokens reach the experts through the dispatcher (all-to-all over ep,
    all-gather over etp), so an MoE layer's MLP has no TP all-gather / reduce-scatter unless shared
    experts (a TP-split dense MLP) run beside it; attention keeps its two."""
    layout = Parallelism(dp=2, tp=4, ep=2, sequence_parallel=True)
    c = cluster("h100-sxm", 1, 8)
    exposed = replace(OPTIONS, tp_overlap=0.0)  # the collectives as counted, none hidden
    dense = step_time(DENSE, Parallelism(dp=2, tp=4, sequence_parallel=True), c, options=exposed)
    routed = step_time(MOE, layout, c, options=exposed)
    shared = step_time(MOE.with_(moe_shared_experts=1), layout, c, options=exposed)
    # the embedding's, output layer's and loss's collectives, the same in all three (one micro-batch, bf16)
    outside = sum(calls * collective_time(op, nbytes, 4, c.intra) for _, op, nbytes, calls
                  in vocab_parallel_collectives(MOE.seq, MOE.hidden, 2, True, 1, 1))
    layers = dense.breakdown["tp_comm"] - outside
    assert routed.breakdown["tp_comm"] == pytest.approx(outside + layers / 2, rel=1e-12)
    assert shared.breakdown["tp_comm"] == pytest.approx(dense.breakdown["tp_comm"], rel=1e-12)


def test_permutations_move_the_routed_copies_by_hand():
    """Megatron-Core's alltoall dispatcher, per MoE layer and micro-batch, forward and backward:
    permute + unpermute (6 passes over tokens x top_k x h) and, with several local experts, the sort
    by expert and back (8 more), less the 3 passes over the stored expert input that the
    elementwise term counts; plus the unpermuted output, its gradient and the input gradient (3 x
    tokens x h)."""
    moe = moe_numbers(MOE.numbers() | Parallelism(dp=8, ep=8).numbers())
    routed = 1024 * 2 * 512 * 2  # tokens x top_k x h x bf16
    tokens = 1024 * 512 * 2
    several = permutation_bytes(tokens=1024, h=512, moe=moe, load=1.0, local_experts=3, act_bytes=2)
    one = permutation_bytes(tokens=1024, h=512, moe=moe, load=1.0, local_experts=1, act_bytes=2)
    assert several == (6 + 8 - 3) * routed + 3 * tokens
    assert one == (6 - 3) * routed + 3 * tokens
    # the busiest rank receives load x the rows it sorts; its own copies are what the router chose
    assert permutation_bytes(tokens=1024, h=512, moe=moe, load=2.0, local_experts=3, act_bytes=2) == \
        (6 - 3) * routed + 8 * 2 * routed + 3 * tokens
    dense = moe_numbers(DENSE.numbers() | Parallelism(dp=8).numbers())
    assert permutation_bytes(tokens=1024, h=512, moe=dense, load=1.0, local_experts=1, act_bytes=2) == 0


def test_sorting_by_local_expert_costs_its_hbm_passes_in_the_elementwise_term():
    """ep 24 (one expert per rank) against ep 8 (three): the elementwise term differs by exactly the
    8 sort passes over the routed copies, per MoE layer and micro-batch, at the HBM bandwidth."""
    c = cluster("h100-sxm", 3, 8)
    layout = Parallelism(dp=24, num_microbatches=2)
    t = {ep: step_time(MOE, layout.with_(ep=ep), c, options=OPTIONS).breakdown["elementwise"] for ep in (8, 24)}
    routed = MOE.seq * MOE.moe_top_k * MOE.hidden * 2
    assert t[8] - t[24] == pytest.approx(8 * routed * MOE.layers * 2 / c.gpu.memory_bandwidth, rel=1e-9)


def test_the_grouped_gemm_overhead_is_six_calls_per_local_expert():
    """FC1 and FC2 forward, their dgrad and wgrad backward: 2 + 4 calls, each paying what Transformer
    Engine's multi-stream grouped GEMM adds per expert over one single-launch kernel; none in a dense
    model."""
    moe = moe_numbers(MOE.numbers() | Parallelism(dp=8, ep=8).numbers())
    forward, backward = grouped_gemm_overhead(3, moe)
    per_call = (0.272e-3 - 0.069e-3) / 8
    assert forward == pytest.approx(2 * 3 * per_call, rel=1e-12)
    assert backward == pytest.approx(4 * 3 * per_call, rel=1e-12)
    dense = moe_numbers(DENSE.numbers() | Parallelism(dp=8).numbers())
    assert grouped_gemm_overhead(3, dense) == (0, 0)


@pytest.mark.parametrize("recipe, forward, backward", [
    ("delayed", 2, 4),           # one fused multi-tensor cast for all experts: GEMMs only
    ("mxfp8", 2 + 2, 4 + 2),     # one cast kernel per quantized tensor (FC1/FC2 input, FC2/FC1 output grad)
    ("current", 2 + 6, 4 + 6),   # amax, scale, cast: three per quantized tensor
])
def test_fp8_recipes_add_their_cast_kernels_per_expert(recipe, forward, backward):
    """Transformer Engine 2.9 quantizes each expert's GEMM inputs (forward) and output gradients
    (backward) in its per-expert loop: every kernel of it pays the per-expert launch cost."""
    moe = moe_numbers(MOE.numbers() | Parallelism(dp=8, ep=8).numbers())
    per_launch = 3 * (0.272e-3 - 0.069e-3) / 8
    assert grouped_gemm_overhead(3, moe, recipe) == pytest.approx((forward * per_launch, backward * per_launch))
    assert grouped_gemm_overhead(3, moe, recipe, expert_loop=False) == (0, 0)  # one grouped kernel
    with pytest.raises(InvalidArgument, match="fp8_recipe"):
        grouped_gemm_overhead(3, moe, "e4m3")


def test_a_stack_with_one_grouped_kernel_pays_no_per_expert_launches():
    """torchtitan's torch._grouped_mm runs the local experts in one kernel; Megatron-Core's
    GroupedLinear loops over them, so at equal layout it is slower by the launches, and with FP8
    current scaling by more than with MXFP8."""
    c = cluster("h100-sxm", 1, 8)
    layout = Parallelism(dp=8, ep=8)
    compute = {(stack, recipe): step_time(MOE, layout, c, options=StepOptions(
        stack=stack, dtype="fp8", fp8_recipe=recipe, flash_attention=True, attention_efficiency=0.4,
        dp_overlap=0.0)).breakdown["compute"] for stack in ("megatron", "torchtitan") for recipe in ("mxfp8", "current")}
    launches = 3 * MOE.layers * (0.272e-3 - 0.069e-3) / 8  # 3 local experts, one micro-batch
    assert compute["megatron", "mxfp8"] - compute["torchtitan", "mxfp8"] == pytest.approx(10 * launches, rel=1e-9)
    assert compute["megatron", "current"] - compute["torchtitan", "current"] == pytest.approx(18 * launches, rel=1e-9)
    with pytest.raises(InvalidArgument, match="fp8_recipe"):
        StepOptions(fp8_recipe="e4m3")


def test_the_grouped_gemm_overhead_adds_to_the_expert_gemms(monkeypatch):
    """Raising the per-expert call cost by d raises the compute term by d x 6 calls x local experts
    x MoE layers x micro-batches, with full recompute by the 2 forward calls more; a dense model's
    compute does not move."""
    c = cluster("h100-sxm", 1, 8)
    layout = Parallelism(dp=8, ep=8, num_microbatches=2)  # 24 experts: 3 per rank
    times = {}
    for cost in (1e-3, 2e-3):
        monkeypatch.setattr(plan_moe, "GEMM_CALL_SECONDS_PER_EXPERT", cost)
        times[cost] = [step_time(MOE, layout.with_(recompute=r), c, options=OPTIONS).breakdown["compute"]
                       for r in ("none", "full")]
        times[cost].append(step_time(DENSE, Parallelism(dp=8), c, options=OPTIONS).breakdown["compute"])
    assert times[2e-3][0] - times[1e-3][0] == pytest.approx(1e-3 * 6 * 3 * MOE.layers * 2, rel=1e-9)
    assert times[2e-3][1] - times[1e-3][1] == pytest.approx(1e-3 * 8 * 3 * MOE.layers * 2, rel=1e-9)
    assert times[2e-3][2] == times[1e-3][2]
