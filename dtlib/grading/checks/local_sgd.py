"""Checks for lesson 11's exercise: DiLoCo's outer step and the sample-weighted gradient average.

Both run the learner's function, and only it, on real ranks (:func:`dtlib.launch`); what it
is compared with (one outer step written out, DiLoCo with ``torch.optim.SGD(nesterov=True)`` as
the outer optimizer as :class:`dtlib.parallel.local_sgd.DiLoCo` runs it, the sample-weighted
mean, one process on the whole batch) is computed in the check's own process after the launch
(issue 39). They name the classic mistakes.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dtlib.grading.checks import max_diff
from dtlib.grading.checks.data_parallel import probe_model
from dtlib.grading.feedback import launch_checked

__all__ = ["check_outer_step", "check_diloco_rounds", "check_weighted_average",
           "check_uneven_batches_match_one_process"]

LR, MOMENTUM = 0.7, 0.9


# ---- Q1: the outer step --------------------------------------------------------------------------
def _probe_state(rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    # global parameters equal everywhere; local ones moved differently on each rank; a momentum
    # buffer that is not zero, so that forgetting momentum or Nesterov shows
    g = torch.Generator().manual_seed(5)
    glob = [torch.randn(3, 2, generator=g), torch.randn(4, generator=g)]
    bufs = [0.1 * torch.randn(t.shape, generator=g) for t in glob]
    local_g = torch.Generator().manual_seed(100 + rank)
    params = [t + 0.3 * torch.randn(t.shape, generator=local_g) for t in glob]
    return params, glob, bufs


def _outer_worker(rank: int, world_size: int, fn: Callable) -> dict:
    params, glob, bufs = _probe_state(rank)
    with torch.no_grad():
        fn(params, glob, bufs, LR, MOMENTUM)
    return {"params": params, "global": glob, "bufs": bufs}


def _expected_outer(world_size: int, variant: str = "right") -> dict:
    """What every rank should hold after one outer step (``variant``: a classic mistake's result)."""
    states = [_probe_state(r) for r in range(world_size)]
    _, glob, bufs = (list(map(torch.clone, x)) for x in states[0])
    params_out = []
    for i in range(len(glob)):
        deltas = [glob[i] - s[0][i] for s in states]
        if variant == "sign":
            deltas = [-d for d in deltas]
        delta = sum(deltas) if variant == "sum" else sum(deltas) / world_size
        bufs[i] = MOMENTUM * bufs[i] + delta
        step = bufs[i] if variant == "heavy_ball" else delta + MOMENTUM * bufs[i]
        glob[i] = glob[i] - LR * step
        params_out.append(glob[i].clone())
    return {"params": params_out, "global": glob, "bufs": bufs}


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b))


def check_outer_step(fn: Callable, world_size: int = 2) -> None:
    """``fn(params, global_params, momentum_buffers, lr, momentum)`` on ``world_size`` ranks does
    DiLoCo's outer step: average the pseudo-gradient, Nesterov update, everyone restarts there."""
    out = launch_checked(_outer_worker, world_size, (fn,), timeout=30)
    want = _expected_outer(world_size)
    for rank, got in enumerate(out):
        if _close(got["global"], want["global"]):
            assert _close(got["bufs"], want["bufs"]), (
                "the global parameters are right but momentum_buffers were not updated in place "
                "(step 3 of the question): the next round must remember the momentum")
            assert _close(got["params"], want["global"]), (
                "the global parameters are right but params still hold this rank's local ones "
                "(step 4 of the question): every rank must start the next round from the new global ones")
            continue
        mistakes = {
            "sign": "the step goes the wrong way: check the sign of the pseudo-gradient (step 1 of the question)",
            "sum": "the pseudo-gradients are summed over ranks, not averaged (step 2 of the question)",
            "heavy_ball": "that is heavy-ball momentum (a step along the buffer alone), not Nesterov's "
                          "(step 3 of the question)",
        }
        for variant, hint in mistakes.items():
            if _close(got["global"], _expected_outer(world_size, variant)["global"]):
                raise AssertionError(hint)
        if _close(got["global"], _probe_state(rank)[1]):
            raise AssertionError("global_params did not change: update them in place "
                                 "(g.sub_(lr * ...)), the caller keeps the same list")
        raise AssertionError(
            f"rank {rank}'s new global parameters are off by "
            f"{max_diff(got['global'], want['global']):.3g}: "
            "follow steps 1-4 of the question in order (pseudo-gradient, average, momentum, step)")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _rounds_data(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(50 + rank)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(steps)]


