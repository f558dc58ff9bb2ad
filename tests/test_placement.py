"""Job placement: bytes per network tier against hand-computed cases, and the gang scheduler on
crafted cases whose answer is known (first-fit spreads a job a topology-aware policy keeps whole)."""
import pytest

from dtlib.plan.placement import (ClusterSpec, Layout, check_placement, node_matrix, place, step_volumes,
                                  tier_bytes, tier_report, tp_inter_node_bytes, traffic)
from dtlib.plan.scheduler import Job, allocate, simulate, summary


def test_tp8_on_8_gpu_nodes_stays_in_nvlink_only_with_megatron_order():
    layout, cluster = Layout(dp=2, tp=8), ClusterSpec(nodes=2, gpus_per_node=8)
    assert tp_inter_node_bytes(layout, cluster, place(layout, cluster, "megatron")) == 0
    # naive (DP fastest): TP group 0 lands on GPUs 0,2,...,14 -- four in node 0, four in node 1 --
    # so 2 of each ring's 8 hops leave a node: 2 rings x 2 hops
    assert place(layout, cluster, "naive")[:8] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert tp_inter_node_bytes(layout, cluster, place(layout, cluster, "naive")) == 4
    assert tp_inter_node_bytes(layout, cluster, place(layout, cluster, "random", seed=1)) > 0


def test_hand_computed_bytes_per_tier():
    # dp2 x tp2 on 2 nodes of 2 GPUs, one rack: Megatron puts each TP pair in a node, so the DP rings
    # (rank 0 <-> 2 and 1 <-> 3) cross the leaf: 2 rings x 2 hops x 10 bytes
    layout, cluster = Layout(dp=2, tp=2), ClusterSpec(nodes=2, gpus_per_node=2, nodes_per_rack=1)
    per = tier_bytes(layout, cluster, place(layout, cluster, "megatron"), {"tp": 100, "dp": 10})
    assert per["tp"] == {"nvlink": 400, "leaf": 0, "spine": 0}
    assert per["dp"] == {"nvlink": 0, "leaf": 0, "spine": 40}  # nodes_per_rack=1: each node its own rack
    naive = tier_bytes(layout, cluster, place(layout, cluster, "naive"), {"tp": 100, "dp": 10})
    assert naive["tp"] == {"nvlink": 0, "leaf": 0, "spine": 400}
    assert naive["dp"] == {"nvlink": 40, "leaf": 0, "spine": 0}


def test_pipeline_is_a_chain_both_ways_and_racks_are_the_spine():
    layout = Layout(pp=4)
    cluster = ClusterSpec(nodes=4, gpus_per_node=1, nodes_per_rack=2)
    assert len(traffic(layout, {"pp": 1})) == 6  # 3 hops, each way
    per = tier_bytes(layout, cluster, [0, 1, 2, 3], {"pp": 5})["pp"]
    assert per == {"nvlink": 0, "leaf": 20, "spine": 10}  # 0-1 and 2-3 under one leaf, 1-2 across


def test_node_matrix_and_report():
    layout, cluster = Layout(dp=2, tp=4), ClusterSpec(nodes=2, gpus_per_node=4)
    m = node_matrix(layout, cluster, place(layout, cluster, "megatron"), {"tp": 1, "dp": 1})
    assert m == [[4, 4], [4, 4]]
    rep = tier_report(layout, cluster, step_volumes(1024, 8, 512, 1, 4, 1e8, layout))
    assert rep["megatron"]["leaf"] < rep["naive"]["leaf"]
    assert rep["megatron"]["seconds"] < rep["naive"]["seconds"]


@pytest.mark.parametrize("gpu, message", [([0, 1, 2], "one GPU per rank"), ([0, 0, 1, 2], "two ranks on one GPU"),
                                          ([0, 1, 2, 99], "integer in 0..7")])
def test_bad_placements_are_refused(gpu, message):
    with pytest.raises(ValueError, match=message):
        check_placement(gpu, Layout(tp=4), ClusterSpec(nodes=1))


def test_layout_larger_than_cluster():
    with pytest.raises(ValueError, match="needs 16 GPUs"):
        place(Layout(tp=16), ClusterSpec(nodes=1), "megatron")


def test_first_fit_spreads_a_job_that_topology_aware_keeps_in_one_node():
    # 2 nodes x 4 GPUs. A takes GPU 0. B (4 GPUs): first-fit takes 1,2,3,4 (two nodes: slower);
    # topology-aware takes node 1 whole. C (3 GPUs) then fits in node 0's 1,2,3 for topology.
    cluster = ClusterSpec(nodes=2, gpus_per_node=4, nodes_per_rack=2)
    jobs = [Job("A", 1, 10), Job("B", 4, 10), Job("C", 3, 10)]
    ff = {s.job.name: s for s in simulate(jobs, cluster, "first-fit", spread_slowdown=2.0)}
    topo = {s.job.name: s for s in simulate(jobs, cluster, "topology", spread_slowdown=2.0)}
    assert ff["B"].gpus == [1, 2, 3, 4] and ff["B"].end == 20 and ff["B"].nodes == 2
    assert topo["B"].gpus == [4, 5, 6, 7] and topo["B"].end == 10
    assert topo["C"].gpus == [1, 2, 3] and topo["C"].start == 0
    # first-fit: C (3 GPUs) gets 5,6,7 at t=0 as well
    assert ff["C"].gpus == [5, 6, 7]
    assert summary(list(topo.values()), cluster)["makespan"] == 10
    assert summary(list(ff.values()), cluster)["makespan"] == 20


def test_gang_waits_for_all_its_gpus_and_fifo_blocks():
    cluster = ClusterSpec(nodes=1, gpus_per_node=4)
    jobs = [Job("A", 3, 5), Job("B", 2, 5), Job("C", 1, 1)]
    s = {x.job.name: x for x in simulate(jobs, cluster, "first-fit")}
    assert s["B"].start == 5  # 1 GPU free is not enough: the gang waits
    assert s["C"].start == 5  # FIFO, no backfill: C waits behind B although a GPU is free
    st = summary(list(s.values()), cluster)
    assert st["mean_wait"] == pytest.approx(10 / 3)
    assert st["idle_while_waiting"] == 5  # one GPU idle for 5 s while B and C queued


def test_topology_waits_instead_of_spreading_unless_told():
    cluster = ClusterSpec(nodes=2, gpus_per_node=4)
    jobs = [Job("A", 2, 4), Job("B", 2, 10), Job("C", 2, 10), Job("D", 4, 10, arrival=1)]
    topo = {x.job.name: x for x in simulate(jobs, cluster, "topology")}
    # best fit: A and B share node 0, C on node 1; at t=4 A leaves 2 GPUs on node 0 and 2 on node 1
    assert topo["D"].start == 10 and topo["D"].nodes == 1
    eager = {x.job.name: x for x in simulate(jobs, cluster, "topology", spread_after=0)}
    assert eager["D"].start == 4 and eager["D"].nodes == 2 and eager["D"].slowdown == 1.5


def test_allocate_whole_nodes_in_one_rack():
    cluster = ClusterSpec(nodes=4, gpus_per_node=2, nodes_per_rack=2)
    free = {0, 1, 2, 4, 5, 6, 7}  # node 1 partly busy: rack 1 holds two whole nodes
    assert allocate(Job("J", 4, 1), free, cluster, "topology") == [4, 5, 6, 7]
    assert allocate(Job("J", 4, 1), free, cluster, "first-fit") == [0, 1, 2, 4]
