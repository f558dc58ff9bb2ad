"""Lesson 1's library: hand-written DP equals single-process and torch DDP; the graded checks
accept the correct answer and reject the classic mistakes."""
import pytest
import torch
import torch.distributed as dist

from dtlib.grading.checks import data_parallel as checks
from dtlib.data import load_mnist
from dtlib.launcher import launch
from dtlib.experiments.scaling_efficiency import scaling_efficiency
from dtlib.experiments.data_parallel import average_gradients, lr_at_step, train


@pytest.fixture(scope="module")
def digits():
    return load_mnist("train", verbose=False).subset(256)


def test_manual_dp_equals_single_process_and_torch_ddp(digits):
    single = train(0, 1, digits, steps=4, global_batch=32, sync=None)
    ours = launch(train, 2, args=(digits, 4, 32, 0.05, average_gradients), timeout=60)
    ddp = launch(train, 2, args=(digits, 4, 32, 0.05, "ddp"), timeout=60)
    for k, v in single["state"].items():
        assert torch.allclose(ours[0]["state"][k], v, atol=1e-5)
        assert torch.equal(ours[0]["state"][k], ours[1]["state"][k])
        assert torch.allclose(ddp[0]["state"][k], ours[0]["state"][k], atol=1e-5)
    # and without synchronisation the ranks drift apart: the check above is not vacuous
    drift = launch(train, 2, args=(digits, 4, 32, 0.05, None), timeout=60)
    assert not torch.equal(drift[0]["state"]["classifier.3.weight"], drift[1]["state"]["classifier.3.weight"])


def test_uneven_global_batch_is_rejected(digits):
    with pytest.raises(ValueError, match="divisible by world_size"):
        train(0, 3, digits, global_batch=32)


def test_lr_schedule_follows_goyal():
    assert lr_at_step(0, 0.1, 256, 8192, warmup_steps=10) == pytest.approx(0.1)
    assert lr_at_step(5, 0.1, 256, 8192, warmup_steps=10) == pytest.approx(0.1 + (3.2 - 0.1) / 2)
    assert lr_at_step(10, 0.1, 256, 8192, warmup_steps=10) == pytest.approx(3.2)
    with pytest.raises(ValueError):
        lr_at_step(0, -1, 256, 256)


def test_scaling_efficiency():
    assert scaling_efficiency({1: 100.0, 2: 180.0, 4: 200.0}) == {1: 1.0, 2: 0.9, 4: 0.5}
    with pytest.raises(ValueError, match="1-rank throughput"):
        scaling_efficiency({2: 10.0})


def _sum_only(model, world_size):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def _average_weights(model, world_size):  # the well-known teaching bug
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= world_size


def _last_param_only(model, world_size):
    p = list(model.parameters())[-1]
    dist.all_reduce(p.grad)
    p.grad /= world_size


def test_average_gradients_check_accepts_correct_rejects_bugs(digits):
    checks.check_average_gradients(average_gradients)
    checks.check_matches_single_process(average_gradients, digits)
    with pytest.raises(AssertionError, match="sum over ranks"):
        checks.check_average_gradients(_sum_only)
    with pytest.raises(AssertionError, match="weights .* changed"):
        checks.check_average_gradients(_average_weights)
    with pytest.raises(AssertionError, match="expected the mean"):
        checks.check_average_gradients(_last_param_only)
    with pytest.raises(AssertionError, match="different parameters|differs from single-process"):
        checks.check_matches_single_process(lambda m, w: None, digits)


def _rank0_only(model, world_size):
    if dist.get_rank() == 0:  # rank 1 skips the collective and returns
        average_gradients(model, world_size)


def test_a_skipped_collective_is_named_first_not_gloos_transport_error():
    with pytest.raises(AssertionError) as failed:
        checks.check_average_gradients(_rank0_only)
    first = str(failed.value).splitlines()[0]
    assert "ranks [1] never called" in first and "same collectives in the same order" in first
    assert "GLHF" not in first and "Connection closed" not in first
    assert "--- traceback of rank 0 ---" in str(failed.value)  # the detail is still there, below


def test_lr_and_efficiency_checks():
    checks.check_lr_schedule(lr_at_step)
    with pytest.raises(AssertionError):
        checks.check_lr_schedule(lambda s, lr, b0, b, w: lr * b / b0)  # no warm-up
    checks.check_scaling_efficiency(scaling_efficiency)
    with pytest.raises(AssertionError) as info:
        checks.check_scaling_efficiency(lambda t: {n: v / t[1] for n, v in t.items()})
    # a mistake the check cannot name: its first line (all the learner sees at first) gives the case too
    assert str(info.value).splitlines()[0].startswith("efficiency at N=2 should be ")
    assert "for the throughputs N=1: " in str(info.value).splitlines()[0]


def test_train_follows_the_scaled_schedule_with_warm_up():
    from dtlib.data import load_mnist
    from dtlib.viz.training import plot_lr_schedules

    data = load_mnist("train", verbose=False).subset(256)
    run = train(0, 1, data, steps=6, global_batch=128, lr=0.01, sync=None, base_batch=32, warmup_steps=4)
    want = [lr_at_step(s, 0.01, 32, 128, warmup_steps=4) for s in range(6)]
    assert run["lrs"] == pytest.approx(want) and run["lrs"][0] == 0.01 and run["lrs"][-1] == pytest.approx(0.04)
    assert train(0, 1, data, steps=2, global_batch=128, lr=0.01, sync=None)["lrs"] == [0.01, 0.01]
    assert len(plot_lr_schedules({"rule": want}, {"run": run["lrs"]}).axes[0].lines) == 2