def _rounds_worker(rank: int, world_size: int, fn: Callable, h: int, rounds: int) -> list[torch.Tensor]:
    """DiLoCo with the learner's outer step only: the reference is the check's, computed in its
    own process (issue 39)."""
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=0.02)
    glob = [p.detach().clone() for p in model.parameters()]
    bufs = [torch.zeros_like(p) for p in glob]
    for step, (x, y) in enumerate(_rounds_data(rank, h * rounds)):
        F.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        if (step + 1) % h == 0:
            with torch.no_grad():
                fn([p.data for p in model.parameters()], glob, bufs, LR, MOMENTUM)
    return [p.detach().clone() for p in model.parameters()]


def _diloco_reference(world_size: int, h: int, rounds: int) -> list[torch.Tensor]:
    """The global parameters after ``rounds`` rounds of DiLoCo (Douillard et al. 2023,
    Algorithm 1), the ranks simulated in this process: each replica's AdamW on its own data, and
    every ``h`` steps ``torch.optim.SGD(nesterov=True)`` stepping the global copy along the mean
    pseudo-gradient (what :class:`dtlib.parallel.local_sgd.DiLoCo` does over real ranks)."""
    with torch.random.fork_rng(devices=[]):  # _model seeds: leave the caller's generator be
        replicas, glob = [_model() for _ in range(world_size)], _model()
    inners = [torch.optim.AdamW(m.parameters(), lr=0.02) for m in replicas]
    outer = torch.optim.SGD(glob.parameters(), lr=LR, momentum=MOMENTUM, nesterov=True)
    data = [_rounds_data(rank, h * rounds) for rank in range(world_size)]
    for step in range(h * rounds):
        for model, inner, batches in zip(replicas, inners, data):
            x, y = batches[step]
            F.mse_loss(model(x), y).backward()
            inner.step()
            inner.zero_grad()
        if (step + 1) % h == 0:
            with torch.no_grad():
                for i, g in enumerate(glob.parameters()):
                    g.grad = sum(g - list(m.parameters())[i] for m in replicas) / world_size
                outer.step()
                outer.zero_grad(set_to_none=True)
                for model in replicas:
                    for p, g in zip(model.parameters(), glob.parameters()):
                        p.copy_(g)
    return [p.detach().clone() for p in glob.parameters()]


def check_diloco_rounds(fn: Callable, world_size: int = 3, h: int = 3, rounds: int = 3) -> None:
    """``rounds`` rounds of DiLoCo (AdamW inside, H = ``h``) with your outer step end where
    dtlib's DiLoCo (``torch.optim.SGD(nesterov=True)`` as the outer optimizer) ends."""
    out = launch_checked(_rounds_worker, world_size, (fn, h, rounds), timeout=60)
    want = _diloco_reference(world_size, h, rounds)  # after the launch: no rank holds it
    if any(not _close(r, want) for r in out):
        # a wrong single step is the first check's to name (item 9 of issue 28: this check used to
        # blame the momentum buffer for every mistake)
        try:
            check_outer_step(fn, world_size)
        except AssertionError as exc:
            raise AssertionError("one outer step is already wrong (the check above names why): fix it "
                                 "first") from exc
    for rank, r in enumerate(out):
        assert _close(r, out[0]), (
            f"rank {rank} ends with different parameters from rank 0: after the outer step every "
            "rank must hold the same (averaged, stepped) global parameters")
        assert _close(r, want), (
            f"after {rounds} rounds your DiLoCo differs from torch's Nesterov SGD on the averaged "
            "pseudo-gradient by "
            f"{max_diff(r, want):.3g}, though one "
            "outer step is right: the momentum buffers must carry over from round to round")


