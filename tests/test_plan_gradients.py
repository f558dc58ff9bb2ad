"""Where eager PyTorch handles gradients and activations differently from Megatron-Core (the
step-time model's defaults), each an option of :class:`dtlib.plan.steptime.StepOptions` or a
figure of the device: gradient accumulation in a pass of its own, the flat bucket's copies around
the reduce, ZeRO-3's reduce-scatter after every micro-batch and its copies around its
gathers and reduce-scatters, the kernel cost of the device and the
kernel count of the model, and the norms and residual adds that tensor parallelism does not split
without sequence parallelism."""
import dataclasses

import pytest

from dtlib.analytic.config import num_parameters
from dtlib.analytic.hardware import cluster, get_gpu
from dtlib.analytic.layout import Parallelism
from dtlib.analytic.presets import get_preset
from dtlib.plan.eager import PASSES, eager_forward_bytes
from dtlib.plan.launches import KERNEL_LAUNCH_S
from dtlib.plan.steptime import StepOptions, step_time

LLAMA8 = get_preset("llama3-8b")
H100 = get_gpu("h100-sxm")
PARAMS = num_parameters(LLAMA8)
EAGER = StepOptions(fused_elementwise=False, precision="fp32", dp_overlap=0.0)  # fp32 gradients: 4 bytes
LAYOUT = Parallelism(dp=8, micro_batch_size=1, num_microbatches=4)


def _terms(options, layout=LAYOUT, c=None):
    return step_time(LLAMA8, layout, c or cluster("h100-sxm", 1, 8), options=options).breakdown


def test_accumulating_in_a_pass_of_its_own_reads_two_and_writes_one_gradient_per_later_micro_batch():
    unfused = dataclasses.replace(EAGER, grad_accumulation_fusion=False)
    added = _terms(unfused)["elementwise"] - _terms(EAGER)["elementwise"]
    assert added == pytest.approx((4 - 1) * 3 * PARAMS * 4 / H100.memory_bandwidth, rel=1e-9)
    one = Parallelism(dp=8, micro_batch_size=4, num_microbatches=1)  # one micro-batch: nothing to add into
    assert _terms(unfused, one)["elementwise"] == _terms(EAGER, one)["elementwise"]


def test_a_flat_bucket_costs_six_passes_over_the_gradients_and_only_with_data_parallelism():
    copied = dataclasses.replace(EAGER, grad_bucket_copy=True)
    added = _terms(copied)["dp_comm"] - _terms(EAGER)["dp_comm"]
    assert added == pytest.approx(6 * PARAMS * 4 / H100.memory_bandwidth, rel=1e-9)
    tp = Parallelism(tp=8, micro_batch_size=1, num_microbatches=4)  # nothing reduced over data parallelism
    assert _terms(copied, tp)["dp_comm"] == _terms(EAGER, tp)["dp_comm"] == 0


def test_zero3_reducing_after_every_micro_batch_adds_the_other_micro_batches_reduce_scatters():
    per_micro = dataclasses.replace(EAGER, zero3_reduce_per_microbatch=True)

    def added(m):  # (m - 1) more reduce-scatters, each the same one
        zero3 = Parallelism(dp=8, micro_batch_size=1, num_microbatches=m, zero=3)
        return _terms(per_micro, zero3)["dp_comm"] - _terms(EAGER, zero3)["dp_comm"]

    assert added(1) == 0 and added(2) > 0
    assert added(4) == pytest.approx(3 * added(2), rel=1e-9)
    # ZeRO-1 and -2 reduce once per step whatever the option
    zero1 = LAYOUT.with_(zero=1)
    assert _terms(per_micro, zero1)["dp_comm"] == _terms(EAGER, zero1)["dp_comm"]


def test_zero3_reducing_after_every_micro_batch_accumulates_into_the_shards():
    # the later micro-batches add their gradients into this rank's 1/dp of them, not the whole
    unfused = dataclasses.replace(EAGER, grad_accumulation_fusion=False)
    zero3 = LAYOUT.with_(zero=3)
    once = _terms(unfused, zero3)["elementwise"] - _terms(EAGER, zero3)["elementwise"]
    assert once == pytest.approx((4 - 1) * 3 * PARAMS * 4 / H100.memory_bandwidth, rel=1e-9)
    per_micro = dataclasses.replace(unfused, zero3_reduce_per_microbatch=True)
    sharded = _terms(per_micro, zero3)["elementwise"] - _terms(EAGER, zero3)["elementwise"]
    assert sharded == pytest.approx(once / 8, rel=1e-9)


