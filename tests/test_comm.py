"""Communication: alpha-beta times, nccl-tests bandwidths, hierarchical collectives, strategy
volumes and pipeline bubbles."""
import numpy as np
import pytest

from dtlib.analytic.comm import (COLLECTIVES, bubble_fraction, bus_factor, busbw, bytes_sent_per_rank,
                        collective_time, comm_report, hierarchical_time, strategy_volumes)
from dtlib.analytic.hardware import Link, cluster, get_link
from dtlib.models import get_preset
from dtlib.analytic.layout import Parallelism

LINK = Link("test", bandwidth=100e9, latency=5e-6, source="test link")


def test_bus_factors_are_nccl_tests():
    """nccl-tests doc/PERFORMANCE.md, Summary."""
    n = 8
    assert bus_factor("all_reduce", n) == 2 * 7 / 8
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        assert bus_factor(op, n) == 7 / 8
    assert bus_factor("broadcast", n) == bus_factor("p2p", n) == 1


@pytest.mark.parametrize("op", COLLECTIVES)
def test_busbw_reaches_link_bandwidth_for_large_ring_collectives(op):
    """The point of busbw: on large messages it equals the link bandwidth whatever n is."""
    for n in (2, 8, 64):
        t = collective_time(op, 64e9, n, LINK, "ring")
        assert busbw(op, 64e9, t, n) == pytest.approx(LINK.bandwidth, rel=1e-3)


def test_small_messages_pay_latency_per_step():
    assert collective_time("all_reduce", 0, 8, LINK, "ring") == pytest.approx(14 * 5e-6)
    assert collective_time("all_reduce", 0, 8, LINK, "tree") == pytest.approx(6 * 5e-6)
    assert collective_time("broadcast", 0, 8, LINK, "tree") == pytest.approx(3 * 5e-6)
    assert collective_time("p2p", 1e9, 2, LINK) == pytest.approx(5e-6 + 1e9 / 100e9)
    assert collective_time("all_reduce", 1e9, 1, LINK) == 0.0
    # tree wins on small messages at scale, never loses bandwidth for all-reduce
    small = [collective_time("all_reduce", 1e3, 512, LINK, alg) for alg in ("ring", "tree")]
    assert small[1] < small[0] / 10


def test_times_are_vectorised_and_validated():
    t = collective_time("all_gather", np.array([1e6, 1e9]), np.array([4, 16]), LINK)
    assert t.shape == (2,) and t[1] > t[0]
    with pytest.raises(ValueError, match="op must be one of 'all_reduce', .*, got 'allreduce'"):
        collective_time("allreduce", 1, 2, LINK)
    with pytest.raises(ValueError, match="algorithm must be one of 'ring', 'tree', got 'butterfly'"):
        collective_time("all_reduce", 1, 2, LINK, "butterfly")
    with pytest.raises(ValueError, match="ranks must be an integer >= 1, got 0"):
        collective_time("all_reduce", 1, 0, LINK)
    with pytest.raises(ValueError, match="ranks must be an integer >= 1, got 0"):  # the first bad one
        collective_time("all_reduce", 1, np.array([2, 0, -1]), LINK)


def test_hierarchical_all_reduce():
    c = cluster("h100-sxm", nodes=4, gpus_per_node=8)
    phases = hierarchical_time("all_reduce", 1e9, c)
    intra, inter = get_link("nvlink4"), get_link("ib-ndr")
    assert phases["intra reduce_scatter"] == pytest.approx(collective_time("reduce_scatter", 1e9, 8, intra))
    assert phases["inter all_reduce"] == pytest.approx(collective_time("all_reduce", 1e9 / 8, 4, inter))
    assert phases["total"] == pytest.approx(sum(v for k, v in phases.items() if k != "total"))
    # fewer NICs than GPUs: they share, so the inter-node phase slows down
    shared = hierarchical_time("all_reduce", 1e9, cluster("h100-sxm", 4, 8, nics_per_node=2))
    assert shared["inter all_reduce"] > 3 * phases["inter all_reduce"]
    # on one node, hierarchical = intra reduce_scatter + all-gather = flat ring all-reduce
    one = hierarchical_time("all_reduce", 1e9, cluster("h100-sxm", 1, 8))
    assert one["total"] == pytest.approx(collective_time("all_reduce", 1e9, 8, intra))


def test_bubble_fractions():
    """Narayanan et al. 2021, Sec. 2.2."""
    assert bubble_fraction(4, 8) == 3 / 8
    assert bubble_fraction(4, 8, 2, "interleaved") == 3 / 16
    assert bubble_fraction(1, 8) == 0
    with pytest.raises(ValueError, match="schedule must be one of"):
        bubble_fraction(4, 8, schedule="zigzag")


