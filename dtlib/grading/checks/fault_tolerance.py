"""Checks for the fault-tolerance exercise: the learner's resume logic, killed and resumed on real
ranks, and the optimal checkpoint interval (Young 1974).

* :func:`check_resume` - 2 ranks train a small model with dropout and AdamW; at step 3 each rank
  saves ``save_state(3, model, optimizer)`` to a file and rank 1 is SIGKILLed. New processes build a
  fresh model, optimizer and RNG, ``restore`` the file and finish the run; their parameters must
  equal an uninterrupted run's bit for bit (run after, in ranks that run no learner code), and when they do not the message says which state was
  forgotten (model, optimizer, RNG, data position).
* :func:`check_optimal_interval` - ``optimal_interval(checkpoint_seconds, gpus, gpu_mtbf_hours)``
  against :func:`dtlib.analytic.reliability.young_interval` with the job's MTBF, naming the classic
  slips (MTBF not divided by the GPUs, hours not converted, the factor 2, the square root).
"""
from __future__ import annotations

import math
import os
import signal
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from dtlib.analytic.reliability import job_mtbf, young_interval
from dtlib.grading.feedback import first_line
from dtlib.launcher import LaunchTimeoutError, RankFailedError, launch

__all__ = ["check_resume", "check_optimal_interval", "STEPS", "KILL_STEP", "make_model", "batch"]

