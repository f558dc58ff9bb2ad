"""Checks for the tensor-parallel exercise: the learner's f and g operators and a column-then-row
parallel MLP (Shoeybi et al. 2019, Sec. 3, Fig. 3a).

* :func:`check_f_and_g` - on real ranks: ``f`` is the identity forward and sums the input's
  gradient over the ranks in backward; ``g`` sums its input over the ranks in forward and passes
  the gradient through unchanged. Every rank gets a different input and upstream gradient, so
  an all-reduce in the wrong direction shows in the values (none is counted inside a rank).
* :func:`check_parallel_mlp` - on real ranks, the learner's MLP from this rank's slices of
  ``up`` (columns) and ``down`` (rows) gives the output and the input gradient of the full MLP,
  and each rank's weight gradients are its slices of the full ones.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from dtlib.grading.feedback import first_line
from dtlib.launcher import LaunchTimeoutError, RankFailedError, launch

__all__ = ["check_f_and_g", "check_parallel_mlp", "mlp_layers"]

TOL = dict(atol=1e-5, rtol=1e-5)


def _run(worker: Callable, world_size: int, args: tuple, timeout: float, what: str) -> list[Any]:
    try:
        return launch(worker, world_size, args=args, timeout=timeout, output="none")
    except LaunchTimeoutError:
        raise AssertionError(f"the ranks hung (no result in {timeout:g} s): every rank must call "
                             f"the same collectives in the same order in {what}") from None
    except RankFailedError as e:
        raise AssertionError(f"your {what} raised on rank {e.rank} of {world_size}: "
                             f"{first_line(e)}") from None


# ---- q1: f and g -------------------------------------------------------------------------------------
def _f_g_input(rank: int) -> torch.Tensor:
    """A different input on every rank: the identity returns its own, an all-reduce (sum or mean)
    does not, so which direction communicates is read from the values alone (issue 39: nothing
    measured inside the rank, where the learner's code runs, decides a grade)."""
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(0)) + 10.0 * rank


def _f_g_worker(rank: int, world_size: int, f: type, g: type) -> dict:
    """Runs only the learner's f and g and returns their outputs and gradients (what they are
    compared with is made by the check, in its own process: issue 39)."""
    x = _f_g_input(rank).requires_grad_()
    y = f.apply(x)
    y.backward(torch.full((3, 4), float(rank + 1)))      # a different gradient on every rank
    partial = _f_g_input(rank).requires_grad_()          # a different partial per rank
    z = g.apply(partial)
    z.backward(torch.full((3, 4), float(rank + 1)))
    return {"f_out": y.detach(), "f_grad": x.grad, "g_out": z.detach(), "g_grad": partial.grad}


