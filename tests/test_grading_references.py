"""Issue 39, item 3: a check's reference is never where the learner's code runs.

Every ``check_*`` that launches ranks (found by reading the checks modules' code, so a new one is
not forgotten) gets a submission that walks its callers' frames (``sys._getframe(k)`` for every
``k``, locals one container deep) and ``gc.get_objects()``, copies what it finds as its answer, or
swaps the check's reference or measure (``optimizer_state_bytes``, the single-process trainer,
DiLoCo's sync) from inside the learner's function. Each scores 0. Where the old checks computed
the reference in the learner's rank, the same submission passed (q1 of lesson 02 with no message
sent, q2 of lesson 04 without sharding): the messages matched below are the checks' verdicts on
what the submission really did.
"""
import copy
import gc
import importlib
import math
import pkgutil
import sys
import time
import types
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.utils._python_dispatch import _disable_current_modes

import dtlib.grading.checks
import dtlib.measure
import dtlib.parallel.local_sgd
from dtlib.data import load_mnist
from dtlib.grading.checks import (communication, data_parallel, fault_tolerance, local_sgd, max_diff,
                                  pipeline_parallel, tensor_parallel, zero_fsdp)
from dtlib.parallel.schedules import Action, schedule
from tests.test_checks_communication import AllAtTheEnd, MiniDDP, Summed
from tests.test_checks_tensor_parallel import F_, G_
from tests.test_checks_zero_fsdp import FullOnEveryRank, ZeRO1

_LAUNCHERS = {"launch", "launch_checked"}

# ranks that run no learner code: the learner's function is called in the check's own process
# (in the verdict, in a forked worker that answers with data) and the ranks get plain data
NO_LEARNER_CODE_IN_RANKS = {
    "pipeline_parallel.check_one_f_one_b_on_ranks": "the schedule is rebuilt as plain Actions "
                                                    "(test_pipeline_ranks_run_no_learner_code)",
    "rank_grid.check_groups": "the groups are canonicalised to sorted lists of ints before the launch",
}


def _names(code: types.CodeType):
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _reaches_launch(fn: Callable, module: types.ModuleType, seen: set) -> bool:
    names = set(_names(fn.__code__))
    if names & _LAUNCHERS:
        return True
    for name in names - seen:
        seen.add(name)
        callee = vars(module).get(name)
        if isinstance(callee, types.FunctionType) and callee.__module__ == module.__name__ \
                and _reaches_launch(callee, module, seen):
            return True
    return False


def launching_checks() -> set[str]:
    """``module.check_name`` of every check whose code (or a helper of its module) launches ranks."""
    found = set()
    for info in pkgutil.iter_modules(dtlib.grading.checks.__path__):
        module = importlib.import_module(f"dtlib.grading.checks.{info.name}")
        for name, fn in vars(module).items():
            if name.startswith("check_") and isinstance(fn, types.FunctionType) \
                    and fn.__module__ == module.__name__ and _reaches_launch(fn, module, set()):
                found.add(f"{info.name}.{name}")
    return found


# ---- what a thief finds ---------------------------------------------------------------------------
def _callers_hold() -> list[Any]:
    """Every value in the frames above the learner's function (locals, one container deep), then
    every object the garbage collector knows."""
    values = []
    frame = sys._getframe(2)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            values.append(value)
            if isinstance(value, dict):
                values.extend(value.values())
            elif isinstance(value, (list, tuple)):
                values.extend(value)
        frame = frame.f_back
    return values + gc.get_objects()


def _steal(like: torch.Tensor, *mine: torch.Tensor) -> torch.Tensor | None:
    """The first tensor the callers hold shaped like ``like`` that is none of ``mine`` (by
    identity or value): what a check would compare ``like`` with."""
    for value in _callers_hold():
        if (isinstance(value, torch.Tensor) and value.shape == like.shape and value.dtype == like.dtype
                and all(value is not t and not torch.equal(value, t) for t in mine)):
            return value.detach().clone()
    return None


def _copy_stolen(tensors: list[torch.Tensor], *mine: torch.Tensor) -> None:
    with torch.no_grad():
        for t in tensors:
            loot = _steal(t, t, *mine)
            if loot is not None:
                t.copy_(loot)


def ring_thief(tensor):
    _copy_stolen([tensor])


def grads_thief(model, n):
    _copy_stolen([p.grad for p in model.parameters()], *model.parameters())


def outer_thief(params, global_params, bufs, lr, momentum):
    _copy_stolen([*global_params, *params, *bufs])


def mlp_thief(x, up, down, rank, world_size):
    loot = _steal(x, x)
    return x if loot is None else loot


