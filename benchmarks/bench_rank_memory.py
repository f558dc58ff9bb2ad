"""How much a ZeRO-1 rank's memory shows its Adam state, next to what an answer cell moves it by.

Issue 39 asked whether lesson 04's check could grade the Adam state a rank *holds* by reading its
memory from outside. This steps the parameters of the check's model
(:func:`~dtlib.grading.checks.zero_fsdp.zero1_model`, random gradients) on 2 forked ranks of
dtlib's launcher, as the check does: with the lesson's ZeRO-1 (AdamW over this rank's shard, then
every parameter broadcast from its owner), or with AdamW over every parameter and the same
broadcasts (the forgery the check passes). First the rank does what an answer cell may (the
verdict runs the learner's cells there at the first ``ZeRO1(...)``): nothing, ``gc.collect()``,
``import pandas``, ``import sklearn.linear_model``. Per case it prints what rank 0's ``RssAnon``
(``/proc/PID/status``) and ``Private_Dirty`` (``smaps_rollup``) grew by, in kB, during the cell
and during the steps. docs/grading.md ("Forged data within a rank") records a run.

    PYTHONPATH=$PWD python benchmarks/bench_rank_memory.py --quick
    PYTHONPATH=$PWD python benchmarks/bench_rank_memory.py --trials 2
"""
from __future__ import annotations

import argparse
import gc
import importlib

import torch
import torch.distributed as dist

from dtlib.grading.checks import zero_fsdp
from dtlib.launcher import launch

CELLS = {"nothing": None, "gc.collect()": gc.collect,
         "import pandas": lambda: importlib.import_module("pandas"),
         "import sklearn.linear_model": lambda: importlib.import_module("sklearn.linear_model")}
_FIELDS = {"/proc/self/status": "RssAnon", "/proc/self/smaps_rollup": "Private_Dirty"}


def _kb() -> dict[str, int]:
    out = {}
    for path, field in _FIELDS.items():
        with open(path) as f:
            out.update({field: int(line.split()[1]) for line in f if line.startswith(field + ":")})
    return out


def _rank(rank: int, world_size: int, sharded: bool, cell: str, steps: int) -> dict[str, tuple[int, int]]:
    before = _kb()
    if CELLS[cell]:
        CELLS[cell]()
    after_cell = _kb()
    params = list(zero_fsdp.zero1_model().parameters())
    owners = zero_fsdp.reference_shard_params(params, world_size)
    stepped = [p for p, owner in zip(params, owners) if owner == rank] if sharded else params
    opt = torch.optim.AdamW(stepped, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        with torch.no_grad():
            for p, owner in zip(params, owners):
                dist.broadcast(p, src=owner)
    end = _kb()
    return {k: (after_cell[k] - before[k], end[k] - after_cell[k]) for k in before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=2, help="launches per case (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per launch (default 3)")
    parser.add_argument("--quick", action="store_true", help="one trial, no pandas (make benchmarks)")
    args = parser.parse_args()
    if args.trials < 1 or args.steps < 1:
        parser.error(f"--trials and --steps must be at least 1, got {args.trials} and {args.steps}")
    trials, cells = (1, ["nothing", "import sklearn.linear_model"]) if args.quick else (args.trials, list(CELLS))
    n_params = sum(p.numel() for p in zero_fsdp.zero1_model().parameters())
    print(f"AdamW state of the whole model: 8 x {n_params} = {8 * n_params} bytes "
          "(two fp32 moments per parameter); kB grown by rank 0 of 2: (in the cell, in the steps)")
    for cell in cells:
        for sharded in (True, False):
            for _ in range(trials):
                grown = launch(_rank, 2, args=(sharded, cell, args.steps), output="none")[0]
                print(f"{cell:28s} {'ZeRO-1' if sharded else 'AdamW over all':15s} "
                      + "  ".join(f"{k} {v[0]:>7d} {v[1]:>6d}" for k, v in grown.items()))


if __name__ == "__main__":
    main()
