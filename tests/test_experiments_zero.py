"""dtlib.experiments.zero.smallest_fitting_stage (lesson 4, Sec. 5): the smallest ZeRO stage whose
model states fit, per dtlib.analytic.memory."""
import pytest

from dtlib.experiments.zero import smallest_fitting_stage
from dtlib.analytic.hardware import get_gpu

H100 = get_gpu("h100-sxm").memory_bytes  # 80 GiB


@pytest.mark.parametrize("billions, stage", [(1, 0), (3, 0), (7, 1), (13, 2), (30, 3), (70, None)])
def test_lesson_table_on_8_h100s(billions, stage):
    # 2 + 2 + 12 bytes/param: 13B -> DDP 208 GB, ZeRO-1 71.5 GB, ZeRO-2 48.75 GB <= 0.8 x 80 GiB
    assert smallest_fitting_stage(billions * 1e9, dp=8, gpu_memory_bytes=H100) == stage


def test_budget_boundaries_by_hand():
    # 20B on 8 GPUs at 2 + 2 + 12 bytes/param (ZeRO paper), by hand: DDP 16 x 20e9 = 320 GB,
    # ZeRO-1 (2 + 2 + 12/8) x 20e9 = 110 GB, ZeRO-2 (2 + 14/8) x 20e9 = 75 GB, ZeRO-3 16/8 x 20e9 = 40 GB
    gb = 1e9
    assert smallest_fitting_stage(20e9, 8, 75 * gb, headroom=1.0) == 2
    assert smallest_fitting_stage(20e9, 8, 75 * gb - 1, headroom=1.0) == 3
    assert smallest_fitting_stage(20e9, 8, 110 * gb, headroom=1.0) == 1
    assert smallest_fitting_stage(20e9, 8, 320 * gb, headroom=1.0) == 0
    assert smallest_fitting_stage(20e9, 8, 40 * gb - 1, headroom=1.0) is None


def test_headroom_is_an_option():
    # 30B on 8 GPUs: ZeRO-3 holds 16 x 30e9 / 8 = 60 GB = 0.70 of 80 GiB
    assert smallest_fitting_stage(30e9, 8, H100, headroom=0.8) == 3
    assert smallest_fitting_stage(30e9, 8, H100, headroom=0.6) is None
    assert smallest_fitting_stage(30e9, 8, H100, headroom=1.0) == 3


def test_more_gpus_or_other_precision_change_the_answer():
    assert smallest_fitting_stage(70e9, 64, H100) == 3  # ZeRO-3: 16 x 70e9 / 64 = 17.5 GB
    # 4B: 16 bytes/param = 64 GB fits under DDP; megatron-bf16's 2 + 4 + 12 = 72 GB does not
    assert smallest_fitting_stage(4e9, 8, H100) == 0
    assert smallest_fitting_stage(4e9, 8, H100, prec="megatron-bf16") == 1


def test_model_shapes_and_presets():
    assert smallest_fitting_stage("llama3-8b", 8, H100) == 1  # 8.0B: DDP 128 GB; ZeRO-1 44 GB


@pytest.mark.parametrize("headroom", [0, -0.1, 1.01, 2, float("nan"), True, "0.8"])
def test_headroom_outside_0_1_raises(headroom):
    with pytest.raises(ValueError, match=r"headroom must be a finite number > 0 and <= 1, got"):
        smallest_fitting_stage(1e9, 8, H100, headroom=headroom)


@pytest.mark.parametrize("memory", [0, -1, float("nan"), float("inf")])
def test_gpu_memory_must_be_positive(memory):
    with pytest.raises(ValueError, match="gpu_memory_bytes must be a finite number > 0, got"):
        smallest_fitting_stage(1e9, 8, memory)


def test_bad_dp_raises():
    with pytest.raises(ValueError, match="dp"):
        smallest_fitting_stage(1e9, 0, H100)
