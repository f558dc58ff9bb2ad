"""Checks for the ZeRO/FSDP exercise: the learner's ZeRO-1 optimizer.

* :func:`check_shard_params` - the learner assigns every parameter to one rank so that each rank
  owns about 1/N of the elements (greedy, largest first, to the least-loaded rank: the rule of
  ``torch.distributed.optim.ZeroRedundancyOptimizer``), the same on every rank.
* :func:`check_zero1` - on real ranks, the learner's ``ZeRO1`` optimizer (AdamW on this rank's
  shard, then the updated parameters shared) gives exactly the unsharded AdamW's parameters over
  several steps, with noise for gradients outside the shard each rank's inner optimizer holds (so
  only a step that reads its own shard alone stays exact), and those shards hold about 1/N of
  Adam's state each, every parameter's on one rank (Rajbhandari et al. 2020, Sec. 5.1, P_os).

What is graded is the step and the shard each rank's inner optimizer shows, not the memory the
rank holds: AdamW over every parameter, followed by the owners' broadcasts and a shard shown,
ends with the same parameters and messages, its extra state never read. No affordable measure
from outside the rank tells that state from memory an honest answer cell may hold (the
measurements: docs/grading.md, "Forged data within a rank, what is left").
"""
from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.grading.feedback import first_line
from dtlib.measure import CollectiveCounter, optimizer_state_bytes
from dtlib.launcher import LaunchTimeoutError, RankFailedError, launch

__all__ = ["check_shard_params", "check_zero1", "zero1_state_per_rank", "zero1_model",
           "reference_shard_params"]


def reference_shard_params(params: list[torch.Tensor], world_size: int) -> list[int]:
    """Owner rank of each parameter: largest first, each to the rank with the fewest elements so
    far (ties: the lowest rank), as ``ZeroRedundancyOptimizer._partition_parameters`` does."""
    load = [0] * world_size
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        rank = min(range(world_size), key=lambda r: load[r])
        owners[i] = rank
        load[rank] += params[i].numel()
    return owners


def _shard_cases() -> list[tuple[list[torch.Tensor], int]]:
    rng = random.Random(4)
    cases = [([torch.empty(1000), torch.empty(1), torch.empty(1000), torch.empty(1),
               torch.empty(1000), torch.empty(1)], 2)]
    for _ in range(30):
        n = rng.choice([2, 3, 4, 8])
        sizes = [rng.choice([1, 7, 64, 300, 1024, 4096]) for _ in range(rng.randrange(n, 4 * n))]
        cases.append(([torch.empty(s) for s in sizes], n))
    return cases


def check_shard_params(fn: Callable) -> None:
    """``fn(params, world_size)`` returns one owner rank per parameter, balanced: no rank owns
    more than 1/N of the elements plus one parameter (what greedy largest-first guarantees)."""
    for params, n in _shard_cases():
        sizes = [p.numel() for p in params]
        owners = fn(params, n)
        where = f"for parameters of {sizes} elements on {n} ranks"
        if owners is None:
            raise AssertionError("shard_params returned None: return a list with the owner rank "
                                 "of each parameter, e.g. [0, 1, 1, 0]")
        owners = list(owners)
        if len(owners) != len(params) or not all(isinstance(o, int) and 0 <= o < n for o in owners):
            raise AssertionError(f"{where} you returned {owners}: return one rank in "
                                 f"0..{n - 1} per parameter ({len(params)} of them)")
        if list(fn(params, n)) != owners:
            raise AssertionError(f"{where} two calls gave different owners: every rank computes "
                                 "the assignment on its own, so it must be deterministic")
        load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(n)]
        bound = sum(sizes) / n + max(sizes)
        if max(load) > bound:
            raise AssertionError(
                f"rank {load.index(max(load))} owns more than 1/N of the elements plus the largest "
                f"parameter: balance by size, not by count (see the question)\n{where}: the ranks "
                f"own {load} elements; the bound is {sum(sizes) / n:g} + {max(sizes)}")


