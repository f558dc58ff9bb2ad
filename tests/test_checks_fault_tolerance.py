"""Lesson 8's graded checks: the reference resume logic passes; forgetting the optimizer, the RNG or
the data position fails with the message naming it; the interval calculator's classic slips."""
import math

import pytest
import torch

from dtlib.grading.checks import fault_tolerance as checks


def save_state(step, model, optimizer):
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state()}


def restore(state, model, optimizer):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return state["step"]


def restore_no_optimizer(state, model, optimizer):
    model.load_state_dict(state["model"])
    torch.set_rng_state(state["rng"])
    return state["step"]


def restore_no_rng(state, model, optimizer):
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"]


def restore_from_zero(state, model, optimizer):
    restore(state, model, optimizer)
    return 0


def test_reference_resume_passes():
    checks.check_resume(save_state, restore)


@pytest.mark.parametrize("wrong, message", [
    (restore_no_optimizer, "the optimizer state was not restored"),
    (restore_no_rng, "the RNG state was not restored"),
    (restore_from_zero, r"the data position was not restored: restore returned 0, so the resumed run saw "
                        r"batches \[0, 1, 2\] twice"),
])
def test_forgotten_state_is_named(wrong, message):
    with pytest.raises(AssertionError, match=message):
        checks.check_resume(save_state, wrong)


def test_a_raising_save_state_is_reported():
    def broken(step, model, optimizer):
        raise KeyError("oops")
    with pytest.raises(AssertionError, match="save_state raised: KeyError"):
        checks.check_resume(broken, restore)


def young(checkpoint_seconds, gpus, gpu_mtbf_hours):
    return math.sqrt(2 * checkpoint_seconds * gpu_mtbf_hours * 3600 / gpus)


@pytest.mark.parametrize("wrong, message", [
    (lambda c, g, m: math.sqrt(2 * c * m * 3600), "divide the per-GPU MTBF by the number of GPUs"),
    (lambda c, g, m: math.sqrt(2 * c * m / g), "convert the MTBF from hours to seconds"),
    (lambda c, g, m: math.sqrt(c * m * 3600 / g), "the factor 2 is missing"),
    (lambda c, g, m: 2 * c * m * 3600 / g, "the square root of 2 C M"),
    (lambda c, g, m: c, "expected"),
])
def test_interval_calculator(wrong, message):
    checks.check_optimal_interval(young)
    with pytest.raises(AssertionError, match=message):
        checks.check_optimal_interval(wrong)
