"""Scale effects on the data-parallel collectives: NCCL's latency terms (ring 2(n-1) hops, tree
2 log2 N network hops, constants from NCCL src/graph/tuning.cc typed here, not read from dtlib),
NCCL's choice between them, Megatron's gradient buckets, the fabric's oversubscription once a group
outgrows a leaf, and dtlib's weak-scaling prediction against torchtitan's published 8 -> 128 GPU
series."""
import math

import pytest

from dtlib.analytic.comm import nccl_latency, nccl_time
from dtlib.analytic.hardware import cluster, get_link
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.plan.steptime import _buckets
from dtlib.plan.topology import weak_scaling
from dtlib.plan.validation import PUBLISHED, predict

NVLINK, NIC = get_link("nvlink4"), get_link("ib-ndr")
BASE, RING_NVLINK, NET, PLATEAU, TREE_BW = 8.4e-6, 3.4e-6, 14e-6, 1.4, 0.92  # tuning.cc, Simple protocol


@pytest.mark.parametrize("gpus", [8, 1024, 4096, 16384])
def test_ring_latency_is_two_n_minus_one_hops_and_tree_two_log2_nodes(gpus):
    nodes = max(gpus // 8, 1)
    ring = nccl_latency("all_reduce", "ring", gpus, nodes, NVLINK, NIC)
    tree = nccl_latency("all_reduce", "tree", gpus, nodes, NVLINK, NIC)
    net_hops = 2 * (nodes - 1)
    expected_ring = BASE + (2 * (gpus - 1) - net_hops) * RING_NVLINK + net_hops * NET
    assert ring == pytest.approx(expected_ring * (PLATEAU if nodes > 1 else 1), rel=1e-12)
    assert tree == pytest.approx(BASE + 2 * (7 * RING_NVLINK + math.log2(nodes) * NET), rel=1e-12)
    # reduce-scatter / all-gather: half the ring's steps, no plateau factor, no tree in NCCL
    rs = nccl_latency("reduce_scatter", "ring", gpus, nodes, NVLINK, NIC)
    assert rs == pytest.approx(BASE + (gpus - 1 - (nodes - 1)) * RING_NVLINK + (nodes - 1) * NET, rel=1e-12)
    with pytest.raises(ValueError, match="NCCL runs reduce_scatter as a ring"):
        nccl_latency("reduce_scatter", "tree", gpus, nodes, NVLINK, NIC)


def test_latency_grows_linearly_for_the_ring_and_logarithmically_for_the_tree():
    ring = [nccl_latency("all_reduce", "ring", g, g // 8, NVLINK, NIC) for g in (1024, 16384)]
    tree = [nccl_latency("all_reduce", "tree", g, g // 8, NVLINK, NIC) for g in (1024, 16384)]
    assert ring[1] / ring[0] == pytest.approx(16, rel=0.01)       # 16x the GPUs, 16x the hops
    assert tree[1] - tree[0] == pytest.approx(2 * 4 * NET)         # log2(2048) - log2(128) = 4 more hops
    assert ring[1] > 0.2 and tree[1] < 5e-4                        # 217 ms vs 0.36 ms per call at 16K GPUs


def test_nccl_picks_the_tree_at_scale_and_the_ring_for_big_messages_on_few_nodes():
    small_at_scale = nccl_time("all_reduce", 64e6, 16384, 8, NVLINK, NIC)
    assert small_at_scale["best"] == small_at_scale["tree"] < small_at_scale["ring"]
    big_on_two = nccl_time("all_reduce", 4e9, 16, 8, NVLINK, NIC)
    assert big_on_two["best"] == big_on_two["ring"] < big_on_two["tree"]
    # bandwidth-bound: the tree's network phase at 0.92 of the ring's bandwidth (tuning.cc)
    net = 2 * (1 / 2) * (4e9 / 8) / NIC.bandwidth
    assert big_on_two["tree"] - big_on_two["ring"] == pytest.approx(
        net / TREE_BW - net + nccl_latency("all_reduce", "tree", 16, 2, NVLINK, NIC)
        - nccl_latency("all_reduce", "ring", 16, 2, NVLINK, NIC), rel=1e-9)
    assert nccl_time("reduce_scatter", 4e9, 16, 8, NVLINK, NIC)["tree"] == math.inf
    # one call of S vs 25 buckets of S/25: the same bandwidth, 25 latencies
    one, many = (nccl_time("all_reduce", 4e9, 1024, 8, NVLINK, NIC, calls=c)["tree"] for c in (1, 25))
    assert many - one == pytest.approx(24 * nccl_latency("all_reduce", "tree", 1024, 128, NVLINK, NIC), rel=1e-9)


def test_megatron_buckets_and_fsdp_layers():
    # Megatron-Core DistributedDataParallel: bucket_size = max(40M, 1M x dp) parameters
    assert _buckets(1e9, 16, 0, 32) == 25 and _buckets(1e9, 128, 1, 32) == math.ceil(1e9 / 128e6)
    assert _buckets(1e6, 8, 2, 32) == 1 and _buckets(1e9, 16, 3, 32) == 32  # ZeRO-3: one gather per layer


@pytest.fixture(scope="module")
def llama70b_weak():
    model = get_preset("llama3-70b")
    layout = Parallelism(dp=1, tp=8, pp=4, micro_batch_size=1, num_microbatches=16, zero=1,
                         sequence_parallel=True, recompute="selective")
    nodes = [4, 32, 128, 512, 2048]  # 32 .. 16,384 H100s
    rail = weak_scaling(model, layout, cluster("h100-sxm", 4, 8), nodes, oversubscription=4, rail_optimised=True)
    plain = weak_scaling(model, layout, cluster("h100-sxm", 4, 8), nodes, oversubscription=4, rail_optimised=False)
    return rail, plain


def test_dp_time_grows_with_scale_at_equal_per_gpu_batch(llama70b_weak):
    rail, _ = llama70b_weak
    assert rail["gpus"] == [32, 256, 1024, 4096, 16384]
    unhidden = rail["dp_comm_unhidden"]
    assert unhidden[0] == 0 and all(b > a for a, b in zip(unhidden[1:], unhidden[2:]))
    # from 1,024 GPUs on, the reduce's growth is all that changes; below, ZeRO 1 sharding the optimizer
    # step over more ranks saves more than the (BF16) reduce costs: 32 -> 256 GPUs is faster
    assert all(b >= a for a, b in zip(rail["step_time"][2:], rail["step_time"][3:]))
    assert rail["growth"][0] == 0 and rail["growth"][-1] > 0


def test_rail_optimised_fabric_meets_the_oversubscription_later(llama70b_weak):
    """tp 8: one DP rank per node, all on the same rail. Rail-optimised, a 64-port leaf at 4:1 has
    51 ports down, so a DP group of up to 51 nodes stays under its rail's leaf; plain wiring puts a
    node's 8 NICs on one leaf, 6 nodes a leaf."""
    rail, plain = llama70b_weak
    assert rail["oversubscription"] == [1, 1, 1, 4, 4]     # dp 1, 8, 32 fit a leaf; 128 does not
    assert plain["oversubscription"] == [1, 4, 4, 4, 4]    # dp 8 already spans two leaves
    assert plain["step_time"][1] > rail["step_time"][1]
    assert plain["step_time"][-1] == rail["step_time"][-1]


@pytest.fixture(scope="module")
def torchtitan_weak():
    """torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama 3.1 8B, FSDP,
    local batch 2, on 8 and on 128 H100s (the same per-GPU batch): tokens/s/GPU per technique."""
    rows = [r for r in PUBLISHED if r.source == "torchtitan" and r.name.startswith("Llama 3.1 8B, FSDP")]
    pairs = {}
    for technique in ("eager", "compile", "compile + Float8"):
        small, large = (next(r for r in rows if r.name == f"Llama 3.1 8B, FSDP {g}, {technique} (torchtitan T{t})")
                        for g, t in ((8, 1), (128, 3)))
        published = small.published / large.published - 1           # step time growth, equal tokens per GPU
        predicted = predict(small, rank=False)["predicted"] / predict(large, rank=False)["predicted"] - 1
        pairs[technique] = (published, predicted)
    return pairs


def test_weak_scaling_growth_against_torchtitan(torchtitan_weak):
    """Published: +2.8% (eager), +2.3% (compile), +1.8% (Float8) step time from 8 to 128 GPUs.
    dtlib predicts -0.3% to -0.4%: the DP collectives (NCCL latency per layer, the last layer's
    reduce-scatter exposed) add ~5 ms a step and sharding the optimizer over 128 instead of 8 GPUs
    saves ~12 ms; what dtlib leaves out is the slowdown of compute by the communication kernels it
    overlaps with (they take SMs and HBM bandwidth), ~205 ms more of it at 128 GPUs. The tolerance,
    3.5 percentage points, is that gap plus the published rows' resolution (each a single reading at
    iteration 90, torchtitan's note), so a model change that drifts further from the published
    growth, either way, fails here; docs/hardware.md records the comparison."""
    for technique, (published, predicted) in torchtitan_weak.items():
        assert 0.015 < published < 0.03, technique
        assert predicted == pytest.approx(published, abs=0.035), technique
        assert predicted < published, technique  # dtlib under-predicts the growth (see above)


@pytest.mark.parametrize("call, message", [
    (lambda: nccl_latency("all_reduce", "tree", 8, 0, NVLINK, NIC), "nodes must be an integer >= 1, got 0"),
    (lambda: nccl_latency("broadcast", "ring", 8, 1, NVLINK, NIC), "covers all_reduce, reduce_scatter and all_gather"),
    (lambda: nccl_time("all_reduce", -1, 8, 8, NVLINK, NIC), "nbytes must be a finite number >= 0, got -1"),
    (lambda: nccl_time("all_reduce", 1e9, 8, 8, NVLINK, NIC, calls=0), "calls must be an integer >= 1, got 0"),
    (lambda: weak_scaling(get_preset("llama3-8b"), Parallelism(dp=1, tp=3), cluster("h100-sxm", 1, 8), [1]),
     "8 GPUs do not hold whole tp x pp x cp = 3 groups"),
])
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_sharp_reduces_in_the_switches_one_hop_up_one_down():
    """A fabric with in-network reduction (``ib-ndr-sharp``: Quantum-2 SHARPv3, NCCL's CollNet) sends
    each GPU's S/8 share up once and receives the sum once, with one network hop each way; without it
    NCCL has ring and tree only."""
    sharp = get_link("ib-ndr-sharp")
    assert sharp.in_network_reduction and not NIC.in_network_reduction
    assert (sharp.bandwidth, sharp.latency) == (NIC.bandwidth, NIC.latency)
    S, n, calls = 2e9, 8192, 20
    plain, with_sharp = nccl_time("all_reduce", S, n, 8, NVLINK, NIC, calls), nccl_time("all_reduce", S, n, 8, NVLINK, sharp, calls)
    assert plain["collnet"] == math.inf and with_sharp["tree"] == plain["tree"]
    per_call = S / calls
    intra = 2 * 7 / 8 * per_call / NVLINK.bandwidth                 # reduce-scatter + all-gather inside the node
    latency = BASE + 2 * 7 * RING_NVLINK + 2 * NET
    assert with_sharp["collnet"] == pytest.approx(calls * (latency + intra + per_call / 8 / NIC.bandwidth), rel=1e-12)
    assert with_sharp["best"] == with_sharp["collnet"] < plain["best"]
    # reduce-scatter and all-gather: no CollNet here (ring only), one node: nothing crosses the switches
    assert nccl_time("reduce_scatter", S, n, 8, NVLINK, sharp, calls)["collnet"] == math.inf
    assert nccl_time("all_reduce", S, 8, 8, NVLINK, sharp)["collnet"] == math.inf
    # the planner's DP all-reduce (ZeRO 0) on 1,024 nodes gets faster with the SHARP fabric
    layout = Parallelism(dp=8192, micro_batch_size=1, num_microbatches=1, zero=0)
    from dtlib.plan.steptime import StepOptions, step_time
    opts = StepOptions(dp_overlap=0.0)
    t = {link: step_time(get_preset("llama3-8b"), layout, cluster("h100-sxm", 1024, 8, inter=link), options=opts)
         for link in ("ib-ndr", "ib-ndr-sharp")}
    assert t["ib-ndr-sharp"].breakdown["dp_comm"] < t["ib-ndr"].breakdown["dp_comm"]
