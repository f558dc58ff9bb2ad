"""Reliability (Young/Daly, goodput), the training plan's arithmetic, and fat-tree sizing against
Al-Fares et al. 2008's closed forms."""
import math

import numpy as np
import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.analytic.reliability import (LLAMA3_GPU_MTBF_HOURS, daly_interval, expected_failures, goodput,
                                        job_mtbf, young_interval)
from dtlib.plan.steptime import StepOptions
from dtlib.plan.topology import dp_time_vs_oversubscription, fat_tree, leaf_reach_nodes
from dtlib.plan.training import training_plan


def test_llama3_failure_rate_reproduces_its_interruptions():
    mtbf = job_mtbf(LLAMA3_GPU_MTBF_HOURS, 16384)
    assert mtbf == pytest.approx(3.09, abs=0.01)                      # about 3 hours
    assert expected_failures(54 * 24, mtbf) == pytest.approx(419)     # Table 5: 419 unexpected


def test_young_and_daly_intervals():
    assert young_interval(60.0, 3 * 3600.0) == pytest.approx(math.sqrt(2 * 60 * 10800))
    c, m = 60.0, 10800.0
    young = math.sqrt(2 * c * m)
    assert daly_interval(c, m) == pytest.approx(young * (1 + math.sqrt(c / (2 * m)) / 3 + c / (18 * m)) - c)
    assert daly_interval(3.0, 1.0) == pytest.approx(1.0)  # C >= 2M: checkpoint every MTBF (Daly eq. 20)
    # Young's interval minimises the first-order waste: neighbours waste more
    taus = young * np.array([0.8, 1.0, 1.25])
    g = goodput(taus, c, m)
    assert g[1] > g[0] and g[1] > g[2]
    assert g[1] == pytest.approx(1 - c / young - young / 2 / m)


def test_goodput_counts_restarts_and_never_goes_negative():
    assert goodput(600.0, 60.0, 3600.0, restart=300.0) == pytest.approx(1 - 0.1 - (300 + 300) / 3600)
    assert goodput(600.0, 500.0, 100.0) == 0.0


@pytest.mark.parametrize("call,match", [
    (lambda: job_mtbf(0, 8), "gpu_mtbf must be a finite number > 0"),
    (lambda: young_interval(-1, 10), "checkpoint_cost must be a finite number > 0"),
    (lambda: goodput(10, 1, 100, restart=-1), "restart must be a finite number >= 0, got -1"),
    (lambda: expected_failures(-1, 10), "duration must be a finite number >= 0, got -1"),
])
def test_reliability_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_training_plan_arithmetic():
    p = training_plan(tokens=1e12, tokens_per_step=4e6, step_time=8.0, gpus=1024, price_per_gpu_hour=2.0,
                      pue=1.25, checkpoint_cost_s=60, restart_s=600)
    steps = 1e12 / 4e6
    compute_s = steps * 8.0
    mtbf_s = LLAMA3_GPU_MTBF_HOURS / 1024 * 3600
    tau = math.sqrt(2 * 60 * mtbf_s)
    useful = 1 - 60 / tau - (tau / 2 + 600) / mtbf_s
    wall_h = compute_s / useful / 3600
    assert p.steps == steps and p.compute_days == pytest.approx(compute_s / 86400)
    assert p.goodput == pytest.approx(useful) and p.days == pytest.approx(wall_h / 24)
    assert p.gpu_hours == pytest.approx(wall_h * 1024) and p.cost_usd == pytest.approx(wall_h * 1024 * 2.0)
    assert p.energy_mwh == pytest.approx(128 * 10.2 * wall_h * 1.25 / 1000)   # DGX H100: 10.2 kW
    assert p.expected_failures == pytest.approx(wall_h * 3600 / mtbf_s)
    daly = training_plan(tokens=1e12, tokens_per_step=4e6, step_time=8.0, gpus=1024, interval="daly")
    assert daly.checkpoint_interval_s == pytest.approx(float(daly_interval(60.0, mtbf_s)))


@pytest.mark.parametrize("kwargs,match", [
    (dict(tokens=0), "tokens must be a finite number > 0"),
    (dict(gpus=0), "gpus must be an integer >= 1"),
    (dict(pue=0.9), "pue must be a finite number >= 1"),
    (dict(interval="fast"), "interval must be one of"),
    (dict(price_per_gpu_hour=float("nan")), "price_per_gpu_hour must be a finite number > 0"),
    (dict(gpu_mtbf_hours=1.0, gpus=100000), "no progress"),
])
def test_training_plan_bad_input(kwargs, match):
    args = dict(tokens=1e12, tokens_per_step=4e6, step_time=8.0, gpus=1024) | kwargs
    with pytest.raises(ValueError, match=match):
        training_plan(**args)


def test_fat_tree_matches_al_fares_closed_forms():
    # a full k-ary fat-tree: k^3/4 hosts, 5k^2/4 switches, 3 x k^3/4 links (Al-Fares et al. 2008, Sec. 3)
    for k in (4, 8, 64):
        t = fat_tree(k ** 3 // 4, k)
        assert (t.tiers, t.max_endpoints, t.switches, t.links) == (3, k ** 3 // 4, 5 * k * k // 4, 3 * k ** 3 // 4)
    two = fat_tree(2048, 64)                       # leaf-spine limit: k x k/2
    assert (two.tiers, two.leaf, two.spine, two.max_endpoints) == (2, 64, 32, 2048)
    assert fat_tree(2049, 64).tiers == 3 and fat_tree(64, 64).tiers == 1
    with pytest.raises(ValueError, match="exceed a three-tier fat-tree of 64-port switches"):
        fat_tree(65537, 64)
    with pytest.raises(ValueError, match="radix must be an even number"):
        fat_tree(100, 7)


def test_oversubscription_trades_switches_for_bisection():
    flat, over = fat_tree(24576, 64), fat_tree(24576, 64, oversubscription=7)
    assert over.down_ports == 56 and over.switches < flat.switches
    assert over.bisection_bandwidth == pytest.approx(flat.bisection_bandwidth / 7)
    rails = fat_tree(1024, 64, rail_optimised=True)
    assert leaf_reach_nodes(rails, 8) == 32 and leaf_reach_nodes(fat_tree(1024, 64), 8) == 4


def test_oversubscription_slows_data_parallelism_unless_the_group_stays_under_a_leaf():
    model, c = get_preset("capstone-10b"), cluster("h100-sxm", 16, 8)
    layout = Parallelism(dp=16, tp=8, zero=1, num_microbatches=64, recompute="selective", sequence_parallel=True)
    r = dp_time_vs_oversubscription(model, layout, c, [1, 2, 4], options=StepOptions(dp_overlap=0.0))
    t = r["dp_comm_unhidden"]
    assert t[0] < t[1] < t[2] and r["dp_comm"] == t
    rails = dp_time_vs_oversubscription(model, layout, c, [1, 4], tree=fat_tree(128, 64, rail_optimised=True))
    assert rails["dp_comm_unhidden"][0] == rails["dp_comm_unhidden"][1]   # 16 nodes <= 32 under one rail leaf
