"""Checks for the 3D-parallelism exercise: the learner's rank grid.

* :func:`check_coordinates` - ``coordinates(rank, dp, tp, pp)`` returns ``(dp_rank, tp_rank,
  pp_rank)`` in Megatron-LM's order (``megatron/core/parallel_state.py``: tensor-parallel index
  fastest, then data, pipeline outermost), on several layouts;
* :func:`check_groups` - ``groups(dp, tp, pp)`` returns the TP, DP and PP groups (lists of ranks)
  of those layouts; then TinyGPT is trained on 4 real ranks with the learner's groups (dp = 2,
  tp = 2) and must equal single-process training.
"""
from __future__ import annotations

from typing import Any, Callable

from dtlib.grading.feedback import first_line
from dtlib.launcher import LaunchTimeoutError, RankFailedError, launch
from dtlib.parallel.mesh import ParallelLayout

__all__ = ["LAYOUTS", "check_coordinates", "check_groups", "train_with_groups", "TRAIN_LAYOUT"]

# (dp, tp, pp): square and lopsided grids, so that swapping two axes is always caught
LAYOUTS = [(2, 2, 1), (2, 4, 2), (4, 2, 2), (3, 2, 2), (2, 1, 4), (1, 4, 3)]
TRAIN_LAYOUT = dict(dp=2, tp=2)


def _reference(dp: int, tp: int, pp: int, rank: int) -> tuple[int, int, int]:
    c = ParallelLayout(dp=dp, tp=tp, pp=pp).coordinates(rank)
    return c["dp"], c["tp"], c["pp"]


def check_coordinates(fn: Callable[[int, int, int, int], Any]) -> None:
    """``fn(rank, dp, tp, pp) -> (dp_rank, tp_rank, pp_rank)`` in Megatron-LM's order."""
    for dp, tp, pp in LAYOUTS:
        for rank in range(dp * tp * pp):
            got = fn(rank, dp, tp, pp)
            want = _reference(dp, tp, pp, rank)
            where = f"with dp={dp}, tp={tp}, pp={pp}, rank {rank}"
            if got is None:
                raise AssertionError(f"{where}: coordinates returned None; return a tuple "
                                     "(dp_rank, tp_rank, pp_rank)")
            got = tuple(got)
            if got == want:
                continue
            if len(got) != 3:
                raise AssertionError(f"{where}: you returned {got}; return three numbers, "
                                     "(dp_rank, tp_rank, pp_rank)")
            if got[1] != want[1]:
                raise AssertionError(f"{where}: you returned {got}, expected {want}: tp_rank is wrong; the "
                                     "tensor-parallel index varies fastest (see the rank formula in Q1)")
            if got[2] != want[2]:
                raise AssertionError(f"{where}: you returned {got}, expected {want}: pp_rank is wrong; the "
                                     "pipeline stage is outermost (see the rank formula in Q1)")
            raise AssertionError(f"{where}: you returned {got}, expected {want}: dp_rank is wrong; the "
                                 "data-parallel index sits between tp and pp (see the rank formula in Q1)")


def _canonical(groups: Any) -> list[list[int]]:
    return sorted(sorted(int(r) for r in g) for g in groups)


def check_groups(fn: Callable[[int, int, int], dict], coordinates: Callable | None = None,
                 train: bool = True) -> None:
    """``fn(dp, tp, pp) -> {"tp": [[ranks]...], "dp": [...], "pp": [...]}`` equals Megatron-LM's
    groups on every layout of :data:`LAYOUTS`; then (``train``) TinyGPT trained on 4 real ranks
    with these groups equals single-process training. Groups built from the learner's
    ``coordinates`` (Q1) are wrong while Q1 is: then the verdict is "fix Q1 first", not a blame
    on the groups."""
    try:
        _check_groups(fn, train)
    except AssertionError:
        if coordinates is not None:
            try:
                check_coordinates(coordinates)
            except AssertionError:
                raise AssertionError("your groups are wrong, and so is coordinates (Q1), which they use: "
                                     "fix Q1 first") from None
        raise


def _check_groups(fn: Callable[[int, int, int], dict], train: bool) -> None:
    hints = {"tp": "ranks that differ only in tp_rank: tp consecutive ranks",
             "dp": "ranks that differ only in dp_rank: same tp_rank and pp_rank, tp apart",
             "pp": "ranks that differ only in pp_rank: tp * dp apart"}
    for dp, tp, pp in LAYOUTS:
        want = ParallelLayout(dp=dp, tp=tp, pp=pp).groups
        got = fn(dp, tp, pp)
        where = f"with dp={dp}, tp={tp}, pp={pp}"
        if not isinstance(got, dict):
            raise AssertionError(f"{where}: groups returned {type(got).__name__}; return a dict "
                                 '{"tp": [...], "dp": [...], "pp": [...]} of lists of ranks')
        for kind in ("tp", "dp", "pp"):
            if kind not in got:
                raise AssertionError(f'{where}: the dict has no "{kind}" entry; return "tp", "dp" and "pp"')
            mine = _canonical(got[kind])
            if mine != want[kind]:
                raise AssertionError(f"{where}: your {kind} groups are {mine}, expected {want[kind]}. "
                                     f"A {kind} group is the {hints[kind]}")
    if train:
        train_with_groups(fn)


def _train(rank: int, world_size: int, groups: dict) -> dict:
    from dtlib.trainer import TrainConfig, train

    config = TrainConfig(layers=2, hidden=32, heads=4, seq=16, steps=2, optimizer="sgd", lr=0.5, **TRAIN_LAYOUT)
    return train(rank, world_size, config, groups=groups)


def train_with_groups(fn: Callable[[int, int, int], dict], timeout: float = 60.0) -> dict:
    """Train TinyGPT on :data:`TRAIN_LAYOUT` with the learner's groups; return rank 0's summary.
    Raises AssertionError if it fails or differs from one process."""
    from dtlib.trainer import TrainConfig, train

    layout = (TRAIN_LAYOUT["dp"], TRAIN_LAYOUT["tp"], 1)
    groups = {k: _canonical(v) for k, v in fn(*layout).items() if k in ("tp", "dp", "pp")}
    try:
        got = launch(_train, layout[0] * layout[1], args=(groups,), timeout=timeout, output="none")[0]
    except LaunchTimeoutError:
        raise AssertionError(f"training with your groups hung (no result in {timeout:g} s)") from None
    except RankFailedError as e:
        raise AssertionError(f"training with your groups failed on rank {e.rank}: {first_line(e)}") from None
    config = TrainConfig(layers=2, hidden=32, heads=4, seq=16, steps=2, optimizer="sgd", lr=0.5,
                         micro_batch_size=2 * TRAIN_LAYOUT["dp"])
    single = train(0, 1, config)
    worst = max(abs(a - b) for a, b in zip(got["losses"], single["losses"]))
    if worst > 1e-4:
        raise AssertionError(f"with your groups the losses {got['losses']} differ from one process's "
                             f"{single['losses']}: the groups must match the coordinates")
    return got