def _f_g_diagnosis(ranks: list[dict]) -> str | None:
    """What is wrong with f and g, in words, from the values the ranks returned (None if right).

    Per rank: f's output must be its own input, g's its input summed over ranks; f's input
    gradient the upstream gradients summed over ranks, g's its own upstream gradient."""
    n = len(ranks)
    setting = f"on {n} ranks"
    inputs = [_f_g_input(rank) for rank in range(n)]
    total_in = torch.stack(inputs).sum(0)
    total = sum(range(1, n + 1))  # the upstream gradients: rank + 1 on each rank
    for rank, r in enumerate(ranks):
        own, upstream = inputs[rank], torch.full((3, 4), float(rank + 1))
        if r["f_grad"] is None or r["g_grad"] is None:
            return (f"{setting}, no gradient reached the input: backward must return a tensor "
                    "(the input's gradient), not None")
        if not torch.allclose(r["f_out"], own, **TOL):
            if torch.allclose(r["f_out"], total_in, **TOL) or torch.allclose(r["f_out"], total_in / n, **TOL):
                return (f"{setting}, f's forward all-reduced its input: f is the identity forward, "
                        "the all-reduce belongs in its backward")
            return (f"{setting}, f changed its input in forward: f is the identity forward "
                    "(return x, e.g. x.view_as(x))")
        if torch.allclose(r["f_grad"], upstream, **TOL):
            return (f"{setting}, rank {rank}'s input gradient is only its own: the backward of f "
                    "must all-reduce the input gradient (each rank holds the contribution of its "
                    "own slice of the layer)")
        if torch.allclose(r["f_grad"], torch.full_like(r["f_grad"], total / n), **TOL):
            return (f"{setting}, f's backward averaged the gradients: sum them (dist.all_reduce "
                    "with the default SUM), do not divide")
        if not torch.allclose(r["f_grad"], torch.full_like(r["f_grad"], total), **TOL):
            return (f"{setting}, f's backward returned {r['f_grad'].flatten()[0]:g} where the sum "
                    f"over ranks is {total}: all-reduce (sum) the incoming gradient and return it")
        if torch.allclose(r["g_out"], own, **TOL):
            return (f"{setting}, g returned its input unchanged: g must all-reduce (sum) the "
                    "partial outputs in forward")
        if not torch.allclose(r["g_out"], total_in, **TOL):
            i = int((r["g_out"] - total_in).abs().nan_to_num(float("inf")).argmax())
            return (f"{setting}, g's forward gave {r['g_out'].flatten()[i]:g} at index {i} where the "
                    f"sum of the partials is {total_in.flatten()[i]:g}: sum, do not average, and do "
                    "not change the input in place (clone it first)")
        if not torch.allclose(r["g_grad"], upstream, **TOL):
            return (f"{setting}, g's backward is not the identity (gradient "
                    f"{r['g_grad'].flatten()[0]:g}, expected this rank's {rank + 1}): every partial "
                    "sum gets the full gradient; all-reducing it again sums it over the ranks")
    return None


def check_f_and_g(f: type, g: type, world_size: int = 2, timeout: float = 30.0) -> None:
    """``f`` and ``g`` are ``torch.autograd.Function`` classes applied as ``f.apply(x)``.

    Judged from the values alone, with a different input and upstream gradient on every rank:
    which direction all-reduces shows in them, so no collective is counted inside a rank."""
    for name, cls in (("f", f), ("g", g)):
        if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
            raise AssertionError(f"{name} must be a subclass of torch.autograd.Function with static "
                                 "forward(ctx, x) and backward(ctx, grad) methods")
    problem = _f_g_diagnosis(_run(_f_g_worker, world_size, (f, g), timeout, "f or g"))
    if problem:
        raise AssertionError(problem)


# ---- q2: the parallel MLP ------------------------------------------------------------------------------
def mlp_layers(hidden: int = 8, ffn: int = 32, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    """The full ``up`` (h -> 4h) and ``down`` (4h -> h) layers the check splits, with biases."""
    torch.manual_seed(seed)
    up, down = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
    with torch.no_grad():
        down.bias.normal_()  # a visible bias: adding it on every rank is then a visible mistake
    return up, down


def _mlp_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g)


def _mlp_worker(rank: int, world_size: int, fn: Callable) -> dict:
    """Runs only the learner's MLP and returns its output and gradients (the full MLP is the
    check's, in its own process: issue 39)."""
    up, down = mlp_layers()
    x, target = _mlp_inputs()
    x.requires_grad_()
    try:
        out = fn(x, up, down, rank, world_size)
    except RuntimeError as e:  # a shape mismatch: every rank raises it before any collective
        return {"error": first_line(e)}
    if isinstance(out, torch.Tensor) and out.shape == target.shape:
        ((out - target) ** 2).sum().backward()
    grads = {n: None if p.grad is None else p.grad.clone()
             for n, p in [*up.named_parameters(prefix="up"), *down.named_parameters(prefix="down")]}
    return {"out": out.detach().clone() if isinstance(out, torch.Tensor) else out,
            "x_grad": x.grad, "grads": grads}