def test_strategy_volumes():
    cfg = get_preset("llama3-8b")
    ddp = strategy_volumes(cfg, Parallelism(dp=8), "zero")
    n = cfg.num_parameters()
    assert ddp["dp_grad_all_reduce"]["bytes_sent_per_gpu"] == pytest.approx(2 * 7 / 8 * 2 * n)
    z3 = strategy_volumes(cfg, Parallelism(dp=8, zero=3), "zero")
    z3_sent = sum(v["bytes_sent_per_gpu"] for v in z3.values())
    assert z3_sent == pytest.approx(1.5 * ddp["dp_grad_all_reduce"]["bytes_sent_per_gpu"])  # ZeRO Sec. 7
    tp = strategy_volumes(cfg, Parallelism(tp=4, num_microbatches=2, micro_batch_size=1), "zero")
    act = cfg.seq * cfg.hidden * 2
    assert tp["tp_activations"]["calls"] == 4 * cfg.layers * 2
    assert tp["tp_activations"]["bytes"] == act
    assert "dp_grad_all_reduce" not in tp  # dp = 1: nothing to reduce
    pp = strategy_volumes(cfg, Parallelism(pp=4, num_microbatches=8), "zero")
    assert pp["pp_activations"]["bytes_sent_per_gpu"] == 2 * 8 * act
    assert bytes_sent_per_rank("all_to_all", 8.0, 4) == 6.0


def test_comm_report_rows():
    r = comm_report("all_reduce", 1e9, 8, "nvlink4")
    assert set(r["algorithms"]) == {"ring", "tree"}
    ring = r["algorithms"]["ring"]
    assert ring["busbw"] == pytest.approx(ring["algbw"] * 2 * 7 / 8)
    with pytest.raises(ValueError, match="unknown link 'nvlink9'"):
        comm_report("all_reduce", 1e9, 8, "nvlink9")


def test_zero_sequence_is_an_error_not_the_default():
    cfg = get_preset("llama3-8b")
    with pytest.raises(ValueError, match="seq must be an integer >= 1, got 0"):
        strategy_volumes(cfg, Parallelism(dp=8), seq=0)
    with pytest.raises(ValueError, match="seq must be an integer >= 1, got 0"):
        cfg.numbers(seq=0)


def test_flat_ring_across_nodes_is_paced_by_its_slowest_hop():
    from dtlib.analytic.comm import flat_link, flat_vs_hierarchical

    one, two = cluster("h100-sxm", nodes=1), cluster("h100-sxm", nodes=2)
    assert flat_link(one) is one.intra
    link = flat_link(two)
    assert link.bandwidth == two.inter_bandwidth_per_gpu < two.intra.bandwidth
    assert link.latency == max(two.intra.latency, two.inter.latency)
    shared = cluster("h100-sxm", nodes=2, nics_per_node=4)  # two GPUs per NIC: half the bandwidth
    assert flat_link(shared).bandwidth == pytest.approx(link.bandwidth / 2)
    t = flat_vs_hierarchical("all_reduce", 2 ** 30, [one, two, cluster("h100-sxm", nodes=16)])
    assert t["flat"][0] == pytest.approx(collective_time("all_reduce", 2 ** 30, 8, one.intra))
    # in one node the two plans are the same ring; across nodes the flat ring pays InfiniBand on every hop
    assert t["hierarchical"][0] == pytest.approx(t["flat"][0], rel=0.25)
    assert all(f > 4 * h for f, h in zip(t["flat"][1:], t["hierarchical"][1:]))


def test_tp_layer_times_by_hand():
    """h=4096, t=8, NVLink4 (370.8 GB/s as NCCL models it, 3.4 us), s=4096, b=1, bf16: 4 ring all-reduces of b*s*h*2
    bytes vs 3 x (24 h^2 + 4 s h) FLOPs per token over 8 GPUs (Shoeybi et al. 2019, Sec. 3)."""
    from dtlib.analytic.comm import tp_layer_times
    from dtlib.analytic.hardware import get_gpu
    h, s, t = 4096, 4096, 8
    message = s * h * 2
    comm = 4 * (2 * (t - 1) * 3.4e-6 + 2 * (t - 1) / t * message / (18 * 20.6e9))
    compute = 3 * (24 * h * h + 4 * s * h) * s / t / get_gpu("h100-sxm").peak("bf16")
    r = tp_layer_times(h, t, "nvlink4")
    assert r["message_bytes"] == message
    assert r["comm_seconds"] == pytest.approx(comm, rel=1e-12)
    assert r["compute_seconds"] == pytest.approx(compute, rel=1e-12)
    assert tp_layer_times(h, 1, "nvlink4")["comm_seconds"] == 0.0
    # InfiniBand: the same bytes at 1/7 of NVLink's bandwidth -> communication dominates at t=8;
    # over NVLink it is about the matmuls' time at this width and under it for a wider model (lesson 05)
    assert tp_layer_times(h, t, "ib-ndr")["ratio"] > 5 * r["ratio"] > 5 * 0.9
    assert tp_layer_times(2 * h, t, "nvlink4")["ratio"] < 1
    with pytest.raises(ValueError, match="hidden, tp, seq and micro_batch_size must be >= 1"):
        tp_layer_times(h, 0, "nvlink4")


