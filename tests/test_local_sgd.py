"""LocalSGD and DiLoCo: equal to DDP where the algebra says so, to torchft's own, and 1/H of the bytes."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtlib.experiments.local_sgd import torchft_manager
from dtlib.launcher import launch
from dtlib.measure import CollectiveCounter
from dtlib.parallel import BucketedDDP
from dtlib.parallel.local_sgd import DiLoCo, LocalSGD, outer_nesterov_step

TIMEOUT = 60
WORLD = 2


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _batches(rank, steps, batch=6):
    g = torch.Generator().manual_seed(1000 + rank)  # every rank its own data
    return [(torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)) for _ in range(steps)]


def _loss(model, x, y):
    return F.mse_loss(model(x), y)


def _train(model, opt, data):
    for x, y in data:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _sgd_outer(model, lr, momentum):
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)


def _equalities(rank, world_size, steps):
    data = _batches(rank, steps)
    out = {}
    # synchronous DDP (PyTorch's) with SGD: the reference
    ddp = nn.parallel.DistributedDataParallel(_model())
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), data)
    out["ddp"] = _params(ddp.module)
    # local SGD, H = 1, SGD
    m = _model(seed=rank)  # LocalSGD does not broadcast: start equal, as after DDP's broadcast
    m.load_state_dict(_model().state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with LocalSGD(m, opt, sync_every=1) as local:
        _train(m, opt, data)
    out["local_h1"], out["local_h1_syncs"] = _params(m), local.syncs
    # DiLoCo, H = 1, inner SGD, outer SGD lr 1 without momentum
    m = _model(seed=rank)
    inner = torch.optim.SGD(m.parameters(), lr=0.1)
    with DiLoCo(m, inner, _sgd_outer(m, 1.0, 0.0), sync_every=1):
        _train(m, inner, data)
    out["diloco_h1"] = _params(m)
    # H = 3 with AdamW inner: DiLoCo with outer SGD(lr=1) averages the parameters = local SGD
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    with LocalSGD(m, inner, sync_every=3):
        _train(m, inner, data)
    out["local_h3_adamw"] = _params(m)
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    with DiLoCo(m, inner, _sgd_outer(m, 1.0, 0.0), sync_every=3):
        _train(m, inner, data)
    out["diloco_h3_lr1"] = _params(m)
    # DiLoCo with Nesterov (torch.optim.SGD) against the outer step written out by hand
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    with DiLoCo(m, inner, _sgd_outer(m, 0.7, 0.9), sync_every=3) as diloco:
        _train(m, inner, data)
    out["diloco_nesterov"], out["diloco_bytes"] = _params(m), diloco.payload_bytes
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    global_params = _params(m)
    bufs = [torch.zeros_like(p) for p in global_params]
    for step, (x, y) in enumerate(data):
        _loss(m, x, y).backward()
        inner.step()
        inner.zero_grad()
        if (step + 1) % 3 == 0:
            with torch.no_grad():
                outer_nesterov_step(list(m.parameters()), global_params, bufs, lr=0.7, momentum=0.9)
    out["by_hand"] = _params(m)
    return out


def test_local_sgd_and_diloco_equalities():
    steps = 6
    ranks = launch(_equalities, WORLD, args=(steps,), timeout=TIMEOUT, output="none")
    r0, r1 = ranks
    for name in ("ddp", "local_h1", "diloco_h1", "local_h3_adamw", "diloco_h3_lr1", "diloco_nesterov"):
        for a, b in zip(r0[name], r1[name]):  # replicas agree after every synchronisation
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b, c in zip(r0["ddp"], r0["local_h1"], r0["diloco_h1"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # H=1 local SGD = DDP
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-6)  # H=1, outer SGD lr 1 = DDP
    for a, b in zip(r0["local_h3_adamw"], r0["diloco_h3_lr1"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # outer lr 1, no momentum = averaging
    for a, b in zip(r0["diloco_nesterov"], r0["by_hand"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)  # torch's Nesterov SGD = Algorithm 1
    # and the algorithms are not trivially equal: Nesterov moved elsewhere than averaging
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(r0["diloco_nesterov"], r0["local_h3_adamw"]))
    assert r0["local_h1_syncs"] == steps
    n_bytes = sum(p.numel() * 4 for p in _model().parameters())
    assert r0["diloco_bytes"] == steps // 3 * n_bytes


def _against_torchft(rank, world_size, steps, h):
    from torchft.local_sgd import DiLoCo as FTDiLoCo
    from torchft.local_sgd import LocalSGD as FTLocalSGD

    data = _batches(rank, steps)
    out = {}
    ft_model = _model()
    manager, shutdown = torchft_manager(rank, world_size, ft_model, timeout=TIMEOUT / 2)
    try:
        # local SGD with AdamW inside: torchft's and ours on the same data, in the same run
        ft_opt = torch.optim.AdamW(ft_model.parameters(), lr=0.01)
        with FTLocalSGD(manager, ft_model, ft_opt, sync_every=h):
            _train(ft_model, ft_opt, data)
        out["ft_local"] = _params(ft_model)
        ft_model.load_state_dict(_model().state_dict())
        inner = torch.optim.AdamW(ft_model.parameters(), lr=0.01)
        with FTDiLoCo(manager, [ft_model], inner, _sgd_outer(ft_model, 0.7, 0.9), sync_every=h):
            _train(ft_model, inner, data)
        out["ft_diloco"] = _params(ft_model)
    finally:
        shutdown()
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    with LocalSGD(m, opt, sync_every=h):
        _train(m, opt, data)
    out["local"] = _params(m)
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    with DiLoCo(m, inner, _sgd_outer(m, 0.7, 0.9), sync_every=h):
        _train(m, inner, data)
    out["diloco"] = _params(m)
    return out


def test_equal_to_torchft_local_sgd_and_diloco():
    pytest.importorskip("torchft")
    ranks = launch(_against_torchft, WORLD, args=(6, 3), timeout=TIMEOUT, output="none")
    for r in ranks:
        for a, b in zip(r["ft_local"], r["local"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for a, b in zip(r["ft_diloco"], r["diloco"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    start = _params(_model())
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(ranks[0]["diloco"], start))  # it trained


def _count_bytes(rank, world_size, steps, h):
    data = _batches(rank, steps)
    ddp = BucketedDDP(_model(), bucket_size_mb=1.0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with CollectiveCounter() as ddp_count:
        for x, y in data:
            _loss(ddp, x, y).backward()
            ddp.finish_gradient_synchronization()
            opt.step()
            opt.zero_grad()
    m = _model()
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    diloco = DiLoCo(m, inner, _sgd_outer(m, 0.7, 0.9), sync_every=h)
    with diloco, CollectiveCounter() as diloco_count:
        _train(m, inner, data)
    return (ddp_count.bytes("all_reduce"), ddp_count.counts["all_reduce"],
            diloco_count.bytes("all_reduce"), diloco_count.counts["all_reduce"], diloco.payload_bytes)


def test_diloco_sends_one_hth_of_ddp_bytes():
    steps, h = 8, 4
    ddp_bytes, ddp_calls, diloco_bytes, diloco_calls, counted = launch(
        _count_bytes, WORLD, args=(steps, h), timeout=TIMEOUT, output="none")[0]
    assert ddp_calls == steps and diloco_calls == steps // h
    assert diloco_bytes * h == ddp_bytes  # measured by the dispatch-mode counter, not assumed
    assert counted == diloco_bytes


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_sync_every_must_be_a_positive_integer(bad):
    m = _model()
    with pytest.raises(ValueError, match="sync_every"):
        LocalSGD(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=bad)
    with pytest.raises(ValueError, match="sync_every"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), _sgd_outer(m, 0.7, 0.9), sync_every=bad)


def test_outer_step_rejects_a_bad_learning_rate_or_momentum():
    p = [torch.zeros(2)]
    with pytest.raises(ValueError, match="lr"):
        outer_nesterov_step(p, [torch.ones(2)], [torch.zeros(2)], lr=-0.7, momentum=0.9)
    with pytest.raises(ValueError, match="momentum"):
        outer_nesterov_step(p, [torch.ones(2)], [torch.zeros(2)], lr=0.7, momentum=-0.1)


# ---- checkpoints mid-round (state_dict / load_state_dict) ---------------------------------------
H, STEPS, STOP = 4, 8, 6  # sync every 4 inner steps; interrupted after step 6, mid-way through round 2


def _build(rank, kind):
    """A fresh model, inner optimizer and LocalSGD/DiLoCo, as a restarted process builds them."""
    m = _model(seed=rank)  # DiLoCo broadcasts rank 0's parameters; LocalSGD starts equal:
    if kind == "local_sgd":
        m.load_state_dict(_model().state_dict())
    inner = torch.optim.AdamW(m.parameters(), lr=0.01)
    algo = LocalSGD(m, inner, sync_every=H) if kind == "local_sgd" else \
        DiLoCo(m, inner, _sgd_outer(m, 0.7, 0.9), sync_every=H)
    return m, inner, algo


def _resume_mid_round(rank, world_size, kind):
    data = _batches(rank, STEPS)
    m, inner, algo = _build(rank, kind)
    with algo:
        _train(m, inner, data)
    straight = _params(m)
    m, inner, algo = _build(rank, kind)
    with algo:
        _train(m, inner, data[:STOP])
    saved = copy.deepcopy({"model": m.state_dict(), "inner": inner.state_dict(), "algo": algo.state_dict()})
    runs = {}
    for restore in (True, False):  # with the algorithm's state, and (the old behaviour) without it
        m, inner, algo = _build(rank, kind)
        m.load_state_dict(saved["model"])  # each rank its own, drifted parameters
        inner.load_state_dict(saved["inner"])
        if restore:
            algo.load_state_dict(copy.deepcopy(saved["algo"]))
        with algo:
            _train(m, inner, data[STOP:])
        runs[restore] = (_params(m), algo.syncs)
    return straight, runs, saved["algo"]["local_step"]


@pytest.mark.parametrize("kind", ["diloco", "local_sgd"])
def test_resume_mid_round_equals_the_uninterrupted_run_bit_for_bit(kind):
    """8 inner steps syncing every 4, interrupted after step 6 (2 steps into the second round) and
    resumed in rebuilt objects: with ``load_state_dict`` the parameters equal the uninterrupted
    run's bit for bit on every rank; without it they do not (DiLoCo's anchor becomes rank 0's
    parameters, LocalSGD syncs 2 steps late)."""
    for straight, runs, local_step in launch(_resume_mid_round, WORLD, args=(kind,), timeout=TIMEOUT, output="none"):
        assert local_step == STOP % H
        resumed, syncs = runs[True]
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
        assert syncs == STEPS // H
        forgot, _ = runs[False]
        assert not all(torch.equal(a, b) for a, b in zip(straight, forgot))


def test_load_state_dict_names_what_does_not_fit():
    m, inner, algo = _build(0, "diloco")
    state = algo.state_dict()
    with pytest.raises(ValueError, match="local_step"):
        algo.load_state_dict({**state, "local_step": H})
    with pytest.raises(ValueError, match="global_params"):
        algo.load_state_dict({**state, "global_params": state["global_params"][:1]})
    with pytest.raises(ValueError, match="global_params"):
        algo.load_state_dict({k: v for k, v in state.items() if k != "global_params"})
