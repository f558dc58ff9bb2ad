"""Asynchronous SGD with a parameter server: SSP's bound holds, s = 0 is synchronous SGD."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtlib.launcher import launch
from dtlib.parallel.parameter_server import async_sgd, staleness_bound

TIMEOUT = 60
STEPS = 6
SHARD = 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(workers):
    g = torch.Generator().manual_seed(7)
    w_true = torch.randn(6, 2, generator=g)  # a target the model can learn
    xs = [torch.randn(workers * SHARD, 6, generator=g) for _ in range(STEPS)]
    return [(x, x @ w_true) for x in xs]


def _run(rank, world_size, bound, slowdowns, step_seconds=0.0):
    data = _data(world_size - 1)

    def loss_fn(model, worker, clock):  # worker k's shard of global batch `clock`
        x, y = data[clock % STEPS]  # a fast worker may go on past STEPS
        return F.mse_loss(model(x[worker * SHARD:(worker + 1) * SHARD]), y[worker * SHARD:(worker + 1) * SHARD])

    model = _model()
    out = async_sgd(rank, world_size, model, loss_fn, STEPS, lr=0.2, bound=bound, slowdowns=slowdowns,
                    step_seconds=step_seconds)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    return out


def test_bound_zero_is_synchronous_sgd():
    world = 4
    server = launch(_run, world, args=(0, [1.0, 2.0, 1.0]), timeout=TIMEOUT, output="none")[0]
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for x, y in _data(world - 1):  # one process, the whole global batch
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    for a, b in zip(server["params"], ref.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
    assert [u["worker"] for u in server["updates"]].count(1) == STEPS  # lockstep: STEPS each
    # every worker of a round read the same version: the one after the previous round
    assert all(u["read_version"] == u["clock"] * (world - 1) for u in server["updates"])
    assert max(u["staleness"] for u in server["updates"]) <= staleness_bound(world - 1, 0)


@pytest.mark.parametrize("bound", [1, 2, None])
def test_staleness_is_bounded_and_measured_per_update(bound):
    world = 4
    ranks = launch(_run, world, args=(bound, [3.0, 1.0, 1.0], 0.01), timeout=TIMEOUT, output="none")
    updates = ranks[0]["updates"]
    for k, f in enumerate([3.0, 1.0, 1.0]):  # each gradient: 10 ms of emulated device time, x f
        w = ranks[k + 1]
        assert w["work"] >= w["steps"] * 0.01
        assert w["slept"] == pytest.approx((f - 1) * w["work"])
        assert w["seconds"] >= w["steps"] * f * 0.01
    assert len(updates) == (world - 1) * STEPS
    assert [u["version"] for u in updates] == list(range(len(updates)))
    for k in range(world - 1):  # each worker's gradients arrive in clock order, one per clock
        clocks = [u["clock"] for u in updates if u["worker"] == k]
        assert clocks == list(range(len(clocks))) and len(clocks) >= 1
        assert ranks[k + 1]["steps"] >= len(clocks)  # a last gradient may come after the budget
    for u in updates:
        assert u["staleness"] == u["version"] - u["read_version"] >= 0
        if bound is not None:
            assert u["lead"] <= bound
            assert u["staleness"] <= staleness_bound(world - 1, bound)
    # the model trained: the final parameters fit the data better than the initial ones
    x = torch.cat([x for x, _ in _data(world - 1)])
    y = torch.cat([y for _, y in _data(world - 1)])
    trained = _model()
    with torch.no_grad():
        for p, q in zip(trained.parameters(), ranks[0]["params"]):
            p.copy_(q)
        assert F.mse_loss(trained(x), y) < F.mse_loss(_model()(x), y)


def test_bad_arguments_name_themselves():
    m = _model()
    with pytest.raises(ValueError, match="bound"):
        async_sgd(0, 2, m, None, 3, lr=0.1, bound=-1)
    with pytest.raises(ValueError, match="lr"):
        async_sgd(0, 2, m, None, 3, lr=-0.1)
    with pytest.raises(ValueError, match="slowdowns"):
        async_sgd(0, 3, m, None, 3, lr=0.1, slowdowns=[1.0, 0.5])
    with pytest.raises(ValueError, match="step_seconds"):
        async_sgd(0, 2, m, None, 3, lr=0.1, step_seconds=-0.01)
    with pytest.raises(ValueError, match="world_size"):
        async_sgd(0, 1, m, None, 3, lr=0.1)
    assert staleness_bound(3, None) == float("inf") and staleness_bound(3, 0) == 2