# ---- Q2: the sample-weighted gradient average ---------------------------------------------------
SAMPLES = (3, 1, 5, 2)  # rank 0 not 1: dividing by its own count must show


def _weighted_worker(rank: int, world_size: int, fn: Callable) -> dict:
    model = probe_model(rank)
    fn(model, SAMPLES[rank])
    return {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}


def check_weighted_average(fn: Callable, world_size: int = 3) -> None:
    """``fn(model, num_samples)`` leaves sum_r n_r g_r / sum_r n_r in every gradient, weights alone."""
    out = launch_checked(_weighted_worker, world_size, (fn,), timeout=30)
    n = SAMPLES[:world_size]
    for i, name in enumerate(out[0]):
        grads = [10.0 * (r + 1) + i for r in range(world_size)]
        want = sum(k * g for k, g in zip(n, grads)) / sum(n)
        for rank, res in enumerate(out):
            weight, grad = res[name]
            assert torch.all(weight == rank + 1.0 + i), (
                f"the weights ({name}) changed on rank {rank}: weight the gradients (p.grad), "
                "never the parameters")
            got = grad.flatten()[0].item()
            if abs(got - want) < 1e-4 * abs(want):
                continue
            plain = sum(grads) / world_size
            if abs(got - plain) < 1e-4 * abs(plain):
                raise AssertionError(
                    "that is the plain mean over ranks, which over-weights the ranks with few "
                    "samples: multiply each gradient by num_samples, all-reduce, and divide by "
                    "the total number of samples")
            if abs(got - want * sum(n)) < 1e-4 * abs(want * sum(n)):
                raise AssertionError("gradients hold the weighted sum: divide by the total number "
                                     "of samples over all ranks")
            if abs(got - want * sum(n) / n[rank]) < 1e-4 * abs(want * sum(n) / n[rank]):
                raise AssertionError(
                    "you divided by this rank's own sample count: divide by the total over all "
                    "ranks (all_reduce the count too)")
            raise AssertionError(
                f"rank {rank}'s gradient of {name} is {got:g}, expected the sample-weighted mean "
                f"{want:g} (samples per rank {list(n)}): sum_r n_r g_r / sum_r n_r")


def _uneven_worker(rank: int, world_size: int, fn: Callable, sizes: tuple[int, ...], steps: int) -> list:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    g = torch.Generator().manual_seed(9)
    begin = sum(sizes[:rank])
    for _ in range(steps):
        x, y = torch.randn(sum(sizes), 6, generator=g), torch.randn(sum(sizes), 3, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x[begin:begin + sizes[rank]]), y[begin:begin + sizes[rank]]).backward()
        fn(model, sizes[rank])
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_uneven_batches_match_one_process(fn: Callable, sizes: tuple[int, ...] = (2, 7, 3),
                                           steps: int = 3) -> None:
    """Ranks with ``sizes`` samples each, averaging with ``fn``, train exactly like one process on
    the whole global batch."""
    out = launch_checked(_uneven_worker, len(sizes), (fn, sizes, steps), timeout=60)
    with torch.random.fork_rng(devices=[]):  # _model seeds: leave the caller's generator be
        ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    g = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x, y = torch.randn(sum(sizes), 6, generator=g), torch.randn(sum(sizes), 3, generator=g)
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    for rank, params in enumerate(out):
        diff = max_diff(params, [p.detach() for p in ref.parameters()])
        assert diff < 1e-5, (  # False for NaN
            f"with {list(sizes)} samples per rank, rank {rank} ends {diff:.2e} away from one "
            "process on the whole batch: weight each rank's gradient by its sample count")