class f_thief(F_):  # the identity forward, a stolen gradient
    @staticmethod
    def backward(ctx, grad):
        loot = _steal(grad, grad)
        return grad if loot is None else loot


class g_thief(f_thief):
    @staticmethod
    def forward(ctx, x):
        loot = _steal(x, x)
        return x.clone() if loot is None else loot


# ---- swaps: the reference or the measure patched from inside the learner's code -------------------
class SummedSwapsTheTrainer(Summed):
    """Sums instead of averaging, and makes the check's single-process run answer its weights."""

    def finish(self):
        super().finish()
        model = self.model
        communication._train_single = lambda data, lr, scale: [p.detach().clone() for p in model.parameters()]


_REAL_STATE_BYTES = dtlib.measure.optimizer_state_bytes


class UnshardedSwapsTheMeasure(FullOnEveryRank):
    """AdamW over every parameter on every rank, its state reported as 1/N."""

    def step(self):
        super().step()
        mine, n = self.optimizer, self.world_size

        def lying(optimizer):
            out = _REAL_STATE_BYTES(optimizer)
            return {**out, "optimizer": out["optimizer"] // n} if optimizer is mine else out
        zero_fsdp.optimizer_state_bytes = dtlib.measure.optimizer_state_bytes = lying


def averaging_swaps_diloco(params, global_params, bufs, lr, momentum):
    """Plain parameter averaging (no outer Nesterov step), DiLoCo's sync made the same."""
    world = dist.get_world_size()

    @torch.no_grad()
    def average(tensors):
        for t in tensors:
            dist.all_reduce(t)
            t /= world
    average(params)
    for p, g in zip(params, global_params):
        g.copy_(p)
    dtlib.parallel.local_sgd.DiLoCo.sync = lambda self: average([p.data for p in self.model.parameters()])


def saves_nothing(step, model, optimizer):
    return {}


def restore_forges_the_reference(state, model, optimizer):
    """Restores nothing; makes the check's snapshot at the kill step equal its fresh state, and the
    check's uninterrupted run equal what its own continuation will give."""
    snaps = [v for v in _callers_hold() if isinstance(v, dict) and set(v) == {"params", "moments", "rng"}]
    for snap in snaps:
        for saved, p in zip(snap["params"], model.parameters()):
            saved.copy_(p.detach())
        snap["moments"].clear()
        snap["rng"].copy_(torch.get_rng_state())
    shapes = [p.shape for p in model.parameters()]
    straight = next((v for v in _callers_hold() if isinstance(v, list) and len(v) == len(shapes)
                     and all(isinstance(t, torch.Tensor) and t.shape == s for t, s in zip(v, shapes))
                     and not any(v is snap["params"] for snap in snaps)
                     and not any(t is p for t, p in zip(v, model.parameters()))), None)
    if straight is not None:  # run the continuation on copies, then put the RNG back
        rng, twin = torch.get_rng_state(), copy.deepcopy(model)
        opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
        for index in range(fault_tolerance.KILL_STEP, fault_tolerance.STEPS):
            fault_tolerance._step(twin, opt, index, dist.get_rank(), dist.get_world_size())
        for t, p in zip(straight, twin.parameters()):
            t.copy_(p.detach())
        torch.set_rng_state(rng)
    return fault_tolerance.KILL_STEP


# ---- forged measures: what a rank says about its own run, made to fit --------------------------------
class AveragesInForwardUnseen(F_):
    """f's forward all-reduces (averaging, so a replicated input comes back unchanged) with the
    collective hidden from the rank's dispatch-mode counter (``CollectiveCounter``)."""

    @staticmethod
    def forward(ctx, x):
        with _disable_current_modes():
            out = x.clone()
            dist.all_reduce(out)
        return out / dist.get_world_size()


class UnshardedForgesItsState(ZeRO1):
    """AdamW over every parameter on every rank (no communication needed), hidden from the check;
    the inner optimizer it shows holds this rank's shard's state only, as ZeRO-1's would. The noise
    gradients of the parameters outside that shard leave them wrong."""

    def __init__(self, params, lr=1e-3, weight_decay=0.01):
        super().__init__(params, lr, weight_decay)
        self._unsharded = [torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay)]

    @torch.no_grad()
    def step(self):
        full = self._unsharded[0]
        full.step()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.optimizer.state[p] = full.state[p]


class UnshardedKeepsStateItNeverReads(UnshardedForgesItsState):
    """The same, followed by ZeRO-1's broadcasts from the owners: what its AdamW computes from the
    noise is overwritten, so the state of the parameters it does not own is never read."""

    @torch.no_grad()
    def step(self):
        super().step()
        for p, owner in zip(self.params, self.owners):
            dist.broadcast(p.data, src=owner)


