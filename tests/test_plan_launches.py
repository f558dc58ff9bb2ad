"""The fixed cost per kernel (issue 37, small shards): every kernel a layer launches pays the ~3 us
a null kernel takes, beside its work; negligible at thousands of tokens per GPU, a tenth of the
compute at one eighth of an 8K sequence per GPU."""
import pytest

from dtlib.analytic.hardware import cluster
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.plan.launches import KERNEL_LAUNCH_S, layer_kernels, launch_time
from dtlib.plan.steptime import StepOptions, step_time

LLAMA8 = get_preset("llama3-8b")


def test_kernels_per_layer_follow_the_stack_and_the_recipe():
    assert layer_kernels(True, "bf16", "none") == 3 * 11  # forward, and backward twice the forward
    assert layer_kernels(False, "bf16", "none") == 3 * 33  # eager: one kernel per operator
    assert layer_kernels(True, "bf16", "full") == 4 * 11  # full recompute runs the forward again
    assert layer_kernels(True, "fp8", "none") == 3 * 11 + 8  # each weight GEMM's two casts


def test_the_step_pays_the_launches_of_the_slowest_stage_per_micro_batch():
    c = cluster("h100-sxm", 2, 8)
    layout = Parallelism(dp=4, pp=4, micro_batch_size=1, num_microbatches=8, zero=1)
    r = step_time(LLAMA8, layout, c, options=StepOptions(fused_elementwise=False))
    assert r.breakdown["launch"] == pytest.approx(32 / 4 * 8 * 99 * KERNEL_LAUNCH_S, rel=1e-12)
    assert launch_time(8, 8, True, "bf16", "none") == pytest.approx(8 * 8 * 33 * KERNEL_LAUNCH_S, rel=1e-12)


def test_a_few_hundred_tokens_per_gpu_make_the_launches_a_tenth_of_the_compute():
    """Issue 37's case: Llama-3.1-8B with one eighth of an 8K sequence per GB200 (cp 8 x dp 64 on
    512 GPUs, one micro-batch) against 8 micro-batches of whole sequences per GPU."""
    small = step_time(LLAMA8, Parallelism(dp=64, cp=8, micro_batch_size=1, num_microbatches=1, zero=1),
                      cluster("gb200", 8, 64), options=StepOptions(dtype="fp8")).breakdown
    large = step_time(LLAMA8, Parallelism(dp=8, micro_batch_size=1, num_microbatches=8, zero=1),
                      cluster("gb200", 1, 8), options=StepOptions(dtype="fp8")).breakdown
    assert small["launch"] == pytest.approx(32 * 41 * KERNEL_LAUNCH_S, rel=1e-12)  # 3.9 ms
    assert small["launch"] / small["compute"] > 0.10
    assert large["launch"] / large["compute"] < 0.02