def test_zero3_unit_copies_pass_twice_over_the_weights_per_gather_and_six_times_over_the_gradients_per_reduce():
    zero3 = LAYOUT.with_(zero=3)  # 4 micro-batches: 8 gathers
    copies = dataclasses.replace(EAGER, zero3_unit_copies=True)
    added = _terms(copies, zero3)["dp_comm"] - _terms(EAGER, zero3)["dp_comm"]
    assert added == pytest.approx((2 * 8 + 6 * 1) * PARAMS * 4 / H100.memory_bandwidth, rel=1e-9)
    both = dataclasses.replace(copies, zero3_reduce_per_microbatch=True)  # and 4 reduce-scatters
    added = _terms(both, zero3)["dp_comm"] - _terms(dataclasses.replace(both, zero3_unit_copies=False), zero3)["dp_comm"]
    assert added == pytest.approx((2 * 8 + 6 * 4) * PARAMS * 4 / H100.memory_bandwidth, rel=1e-9)
    # nothing to copy without ZeRO-3 or without data parallelism
    for layout in (LAYOUT, LAYOUT.with_(zero=1), Parallelism(tp=8, micro_batch_size=1, num_microbatches=4)):
        assert _terms(copies, layout)["dp_comm"] == _terms(EAGER, layout)["dp_comm"]
    with pytest.raises(ValueError, match="zero3_unit_copies"):
        StepOptions(zero3_unit_copies="yes")


def test_zero3_kernels_cost_the_device_kernel_cost_per_layer_and_micro_batch_under_zero3_only():
    zero3 = LAYOUT.with_(zero=3)
    counted = dataclasses.replace(EAGER, zero3_kernels=214)
    added = _terms(counted, zero3)["launch"] - _terms(EAGER, zero3)["launch"]
    assert added == pytest.approx(LLAMA8.layers * 4 * 214 * KERNEL_LAUNCH_S, rel=1e-9)
    for layout in (LAYOUT, LAYOUT.with_(zero=1), Parallelism(tp=8, micro_batch_size=1, num_microbatches=4, zero=3)):
        assert _terms(counted, layout)["launch"] == _terms(EAGER, layout)["launch"]  # no FSDP, or no dp to shard over
    with pytest.raises(ValueError, match="zero3_kernels"):
        StepOptions(zero3_kernels=0)


def test_the_kernel_cost_is_the_devices_and_the_count_the_models():
    c = cluster("h100-sxm", 1, 8)
    slow = dataclasses.replace(c, gpu=dataclasses.replace(H100, kernel_launch_s=2e-5))
    assert H100.kernel_launch_s == KERNEL_LAUNCH_S
    assert _terms(EAGER, c=slow)["launch"] == pytest.approx(_terms(EAGER)["launch"] * 2e-5 / KERNEL_LAUNCH_S, rel=1e-12)
    counted = _terms(dataclasses.replace(EAGER, forward_kernels=56))["launch"]
    assert counted == pytest.approx(LLAMA8.layers * 4 * PASSES * 56 * KERNEL_LAUNCH_S, rel=1e-12)
    with pytest.raises(ValueError, match="forward_kernels"):
        StepOptions(forward_kernels=0)
    with pytest.raises(ValueError, match="kernel_launch_s"):
        dataclasses.replace(H100, kernel_launch_s=-1.0)


def test_without_sequence_parallelism_the_norms_and_residual_adds_run_whole_on_every_tensor_rank():
    h, kv, f = 4096, 1024, 14336
    inside = 20 * (h + kv) + 10 * f + 4 * (kv + h) + 4 * h
    outside = 2 * 36 * h + 2 * 6 * h
    assert eager_forward_bytes(h, kv, f, tp=4, sequence_parallel=False) == outside + inside / 4
    assert eager_forward_bytes(h, kv, f, tp=4, sequence_parallel=True) == (outside + inside) / 4
    tp = Parallelism(tp=8, micro_batch_size=1, num_microbatches=4)
    plain, sp = _terms(EAGER, tp), _terms(EAGER, tp.with_(sequence_parallel=True))
    assert plain["elementwise"] > sp["elementwise"]