# ---- ZeRO-1 on real ranks --------------------------------------------------------------------------
def zero1_model(seed: int = 0) -> nn.Sequential:
    """A small MLP with several weight matrices of equal size (so 1/N shards can balance)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5))


def _inner_optimizers(obj: Any) -> list[torch.optim.Optimizer]:
    return [v for v in vars(obj).values() if isinstance(v, torch.optim.Optimizer)]


_ADAMW = dict(lr=1e-2, weight_decay=0.1)


def _zero1_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(12, 24, generator=g), torch.randint(0, 5, (12,), generator=g))
            for _ in range(steps)]


def _zero1_worker(rank: int, world_size: int, cls: type, steps: int) -> dict:
    """Runs only the learner's optimizer and returns data: its parameters and its inner
    optimizers' state tensors, copied (the reference AdamW and every byte count are the check's,
    in its own process: issue 39).

    Each rank's gradients of the parameters its inner optimizers do not hold are replaced with
    noise (different on every rank) before the step: a ZeRO-1 step reads only its own shard's
    gradients and takes the other parameters from their owners, so its parameters stay exact,
    while a step over every parameter (averaged or not) ends wrong, whatever the rank reports
    about itself. Which collectives the step called is counted in the rank, where the learner's
    code runs, so it only chooses the words of a failure the values already show."""
    model = zero1_model()
    index = {id(p): i for i, p in enumerate(model.parameters())}
    opt = cls(model.parameters(), **_ADAMW)
    noise = torch.Generator().manual_seed(100 + rank)
    all_reduces, held_per_step = 0, []
    for x, y in _zero1_batches(steps):
        xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
        # read before every step (one made in the first step() is no shard yet); the check
        # requires the same shard at every read and in the state at the end
        held = {id(p) for o in _inner_optimizers(opt) for group in o.param_groups for p in group["params"]}
        held_per_step.append(sorted(index.get(h, -1) for h in held))
        for p in model.parameters():
            p.grad = None
        nn.functional.cross_entropy(model(xs), ys).backward()
        for p in model.parameters():  # what DDP does before the step: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world_size
            if held and id(p) not in held:  # not this rank's shard: a ZeRO-1 step never reads it
                p.grad.copy_(torch.randn(p.shape, generator=noise))
        with CollectiveCounter() as counter:  # names the mistake only: the grade is the values
            opt.step()
        all_reduces += counter.counts["all_reduce"]
    inner = _inner_optimizers(opt)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "names": [n for n, _ in model.named_parameters()], "n_inner": len(inner),
            # (shape of the parameter, its state tensors) per parameter of each inner optimizer
            "state": [(tuple(p.shape), {k: v.detach().clone() for k, v in state.items() if torch.is_tensor(v)})
                      for o in inner for p, state in o.state.items()],
            "all_reduce_in_step": all_reduces > 0, "held_per_step": held_per_step,
            "held_at_end": sorted(index.get(id(p), -1) for o in inner for g in o.param_groups for p in g["params"]),
            "state_of": sorted(index.get(id(p), -1) for o in inner for p in o.state)}


def _state_bytes(state: list[tuple[tuple[int, ...], dict]]) -> int:
    """:func:`dtlib.measure.optimizer_state_bytes` of the state a rank returned (its ``optimizer``
    bytes: the tensors shaped like their parameter), measured here, not in the rank."""
    states = {torch.empty(shape, device="meta"): tensors for shape, tensors in state}
    return optimizer_state_bytes(SimpleNamespace(state=states))["optimizer"]


def _unsharded_adamw(world_size: int, steps: int) -> tuple[list[torch.Tensor], int]:
    """``torch.optim.AdamW`` on the whole model with the gradients the ranks average (the same
    shards, summed in rank order, divided by ``world_size``): its parameters and state bytes."""
    with torch.random.fork_rng(devices=[]):  # zero1_model seeds: leave the caller's generator be
        model = zero1_model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, **_ADAMW)
    for x, y in _zero1_batches(steps):
        shards = zip(x.tensor_split(world_size), y.tensor_split(world_size))
        per_rank = [torch.autograd.grad(nn.functional.cross_entropy(model(xs), ys), params)
                    for xs, ys in shards]
        for i, p in enumerate(params):
            p.grad = per_rank[0][i].clone()
            for grads in per_rank[1:]:
                p.grad += grads[i]
            p.grad /= world_size
        opt.step()
    return [p.detach().clone() for p in params], optimizer_state_bytes(opt)["optimizer"]


def check_zero1(cls: type, world_size: int = 2, steps: int = 5, timeout: float = 30.0) -> None:
    """``cls(params, lr=..., weight_decay=...)`` with ``step()`` is ZeRO-1 around AdamW.

    On ``world_size`` ranks, with gradients already averaged (as DDP leaves them): after ``steps``
    steps every rank's parameters equal the unsharded ``torch.optim.AdamW`` (same gradients,
    float tolerance) although each rank's gradients outside its shard are noise, and the shards
    its inner optimizers hold (read from the state tensors each rank returns: its word, see the
    module's docstring) cover the model once, about 1/N of Adam's state each.
    """
    try:
        ranks = launch(_zero1_worker, world_size, args=(cls, steps), timeout=timeout, output="none")
    except LaunchTimeoutError:
        raise AssertionError(
            f"the ranks hung (no result in {timeout:g} s): every rank must call the same "
            "collectives in the same order - e.g. a broadcast of each parameter from its owner, "
            "on every rank, not only on the owner") from None
    except RankFailedError as e:
        raise AssertionError(f"your optimizer raised on rank {e.rank} of {world_size}: "
                             f"{first_line(e)}") from None
    setting = f"on {world_size} ranks"
    ref_params, unsharded = _unsharded_adamw(world_size, steps)  # after the launch: no rank holds it
    with torch.random.fork_rng(devices=[]):
        start = [p.detach() for p in zero1_model().parameters()]
    largest = max(p.numel() for p in start) * 8
    for rank, out in enumerate(ranks):
        if out["n_inner"] == 0:
            raise AssertionError(
                f"{setting}, rank {rank}'s optimizer has no inner torch optimizer attribute: keep "
                "this rank's torch.optim.AdamW (over its own parameters only) in self.optimizer")
    for rank, out in enumerate(ranks):
        shard = out["held_at_end"]
        if any(h != shard for h in out["held_per_step"][1:]) or out["held_per_step"][0] not in ([], shard) \
                or out["state_of"] != shard:
            raise AssertionError(
                f"{setting}, rank {rank}'s inner optimizer held other parameters during the steps, or "
                "kept state for other parameters, than at the end: keep one torch.optim.AdamW over "
                "this rank's own parameters in self.optimizer, made in the constructor")
    for rank, out in enumerate(ranks):
        wrong = [(name, p, r, p0) for name, p, r, p0 in zip(out["names"], out["params"], ref_params, start)
                 if not torch.allclose(p, r, atol=1e-6, rtol=1e-5)]  # NaN is never close
        if not wrong:
            continue
        name, p, r, _ = wrong[0]
        if out["all_reduce_in_step"]:
            raise AssertionError(
                f"{setting}, rank {rank}'s {name} differs from unsharded AdamW and your step "
                "calls dist.all_reduce: don't average the weights - the owner's updated value "
                "is the right one; send it with dist.broadcast(p.data, src=owner)")
        # a parameter left at its start (not sent by its owner) also skews every later gradient
        for stale, q, _, q0 in wrong:
            if torch.equal(q, q0):
                raise AssertionError(
                    f"{setting}, {stale} never changed on rank {rank}: after each rank steps its "
                    "own shard, every parameter must be sent from its owner to the others "
                    "(dist.broadcast(p.data, src=owner) on every rank, for every parameter)")
        raise AssertionError(
            f"{setting}, after {steps} steps rank {rank}'s {name} differs from unsharded "
            f"AdamW by {(p - r).abs().max().item():.2e}: each rank must step exactly its own "
            "parameters with AdamW (lr and weight_decay as given), then take every other "
            "parameter from its owner")
    held = [_state_bytes(out["state"]) for out in ranks]
    for rank, state in enumerate(held):
        if state >= unsharded:
            raise AssertionError(
                f"{setting}, rank {rank}'s inner optimizer holds {state} bytes of Adam state, as "
                f"much as unsharded AdamW ({unsharded}): every rank steps the full optimizer. Build "
                "self.optimizer over this rank's own parameters only - that is the 1/N saving")
        bound = unsharded / world_size + largest
        if state > bound:
            raise AssertionError(
                f"{setting}, rank {rank}'s inner optimizer holds {state} bytes of Adam state; 1/N of the "
                f"unsharded {unsharded} plus one parameter's is {bound:g}: balance the shards")
    if sum(held) != unsharded:
        raise AssertionError(
            f"{setting}, the ranks' inner optimizers hold {sum(held)} bytes of Adam state together but "
            f"unsharded AdamW holds {unsharded}: each parameter's state must live on exactly one rank "
            "(its owner)")


def zero1_state_per_rank(cls: type, world_size: int = 4, steps: int = 2,
                         timeout: float = 30.0) -> dict[str, Any]:
    """Run the learner's ``cls`` as in :func:`check_zero1`; return the Adam state bytes each rank's
    inner optimizers hold (``per_rank``) and unsharded AdamW's (``unsharded``). Raises AssertionError, saying why,
    if the class does not run."""
    try:
        ranks = launch(_zero1_worker, world_size, args=(cls, steps), timeout=timeout, output="none")
    except LaunchTimeoutError:
        raise AssertionError(f"the ranks hung (no result in {timeout:g} s)") from None
    except RankFailedError as e:
        raise AssertionError(f"your optimizer raised on rank {e.rank}: {first_line(e)}") from None
    return {"per_rank": [_state_bytes(out["state"]) for out in ranks],
            "unsharded": _unsharded_adamw(world_size, steps)[1]}
