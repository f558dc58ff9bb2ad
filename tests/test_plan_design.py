"""The reviewer's checks and the fine-tuning model, on hand-computed cases."""
import math

import pytest

from dtlib.analytic.comm import collective_time, flat_link, hierarchical_time
from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.analytic.reliability import LLAMA3_GPU_MTBF_HOURS
from dtlib.plan.design import check_design, system_report
from dtlib.plan.finetune import all_reduce_timer, bucket_exposed_time, fine_tuning_efficiency
from dtlib.plan.topology import fat_tree

TEN_B, CL = get_preset("capstone-10b"), cluster("h100-sxm", 16, 8)


def test_design_checks_name_each_failure():
    bubbly = Parallelism(dp=8, tp=4, pp=4, micro_batch_size=16, num_microbatches=8, zero=1, recompute="full")
    result = {c.name: c for c in check_design(TEN_B, bubbly, CL, 1024)}
    assert result["global batch"].ok and result["TP inside a node"].ok and result["fits memory"].ok
    assert not result["pipeline bubble"].ok and "37.5%" in result["pipeline bubble"].why
    wrong_batch = {c.name: c for c in check_design(TEN_B, Parallelism(dp=128), CL, 1024)}
    assert not wrong_batch["global batch"].ok and "num_microbatches = 1024 / (dp x micro_batch_size)" in wrong_batch["global batch"].why
    assert not wrong_batch["MFU near the best"].ok and "not compared" in wrong_batch["MFU near the best"].why


def test_bucket_exposed_time_by_hand():
    t = lambda nbytes: 1e-3 + nbytes / 1e10  # noqa: E731
    # 4 buckets of 250 MB: 4 x 26 ms = 104 ms, 50 ms hidden
    assert bucket_exposed_time(1e9, 3e8, 0.05, t) == pytest.approx(4 * 0.026 - 0.05)
    assert bucket_exposed_time(1e9, 3e8, 10.0, t) == pytest.approx(0.026)   # only the last bucket
    with pytest.raises(ValueError, match="need grad_bytes > 0"):
        bucket_exposed_time(0, 1e6, 0.0, t)


def test_all_reduce_timer_is_hierarchical_or_one_flat_ring():
    cl = cluster("a100-80gb", 4, 8, inter="ib-hdr")
    assert all_reduce_timer(cl)(1e8) == hierarchical_time("all_reduce", 1e8, cl)["total"]
    assert all_reduce_timer(cl, hierarchical=False)(1e8) == collective_time("all_reduce", 1e8, 32, flat_link(cl))
    assert all_reduce_timer(cluster("a100-80gb", 1, 1))(1e8) == 0.0


def test_fine_tuning_efficiency_is_the_one_gpu_step_over_the_n_gpu_step():
    bert = get_preset("bert-large")
    r = fine_tuning_efficiency(bert, 4, 8, 8, hierarchical=False)
    assert r["efficiency"] == pytest.approx(r["step_1_gpu_s"] / (r["step_1_gpu_s"] + r["exposed_all_reduce_s"]))
    assert r["buckets"] == math.ceil(bert.num_parameters() * 4 / (25 * 2 ** 20))
    fp16 = fine_tuning_efficiency(bert, 4, 8, 8, hierarchical=False, fp16_compression=True)
    assert fp16["grad_bytes"] == r["grad_bytes"] / 2 and fp16["efficiency"] > r["efficiency"]
    assert fine_tuning_efficiency(bert, 4, 8, 8)["efficiency"] > r["efficiency"]   # hierarchical beats flat


def test_system_report_is_consistent():
    r = system_report(TEN_B, 1024, 1024, 1e12)
    assert r["switches"] == fat_tree(1024, 64).switches
    assert r["gpu_hours"] == pytest.approx(r["days"] * 24 * 1024)
    band = r["band"]["step_time_s"]  # the days span the step time's error band
    assert band["covered"] and r["days_band"] == pytest.approx((r["days"] * band["low"] / r["step_time_s"],
                                                                 r["days"] * band["high"] / r["step_time_s"]))
    assert r["days_band"][0] <= r["days"] <= r["days_band"][1]
    assert r["cost_usd"] == pytest.approx(r["gpu_hours"] * 2.5)
    assert r["failures_per_day"] == pytest.approx(24 * 1024 / LLAMA3_GPU_MTBF_HOURS)
    mtbf_s = LLAMA3_GPU_MTBF_HOURS / 1024 * 3600
    assert r["checkpoint_interval_min"] == pytest.approx(math.sqrt(2 * 60 * mtbf_s) / 60)