class UnshardedShowsAShardAtTheEnd(FullOnEveryRank):
    """AdamW over every parameter on every rank (so no gradient is noise), its inner optimizer
    swapped at the last step for one over this rank's shard holding that shard's state."""

    @torch.no_grad()
    def step(self):
        self._full = getattr(self, "_full", [self.optimizer])  # in a list: not an attribute the check reads
        full = self._full[0]
        full.step()
        mine = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        shown = torch.optim.AdamW(mine, lr=1e-2, weight_decay=0.1)
        for p in mine:
            shown.state[p] = full.state[p]
        self.optimizer = shown


def all_reduce_unseen(tensor):
    """The built-in collective, hidden from the rank's counter: a correct sum, no ring."""
    with _disable_current_modes():
        dist.all_reduce(tensor)
    return tensor


def whole_tensors_unseen(tensor):
    """A ring of whole tensors (n-1 x the tensor from every rank, not 2(n-1)/n), unseen."""
    n, r = dist.get_world_size(), dist.get_rank()
    total, passing = tensor.clone(), tensor.clone()
    with _disable_current_modes():
        for _ in range(n - 1):
            incoming = torch.empty_like(tensor)
            for req in [dist.isend(passing, (r + 1) % n), dist.irecv(incoming, (r - 1) % n)]:
                req.wait()
            total += incoming
            passing = incoming
    return tensor.copy_(total)


class PerParameterCountedPerBucket(MiniDDP):
    """One all-reduce per parameter, through ``distributed_c10d`` where the check's spy on
    ``dist.all_reduce`` does not look; the spy is shown one empty all-reduce per bucket."""

    def _grad_ready(self, p):
        self.hidden.append(distributed_c10d.all_reduce(p.grad.div_(self.world_size), async_op=True))
        b, _ = self.where[p]
        self.missing[b] -= 1
        if self.missing[b] == 0:
            self.works[b] = dist.all_reduce(torch.zeros(0), async_op=True)

    def finish(self):
        for work in self.hidden + self.works:
            work.wait()
        self.reset()

    def reset(self):
        super().reset()
        self.hidden = []


class AllAtTheEndBackdated(AllAtTheEnd):
    """Every all-reduce issued in finish(), after backward, with the clock the check's spy reads
    set back while they are issued."""

    def finish(self):
        real = time.perf_counter
        time.perf_counter = lambda: 0.0
        try:
            for b in range(len(self.buckets)):
                self.works[b] = dist.all_reduce(self.flat[b], async_op=True)
        finally:
            time.perf_counter = real
        MiniDDP.finish(self)


# what is forged -> (how it is graded, what the check must say); each got full marks when the
# check read the measure from the rank (its counter of collectives and bytes, a replicated input
# to f, the gradients of every parameter)
FORGED_MEASURES: dict[str, tuple[Callable, str]] = {
    "ring: a built-in collective": (
        lambda: communication.check_ring_all_reduce(all_reduce_unseen, world_sizes=(2,), shapes=((12,),),
                                                    timeout=5),
        "waited in vain for reduce-scatter step 0's chunk from rank 0"),
    "ring: bytes sent": (
        lambda: communication.check_ring_all_reduce(whole_tensors_unseen, world_sizes=(3,), shapes=((12,),)),
        "sent the check's rank 2 more than one chunk"),
    "DDP: all-reduces per bucket": (
        lambda: communication.check_bucketed_ddp(PerParameterCountedPerBucket, steps=2, timeout=10),
        "rank 1 waited in vain for bucket 0's all-reduce"),
    "DDP: the overlap with backward": (
        lambda: communication.check_bucketed_ddp(AllAtTheEndBackdated, steps=2, timeout=10),
        "rank 1 waited in vain for bucket 0's all-reduce"),
    "f and g: a collective in f's forward": (
        lambda: tensor_parallel.check_f_and_g(AveragesInForwardUnseen, G_),
        "f's forward all-reduced its input"),
    "ZeRO-1: the shard it claims": (lambda: zero_fsdp.check_zero1(UnshardedShowsAShardAtTheEnd, steps=2),
                                    "held other parameters during the steps"),
    "ZeRO-1: a step over every parameter": (lambda: zero_fsdp.check_zero1(UnshardedForgesItsState, steps=2),
                                            "differs from unsharded AdamW"),
}


@pytest.mark.parametrize("forged", sorted(FORGED_MEASURES))
def test_a_forged_measure_scores_zero(forged):
    grade, verdict = FORGED_MEASURES[forged]
    with pytest.raises(AssertionError) as failed:
        grade()
    assert verdict in str(failed.value).splitlines()[0]