def test_ep_volumes_are_the_sequence_parallel_shard_of_the_moe_layers():
    """DeepSeek-V3, tp 2, ep 8, pp 16, 4 micro-batches of 1 x 4096 tokens, bf16: each rank
    dispatches its sequence-parallel shard, 4096 / 2 tokens x top_k 8 x h 7168 x 2 bytes, to its 8
    EP peers (Megatron-Core runs MoE with TP only sequence-parallel), 4 all-to-alls per MoE layer and
    micro-batch (6 with full recompute); 61 layers over pp 16 is Megatron's uneven split 3 + 14 x 4
    + 2, and the most loaded rank is the second, whose 4 layers are all MoE (the first holds the 3
    dense ones); with pp 1, 58 of the 61. etp 2 all-gathers / reduce-scatters 2 x the bytes."""
    cfg = get_preset("deepseek-v3")
    layout = Parallelism(dp=8, tp=2, pp=16, ep=8, etp=2, sequence_parallel=True, num_microbatches=4,
                         first_stage_layers=3, last_stage_layers=2)
    from dtlib.analytic.memory import memory_per_gpu
    assert memory_per_gpu(cfg, layout).stage == 1
    per_call = 4096 // 2 * 8 * 7168 * 2
    v = strategy_volumes(cfg, layout)
    assert v["ep_tokens"]["bytes"] == per_call and v["ep_tokens"]["calls"] == 4 * 4 * 4
    assert v["ep_tokens"]["bytes_sent_per_gpu"] == 7 / 8 * per_call * 64
    assert v["etp_tokens"]["bytes"] == 2 * per_call and v["etp_tokens"]["bytes_sent_per_gpu"] == per_call * 64
    whole = strategy_volumes(cfg, layout.with_(pp=1, dp=128, recompute="full", first_stage_layers=None,
                                               last_stage_layers=None))
    assert whole["ep_tokens"]["calls"] == 6 * 58 * 4
    assert "etp_tokens" not in strategy_volumes(cfg, layout.with_(etp=1))  # no ETP group
    # padded buffers: a capacity factor multiplies the bytes
    padded = strategy_volumes(cfg.with_(moe_capacity_factor=1.25), layout)
    assert padded["ep_tokens"]["bytes"] == 1.25 * per_call
    # the step-time model's EP all-to-all (dtlib.plan.moe) sends the same bytes per call
    from dtlib.plan.moe import ep_comm_time, moe_numbers
    c = cluster("h100-sxm", 16, 8)
    n = cfg.numbers() | layout.numbers()
    step = ep_comm_time(b=1, s=4096, h=7168, tp=2, cp=1, dp=8, ep=8, moe=moe_numbers(n), load=1.0,
                        act_bytes=2, calls=1, forwards=1, gpus_per_node=8, intra=c.intra, inter=c.inter,
                        kernel_launch_s=c.gpu.kernel_launch_s, dispatcher="alltoall")
    assert float(step["bytes_per_call"]) == per_call


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_group():
    """DeepSeek-V3 on one stage, tp 2, dp 128, ep 8, ZeRO-1: the 58 MoE layers' 32 local experts
    (3 x 7168 x 2048 parameters each) are reduce-scattered over edp = 2 x 128 / (etp x 8) = 32
    ranks, the rest over the 128 replicas; with etp 2 and dp 8, edp = 1: no expert reduction."""
    cfg = get_preset("deepseek-v3")
    layout = Parallelism(dp=128, tp=2, ep=8, zero=1, sequence_parallel=True)
    v = strategy_volumes(cfg, layout)  # "zero" precision: 2-byte gradients
    experts = 58 * 32 * 3 * 7168 * 2048
    assert v["edp_grad_reduce_scatter"]["bytes"] == 2 * experts and v["edp_grad_reduce_scatter"]["ranks"] == 32
    assert v["edp_param_all_gather"]["ranks"] == 32 and v["dp_grad_reduce_scatter"]["ranks"] == 128
    from dtlib.analytic.memory import memory_per_gpu
    held = memory_per_gpu(cfg, layout.with_(zero=0)).parameters  # 2-byte parameters
    assert v["dp_grad_reduce_scatter"]["bytes"] + v["edp_grad_reduce_scatter"]["bytes"] == pytest.approx(held, rel=1e-12)
    folded = strategy_volumes(cfg, Parallelism(dp=8, tp=2, pp=16, ep=8, etp=2, sequence_parallel=True,
                                               first_stage_layers=3, last_stage_layers=2))
    assert not any(k.startswith("edp_") for k in folded) and "dp_grad_all_reduce" in folded
    assert not any(k.startswith("edp_") for k in strategy_volumes(get_preset("llama3-8b"), Parallelism(dp=8)))
