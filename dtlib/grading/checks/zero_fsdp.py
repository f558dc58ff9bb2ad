"""Checks for the ZeRO/FSDP exercise: the learner's ZeRO-1 optimizer.

* :func:`check_shard_params` - the learner assigns every parameter to one rank so that each rank
  owns about 1/N of the elements (greedy, largest first, to the least-loaded rank: the rule of
  ``torch.distributed.optim.ZeroRedundancyOptimizer``), the same on every rank.
* :func:`check_zero1` - on real ranks, the learner's ``ZeRO1`` optimizer (AdamW on this rank's
  shard, then the updated parameters shared) gives exactly the unsharded AdamW's parameters over
  several steps, and each rank holds about 1/N of Adam's state (Rajbhandari et al. 2020, Sec. 5.1,
  P_os).
"""
from __future__ import annotations

import random
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


def _zero1_worker(rank: int, world_size: int, cls: type, steps: int) -> dict:
    g = torch.Generator().manual_seed(9)
    data = [(torch.randn(12, 24, generator=g), torch.randint(0, 5, (12,), generator=g))
            for _ in range(steps)]
    model, ref = zero1_model(), zero1_model()
    kwargs = dict(lr=1e-2, weight_decay=0.1)
    opt = cls(model.parameters(), **kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kwargs)
    all_reduces = 0
    for x, y in data:
        xs, ys = x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]
        for p in model.parameters():
            p.grad = None
        nn.functional.cross_entropy(model(xs), ys).backward()
        for p in model.parameters():  # what DDP does before the step: average the gradients
            dist.all_reduce(p.grad)
            p.grad /= world_size
        for p, q in zip(model.parameters(), ref.parameters()):  # the same gradients, unsharded
            q.grad = p.grad.clone()
        with CollectiveCounter() as counter:
            opt.step()
        all_reduces += counter.counts["all_reduce"]
        ref_opt.step()
    inner = _inner_optimizers(opt)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "ref": [p.detach().clone() for p in ref.parameters()],
            "start": [p.detach().clone() for p in zero1_model().parameters()],
            "names": [n for n, _ in model.named_parameters()],
            "n_inner": len(inner), "state": sum(optimizer_state_bytes(o)["optimizer"] for o in inner),
            "unsharded_state": optimizer_state_bytes(ref_opt)["optimizer"],
            "largest": max(p.numel() for p in model.parameters()) * 8,
            "all_reduce_in_step": all_reduces > 0}


def check_zero1(cls: type, world_size: int = 2, steps: int = 5, timeout: float = 30.0) -> None:
    """``cls(params, lr=..., weight_decay=...)`` with ``step()`` is ZeRO-1 around AdamW.

    On ``world_size`` ranks, with gradients already averaged (as DDP leaves them): after ``steps``
    steps every rank's parameters equal the unsharded ``torch.optim.AdamW`` (same gradients,
    float tolerance), and each rank's inner optimizer holds about 1/N of Adam's state.
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
    for rank, out in enumerate(ranks):
        if out["n_inner"] == 0:
            raise AssertionError(
                f"{setting}, rank {rank}'s optimizer has no inner torch optimizer attribute: keep "
                "this rank's torch.optim.AdamW (over its own parameters only) in self.optimizer")
    for rank, out in enumerate(ranks):
        for name, p, r, p0 in zip(out["names"], out["params"], out["ref"], out["start"]):
            if torch.allclose(p, r, atol=1e-6, rtol=1e-5):
                continue
            if out["all_reduce_in_step"]:
                raise AssertionError(
                    f"{setting}, rank {rank}'s {name} differs from unsharded AdamW and your step "
                    "calls dist.all_reduce: don't average the weights - the owner's updated value "
                    "is the right one; send it with dist.broadcast(p.data, src=owner)")
            if torch.equal(p, p0):
                raise AssertionError(
                    f"{setting}, {name} never changed on rank {rank}: after each rank steps its "
                    "own shard, every parameter must be sent from its owner to the others "
                    "(dist.broadcast(p.data, src=owner) on every rank, for every parameter)")
            raise AssertionError(
                f"{setting}, after {steps} steps rank {rank}'s {name} differs from unsharded "
                f"AdamW by {(p - r).abs().max().item():.2e}: each rank must step exactly its own "
                "parameters with AdamW (lr and weight_decay as given), then take every other "
                "parameter from its owner")
    total = sum(out["state"] for out in ranks)
    unsharded = ranks[0]["unsharded_state"]
    for rank, out in enumerate(ranks):
        if out["state"] >= unsharded:
            raise AssertionError(
                f"{setting}, rank {rank} holds {out['state']} bytes of Adam state, as much as "
                f"unsharded AdamW ({unsharded}): every rank steps the full optimizer. Build "
                "self.optimizer over this rank's own parameters only - that is the 1/N saving")
        bound = unsharded / world_size + out["largest"]
        if out["state"] > bound:
            raise AssertionError(
                f"{setting}, rank {rank} holds {out['state']} bytes of Adam state; 1/N of the "
                f"unsharded {unsharded} plus one parameter's is {bound:g}: balance the shards")
    if total != unsharded:
        raise AssertionError(
            f"{setting}, the ranks hold {total} bytes of Adam state together but unsharded AdamW "
            f"holds {unsharded}: each parameter's state must live on exactly one rank (its owner)")


def zero1_state_per_rank(cls: type, world_size: int = 4, steps: int = 2,
                         timeout: float = 30.0) -> dict[str, Any]:
    """Run the learner's ``cls`` as in :func:`check_zero1`; return the Adam state bytes of each
    rank (``per_rank``) and of unsharded AdamW (``unsharded``). Raises AssertionError, saying why,
    if the class does not run."""
    try:
        ranks = launch(_zero1_worker, world_size, args=(cls, steps), timeout=timeout, output="none")
    except LaunchTimeoutError:
        raise AssertionError(f"the ranks hung (no result in {timeout:g} s)") from None
    except RankFailedError as e:
        raise AssertionError(f"your optimizer raised on rank {e.rank}: {first_line(e)}") from None
    return {"per_rank": [out["state"] for out in ranks], "unsharded": ranks[0]["unsharded_state"]}