def _full_mlp() -> dict:
    """The unsplit MLP's output, input gradient, weight gradients and ``down``'s bias, on
    :func:`_mlp_worker`'s inputs."""
    with torch.random.fork_rng(devices=[]):  # mlp_layers seeds: leave the caller's generator be
        up, down = mlp_layers()
    x, target = _mlp_inputs()
    x.requires_grad_()
    out = down(F.gelu(up(x)))
    ((out - target) ** 2).sum().backward()
    return {"out": out.detach(), "x_grad": x.grad, "bias": down.bias.detach(),
            "grads": {n: p.grad for n, p in [*up.named_parameters(prefix="up"),
                                             *down.named_parameters(prefix="down")]}}


def _slice_of(full_grad: torch.Tensor | None, name: str, rank: int, n: int) -> torch.Tensor | None:
    if full_grad is None:
        return None
    dim = 1 if name == "down.weight" else 0
    return full_grad if name == "down.bias" else full_grad.chunk(n, dim)[rank]


def check_parallel_mlp(fn: Callable, world_size: int = 2, timeout: float = 30.0) -> None:
    """``fn(x, up, down, rank, world_size)`` computes ``down(gelu(up(x)))`` with this rank's
    columns of ``up`` and rows of ``down`` (slices of the full layers, e.g. ``up.weight.chunk``,
    so the gradients flow back into ``up`` and ``down``), through f and g."""
    ranks = _run(_mlp_worker, world_size, (fn,), timeout, "parallel_mlp")
    setting = f"on {world_size} ranks"
    full = _full_mlp()  # after the launch: no rank holds it
    for rank, r in enumerate(ranks):
        if "error" in r:
            raise AssertionError(f"{setting}, your parallel_mlp raised on rank {rank}: {r['error']}. "
                                 "Keep up's output features (up.weight.chunk(world_size, 0)) and "
                                 "down's input features (down.weight.chunk(world_size, 1))")
        out, ref = r["out"], full["out"]
        if not isinstance(out, torch.Tensor):
            raise AssertionError(f"parallel_mlp returned {type(out).__name__}: return the output "
                                 "tensor (the same shape as x)")
        if out.shape != ref.shape:
            raise AssertionError(f"{setting}, the output has shape {tuple(out.shape)}, expected "
                                 f"{tuple(ref.shape)}: split up by output features (rows of "
                                 "up.weight) and down by input features (columns of down.weight)")
        off = out - ref
        extra_bias = (world_size - 1) * full["bias"]
        if torch.allclose(off, extra_bias.expand_as(off), **TOL) and world_size > 1:
            raise AssertionError(f"{setting}, the output is off by (world_size - 1) x down.bias: "
                                 "the bias was added on every rank before the all-reduce; add it "
                                 "once, after g")
        if not torch.allclose(out, ref, **TOL):
            raise AssertionError(f"{setting}, rank {rank}'s output differs from the full MLP by "
                                 f"{off.abs().max().item():.2e}: the output of down on one rank is "
                                 "a partial sum; leave the parallel region with g (all-reduce)")
        if r["x_grad"] is None:
            raise AssertionError(f"{setting}, x received no gradient: compute with x (through f), "
                                 "not a detached copy")
        if not torch.allclose(r["x_grad"], full["x_grad"], **TOL):
            raise AssertionError(f"{setting}, x's gradient on rank {rank} is only this rank's "
                                 "share: enter the parallel region with f, whose backward "
                                 "all-reduces it")
        for name, full_grad in full["grads"].items():
            got = _slice_of(r["grads"][name], name, rank, world_size)
            if got is None or not torch.allclose(got, _slice_of(full_grad, name, rank, world_size), **TOL):
                hint = ("did you all-reduce before adding the bias?" if name == "down.bias"
                        else "use this rank's slice: up.weight.chunk(world_size, 0)[rank], "
                             "down.weight.chunk(world_size, 1)[rank]")
                raise AssertionError(f"{setting}, the gradient of {name} on rank {rank} differs "
                                     f"from the full MLP's: {hint}")
