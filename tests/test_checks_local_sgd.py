"""Lesson 11's graded checks accept the reference answers and name the classic mistakes."""
import pytest
import torch
import torch.distributed as dist

from dtlib.grading.checks import local_sgd as checks
from dtlib.parallel.heterogeneous import weighted_average_gradients
from dtlib.launcher import launch
from dtlib.parallel.local_sgd import DiLoCo, outer_nesterov_step


def _reference_outer(params, global_params, bufs, lr, momentum):
    outer_nesterov_step(params, global_params, bufs, lr, momentum)


def _outer(sign=1.0, average=True, nesterov=True, copy=True, update_bufs=True):
    def fn(params, global_params, bufs, lr, momentum):
        world = dist.get_world_size()
        for p, g, b in zip(params, global_params, bufs):
            delta = sign * (g - p)
            dist.all_reduce(delta)
            if average:
                delta /= world
            buf = b.mul_(momentum).add_(delta) if update_bufs else momentum * b + delta
            g.sub_(lr * (delta + momentum * buf if nesterov else buf))
            if copy:
                p.copy_(g)
    return fn


def test_outer_step_checks_accept_the_reference():
    checks.check_outer_step(_reference_outer)
    checks.check_outer_step(_outer(), world_size=3)
    checks.check_diloco_rounds(_reference_outer)


@pytest.mark.parametrize("mistake, message", [
    (dict(sign=-1.0), "wrong way: check the sign of the pseudo-gradient"),
    (dict(average=False), "summed over ranks, not averaged"),
    (dict(nesterov=False), "heavy-ball momentum"),
    (dict(copy=False), "params still hold this rank's local ones"),
    (dict(update_bufs=False), "momentum_buffers were not updated in place"),
])
def test_outer_step_check_names_each_mistake(mistake, message):
    with pytest.raises(AssertionError) as failed:
        checks.check_outer_step(_outer(**mistake))
    assert message in str(failed.value).splitlines()[0]


@pytest.mark.parametrize("wrong", [lambda *args: None, _outer(average=False)], ids=["unfilled", "summed"])
def test_the_rounds_check_does_not_blame_momentum_for_a_wrong_step(wrong):
    """Issue 28, item 9: Q1's second check blamed the momentum buffer for every mistake."""
    with pytest.raises(AssertionError) as failed:
        checks.check_diloco_rounds(wrong)
    first = str(failed.value).splitlines()[0]
    assert first.startswith("one outer step is already wrong") and "fix it first" in first
    assert "momentum" not in first


def test_unfinished_and_hanging_outer_steps_fail_with_a_hint():
    with pytest.raises(AssertionError, match="did not change"):
        checks.check_outer_step(lambda *args: None)

    def rank0_only(params, global_params, bufs, lr, momentum):
        if dist.get_rank() == 0:
            _reference_outer(params, global_params, bufs, lr, momentum)
    with pytest.raises(AssertionError) as failed:
        checks.check_outer_step(rank0_only)
    assert "same collectives in the same order" in str(failed.value).splitlines()[0]


def _plain_mean(model, num_samples):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


def _own_count(model, num_samples):
    for p in model.parameters():
        p.grad *= num_samples
        dist.all_reduce(p.grad)
        p.grad /= num_samples


def _no_division(model, num_samples):
    for p in model.parameters():
        p.grad *= num_samples
        dist.all_reduce(p.grad)


def test_weighted_average_checks_accept_the_reference():
    checks.check_weighted_average(weighted_average_gradients)
    checks.check_weighted_average(weighted_average_gradients, world_size=4)
    checks.check_uneven_batches_match_one_process(weighted_average_gradients)


@pytest.mark.parametrize("fn, message", [
    (_plain_mean, "plain mean over ranks"),
    (_own_count, "divided by this rank's own sample count"),
    (_no_division, "weighted sum: divide by the total"),
])
def test_weighted_average_check_names_each_mistake(fn, message):
    with pytest.raises(AssertionError) as failed:
        checks.check_weighted_average(fn)
    assert message in str(failed.value).splitlines()[0]
    with pytest.raises(AssertionError, match="weight each rank's gradient by its sample count"):
        checks.check_uneven_batches_match_one_process(fn)


def _dtlib_diloco(rank, world_size, h, rounds):
    model = checks._model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)
    outer = torch.optim.SGD(model.parameters(), lr=checks.LR, momentum=checks.MOMENTUM, nesterov=True)
    ctx = DiLoCo(model, inner, outer, sync_every=h)
    for step, (x, y) in enumerate(checks._rounds_data(rank, h * rounds)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        if (step + 1) % h == 0:
            ctx.sync()
    return [p.detach().clone() for p in model.parameters()]


def test_the_rounds_reference_is_dtlibs_diloco_on_real_ranks():
    """The check simulates the ranks in its own process (issue 39: no reference where learner code
    runs); dtlib's DiLoCo over 3 real ranks ends at the same parameters."""
    want = checks._diloco_reference(3, 3, 3)
    for params in launch(_dtlib_diloco, 3, args=(3, 3), timeout=60, output="none"):
        assert checks._close(params, want)