def test_state_a_rank_never_reads_is_not_seen():
    """Not protected, and stated (docs/grading.md, "Forged data within a rank, what is left"): state
    kept beside ZeRO-1's own changes no message and no value, and the rank's memory is not measured
    (its answer cells' imports move it more than this state). Should a check ever see it, this
    forgery belongs in FORGED_MEASURES and the docs change."""
    zero_fsdp.check_zero1(UnshardedKeepsStateItNeverReads, steps=2)


@pytest.fixture(scope="module")
def digits():
    return load_mnist("train", verbose=False).subset(128)


# check -> (how the thief is graded, what the check must say)
THIEVES: dict[str, tuple[Callable, str]] = {
    "communication.check_ring_all_reduce": (
        lambda d: communication.check_ring_all_reduce(ring_thief, world_sizes=(2,), shapes=((12,),)),
        "unchanged: nothing was summed"),
    "communication.check_bucketed_ddp": (
        lambda d: communication.check_bucketed_ddp(SummedSwapsTheTrainer, steps=2),
        "summed over ranks, not averaged"),
    "zero_fsdp.check_zero1": (lambda d: zero_fsdp.check_zero1(UnshardedSwapsTheMeasure, steps=2),
                              "as much as unsharded AdamW"),
    "tensor_parallel.check_f_and_g": (lambda d: tensor_parallel.check_f_and_g(f_thief, g_thief), ""),
    "tensor_parallel.check_parallel_mlp": (lambda d: tensor_parallel.check_parallel_mlp(mlp_thief), ""),
    "fault_tolerance.check_resume": (
        lambda d: fault_tolerance.check_resume(saves_nothing, restore_forges_the_reference),
        "parameters were not restored"),
    "local_sgd.check_outer_step": (lambda d: local_sgd.check_outer_step(outer_thief), ""),
    "local_sgd.check_diloco_rounds": (
        lambda d: local_sgd.check_diloco_rounds(averaging_swaps_diloco, world_size=2, rounds=2),
        "one outer step is already wrong"),
    "local_sgd.check_weighted_average": (lambda d: local_sgd.check_weighted_average(grads_thief), ""),
    "local_sgd.check_uneven_batches_match_one_process": (
        lambda d: local_sgd.check_uneven_batches_match_one_process(grads_thief, steps=1), ""),
    "data_parallel.check_average_gradients": (
        lambda d: data_parallel.check_average_gradients(grads_thief), ""),
    "data_parallel.check_matches_single_process": (
        lambda d: data_parallel.check_matches_single_process(grads_thief, d, steps=1), ""),
}


def test_every_check_that_launches_ranks_is_covered():
    found = launching_checks()
    assert "communication.check_ring_all_reduce" in found and "rank_grid.check_groups" in found
    assert found == set(THIEVES) | set(NO_LEARNER_CODE_IN_RANKS)


@pytest.mark.parametrize("check", sorted(THIEVES))
def test_a_thief_or_a_swap_scores_zero(check, digits):
    grade, verdict = THIEVES[check]
    with pytest.raises(AssertionError) as failed:
        grade(digits)
    assert verdict in str(failed.value).splitlines()[0]


class _RankSideAction(Action):
    """An Action whose kind is the learner's code: it refuses to run inside a rank."""

    @property
    def kind(self):
        if dist.is_initialized():
            raise RuntimeError("learner code ran in a rank")
        return tuple.__getitem__(self, 0)


def test_pipeline_ranks_run_no_learner_code():
    def one_f_one_b(p, m):
        return [[_RankSideAction(*a) for a in ops] for ops in schedule("1f1b", p, m)]
    pipeline_parallel.check_one_f_one_b_on_ranks(one_f_one_b, world_size=2, microbatches=2)


def test_nan_never_passes():
    nan = [torch.full((2,), float("nan"))]
    weights = [torch.full_like(p, float("nan")) for p in communication.ddp_model().parameters()]
    assert communication._weights_diagnosis("setting", weights, 2, 1) is not None
    # a NaN anywhere, first or after a finite pair (Python's max keeps whichever comes first)
    assert math.isnan(max_diff(nan, nan))
    assert not max_diff(nan + [torch.zeros(2)], [torch.zeros(2)] * 2) < 1e-5
    assert not max_diff([torch.zeros(2)] + nan, [torch.zeros(2)] * 2) <= 1e-5
    assert max_diff([torch.zeros(2), torch.ones(2)], [torch.zeros(2), torch.zeros(2)]) == 1.0
    with pytest.raises(AssertionError, match="got nan"):
        communication.check_ring_all_reduce(lambda t: t.fill_(float("nan")), world_sizes=(2,), shapes=((12,),))