STEPS, KILL_STEP = 6, 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def batch(index: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``index`` (the data position is ``index``)."""
    g = torch.Generator().manual_seed(1000 + index)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    return x.tensor_split(world_size)[rank], y.tensor_split(world_size)[rank]


def _step(model: nn.Module, opt: torch.optim.Optimizer, index: int, rank: int, world_size: int) -> None:
    x, y = batch(index, rank, world_size)
    nn.functional.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    opt.step()
    opt.zero_grad()


def _fresh(rank: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(seed + rank)  # each rank's own dropout stream
    return model, opt


def _interrupted(rank: int, world_size: int, save_state: Callable, directory: str) -> None:
    model, opt = _fresh(rank, 100)
    for index in range(KILL_STEP):
        _step(model, opt, index, rank, world_size)
    torch.save(save_state(KILL_STEP, model, opt), os.path.join(directory, f"rank{rank}.pt"))
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # a crashed GPU: nothing in memory survives
    dist.barrier()


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    moments = [t.clone() for s in opt.state.values() for k, t in sorted(s.items()) if torch.is_tensor(t)]
    return {"params": [p.detach().clone() for p in model.parameters()], "moments": moments,
            "rng": torch.get_rng_state()}


def _uninterrupted(rank: int, world_size: int) -> dict[str, Any]:
    """The run nobody killed, launched on its own (no learner code in these ranks: issue 39):
    the state at the kill step, and the final parameters."""
    model, opt = _fresh(rank, 100)
    at_kill = None
    for index in range(STEPS):
        if index == KILL_STEP:
            at_kill = _snapshot(model, opt)
        _step(model, opt, index, rank, world_size)
    return {"at_kill": at_kill, "straight": [p.detach().clone() for p in model.parameters()]}


def _resumed(rank: int, world_size: int, restore: Callable, directory: str) -> dict[str, Any]:
    # the restarted process: other initial weights, no optimizer state, another RNG state
    torch.manual_seed(12345)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(999 + rank)
    state = torch.load(os.path.join(directory, f"rank{rank}.pt"), weights_only=False)
    start = restore(state, model, opt)
    after_restore = _snapshot(model, opt)
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= STEPS:
        return {"start": start, "after_restore": after_restore}
    seen = list(range(start, STEPS))
    for index in seen:
        _step(model, opt, index, rank, world_size)
    return {"start": start, "seen": seen, "after_restore": after_restore,
            "resumed": [p.detach().clone() for p in model.parameters()]}


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def check_resume(save_state: Callable, restore: Callable, world_size: int = 2, timeout: float = 60.0) -> None:
    """Kill the training at step ``KILL_STEP`` after ``save_state``, resume it with ``restore``
    in new processes, and compare with the uninterrupted run."""
    for name, fn in (("save_state", save_state), ("restore", restore)):
        if not callable(fn):
            raise AssertionError(f"{name} must be a function, got {type(fn).__name__}")
    with tempfile.TemporaryDirectory() as d:
        try:
            launch(_interrupted, world_size, args=(save_state, d), timeout=timeout, output="none")
        except LaunchTimeoutError:
            raise AssertionError("the interrupted run hung: save_state must not call collectives") from None
        except RankFailedError as e:  # expected: rank 1 was killed; but save_state may have raised
            if not all(os.path.exists(os.path.join(d, f"rank{r}.pt")) for r in range(world_size)):
                raise AssertionError(f"save_state raised: {first_line(e)}") from None
        try:
            ranks = launch(_resumed, world_size, args=(restore, d), timeout=timeout, output="none")
        except LaunchTimeoutError:
            raise AssertionError("the resumed run hung") from None
        except RankFailedError as e:
            raise AssertionError(f"restore raised on rank {e.rank}: {first_line(e)} (it gets what "
                                 "save_state returned, after torch.save and torch.load)") from None
    # the reference after the learner's launches: no rank that runs learner code ever holds it
    references = launch(_uninterrupted, world_size, timeout=timeout, output="none")
    for rank, (r, ref) in enumerate(zip(ranks, references)):
        start, at_kill, now = r["start"], ref["at_kill"], r["after_restore"]
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= STEPS:
            raise AssertionError(f"restore returned {start!r}: return the step to continue from, the "
                                 f"index of the next batch (here {KILL_STEP})")
        if not _same(now["params"], at_kill["params"]):
            raise AssertionError("the model's parameters were not restored: the resumed run started from "
                                 "fresh weights; save model.state_dict() and load it with load_state_dict")
        if not _same(now["moments"], at_kill["moments"]):
            raise AssertionError("the optimizer state was not restored: AdamW's step count and moments "
                                 "(exp_avg, exp_avg_sq) started from zero; save optimizer.state_dict() and "
                                 "load it with optimizer.load_state_dict")
        if not torch.equal(now["rng"], at_kill["rng"]):
            raise AssertionError(f"the RNG state was not restored (rank {rank}): dropout drew other masks "
                                 "after the restart; save torch.get_rng_state() and restore it with "
                                 "torch.set_rng_state")
        if start < KILL_STEP:
            raise AssertionError(f"the data position was not restored: restore returned {start}, so the "
                                 f"resumed run saw batches {list(range(start, KILL_STEP))} twice; save the step and return it")
        if start > KILL_STEP:
            raise AssertionError(f"the data position is wrong: restore returned {start}, so batches "
                                 f"{list(range(KILL_STEP, start))} were never seen; return the step saved")
        if not _same(r["resumed"], ref["straight"]):
            raise AssertionError("the resumed run ended with other parameters than the uninterrupted run, "
                                 "although model, optimizer, RNG and step were restored: restore them all "
                                 "exactly as saved (no extra training step, no re-initialisation)")


# ---- q2: the optimal interval --------------------------------------------------------------------
def check_optimal_interval(optimal_interval: Callable[[float, int, float], float]) -> None:
    """``optimal_interval(checkpoint_seconds, gpus, gpu_mtbf_hours)`` returns Young's interval in seconds."""
    cases = [(60.0, 16384, 50_000.0), (300.0, 1024, 20_000.0), (10.0, 8, 8_760.0)]
    for c, gpus, mtbf_h in cases:
        try:
            got = float(optimal_interval(c, gpus, mtbf_h))
        except Exception as e:  # the learner's code
            raise AssertionError(f"optimal_interval({c}, {gpus}, {mtbf_h}) raised {type(e).__name__}: {e}") from None
        m = float(job_mtbf(mtbf_h * 3600, gpus))
        want = float(young_interval(c, m))
        if math.isclose(got, want, rel_tol=1e-6):
            continue
        slips = [(math.sqrt(2 * c * mtbf_h * 3600), "the job fails when any of its GPUs fails: divide the "
                  "per-GPU MTBF by the number of GPUs"),
                 (math.sqrt(2 * c * m / 3600), "convert the MTBF from hours to seconds (x 3600) before "
                  "combining it with a checkpoint time in seconds"),
                 (math.sqrt(c * m), "Young's interval is sqrt(2 C M): the factor 2 is missing"),
                 (2 * c * m, "Young's interval is the square root of 2 C M")]
        for value, hint in slips:
            if math.isclose(got, value, rel_tol=1e-6):
                raise AssertionError(f"optimal_interval({c}, {gpus}, {mtbf_h}) = {got:.1f} s, expected "
                                     f"{want:.1f} s: {hint}")
        raise AssertionError(f"optimal_interval({c}, {gpus}, {mtbf_h}) = {got:.6g} s, expected {want:.1f} s: "
                             "sqrt(2 x checkpoint_seconds x job MTBF in seconds), job MTBF = "
                             "gpu_mtbf_hours x 3600 / gpus")
