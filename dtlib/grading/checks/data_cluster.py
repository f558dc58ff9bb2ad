"""Checks for the data-and-cluster exercise: a rank-to-sample assignment that stays exact when the
job is resized (Q1), and a placement that keeps tensor parallelism inside nodes (Q2).

* :func:`check_assignment` - ``positions(consumed, global_batch, rank, world_size)`` on 1, 2 and 4
  ranks: the ranks of one step read the next ``global_batch`` global positions, each once; a run
  of 3 steps on 4 ranks resized to 2 ranks (then 3 more steps) reads every position once.
* :func:`check_placement` - ``place(rank, dp, tp, pp, gpus_per_node)``: the GPU of a rank numbered DP
  fastest (``rank = dp_rank + dp x (pp_rank + pp x tp_rank)``); every rank its own GPU, every TP
  group inside one node, and a ValueError when tp does not divide the GPUs per node.
"""
from __future__ import annotations

from typing import Callable

from dtlib.grading.feedback import first_line

__all__ = ["check_assignment", "check_placement", "job_coordinates", "LAYOUTS"]

# (dp, tp, pp, gpus_per_node) the placement is checked on
LAYOUTS = [(2, 4, 1, 4), (2, 8, 1, 8), (4, 2, 2, 8), (2, 2, 2, 4), (1, 4, 2, 8), (4, 1, 1, 2)]


def _call(fn: Callable, name: str, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any error of the learner's code becomes a hint
        raise AssertionError(f"{name}{args} raised {first_line(e)}") from e


def _as_ints(value, what: str) -> list[int]:
    if value is ... or value is None:
        raise AssertionError(f"{what} returned {value}: replace the ... with your code")
    try:
        out = list(value)
    except TypeError:
        raise AssertionError(f"{what} must return a list of integers, got {type(value).__name__}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise AssertionError(f"{what} must return a list of integers (Python int), got {out[:6]}")
    return out


def _step(positions: Callable, consumed: int, global_batch: int, world: int) -> list[list[int]]:
    return [_as_ints(_call(positions, "positions", consumed, global_batch, rank, world),
                     f"positions({consumed}, {global_batch}, {rank}, {world})") for rank in range(world)]


def _exactly(read: list[list[int]], expected: range, where: str) -> None:
    flat = [p for r in read for p in r]
    twice = sorted({p for p in flat if flat.count(p) > 1})
    missing = sorted(set(expected) - set(flat))
    outside = sorted(set(flat) - set(expected))
    if twice:
        raise AssertionError(f"{where}: positions {twice[:8]} were read by more than one rank (or twice): each "
                             f"rank reads its own positions, shared with no other rank")
    if outside:
        hint = ("start from consumed: the step reads positions consumed .. consumed + global_batch - 1"
                if any(p < expected.start for p in outside) else
                "a step reads only global_batch positions: divide them among world_size ranks")
        raise AssertionError(f"{where}: positions {outside[:8]} are outside {expected.start}..{expected.stop - 1}; {hint}")
    if missing:
        raise AssertionError(f"{where}: positions {missing[:8]} were never read: the world_size ranks together must "
                             f"cover all global_batch positions (use world_size, not a fixed number of ranks)")


def check_assignment(positions: Callable) -> None:
    """``positions(consumed, global_batch, rank, world_size)``: exactly once per step on 1, 2 and 4
    ranks, and across a resize from 4 ranks to 2 (the state is ``consumed`` alone)."""
    for world in (1, 2, 4):
        for consumed in (0, 8, 40):
            read = _step(positions, consumed, 8, world)
            _exactly(read, range(consumed, consumed + 8), f"one step on {world} rank(s) after consumed={consumed}")
    consumed, seen = 0, []
    for world in (4, 4, 4, 2, 2, 2):
        for r in _step(positions, consumed, 8, world):
            seen += r
        consumed += 8
    twice = sorted({p for p in seen if seen.count(p) > 1})
    missing = sorted(set(range(48)) - set(seen))
    if twice or missing:
        raise AssertionError(f"3 steps on 4 ranks then 3 on 2 ranks: positions read twice {twice[:8]}, never read "
                             f"{missing[:8]}; compute the positions from consumed, global_batch, rank and "
                             f"world_size only, so a resize changes nothing")


def job_coordinates(rank: int, dp: int, tp: int, pp: int) -> dict[str, int]:
    """The job's rank order: DP fastest, then PP, TP slowest (``rank = d + dp (p + pp t)``)."""
    return {"dp": rank % dp, "pp": rank // dp % pp, "tp": rank // (dp * pp)}


def check_placement(place: Callable) -> None:
    """``place(rank, dp, tp, pp, gpus_per_node)``: a GPU per rank, every TP group on one node, and a
    ValueError when tp does not divide gpus_per_node."""
    for dp, tp, pp, per_node in LAYOUTS:
        world = dp * tp * pp
        gpu = [_call(place, "place", r, dp, tp, pp, per_node) for r in range(world)]
        if any(g is ... or g is None for g in gpu):
            raise AssertionError(f"place returned {gpu[0]}: replace the ... with your code")
        if not all(isinstance(g, int) and not isinstance(g, bool) for g in gpu):
            raise AssertionError(f"place must return an integer GPU index, got {gpu[:6]}")
        where = f"dp={dp}, tp={tp}, pp={pp}, {per_node} GPUs per node"
        bad = [g for g in gpu if not 0 <= g < world]
        if bad:
            raise AssertionError(f"{where}: GPUs {bad[:5]} do not exist; use GPUs 0..{world - 1} (the job's own)")
        twice = sorted({g for g in gpu if gpu.count(g) > 1})
        if twice:
            raise AssertionError(f"{where}: two ranks on GPU(s) {twice[:5]}: each rank needs its own GPU "
                                 f"(did you leave out the pp or dp coordinate?)")
        groups: dict[tuple[int, int], list[int]] = {}
        for r in range(world):
            c = job_coordinates(r, dp, tp, pp)
            groups.setdefault((c["dp"], c["pp"]), []).append(r)
        for key, ranks in groups.items():
            nodes = sorted({gpu[r] // per_node for r in ranks})
            if len(nodes) > 1:
                raise AssertionError(
                    f"{where}: the TP group of ranks {ranks} sits on nodes {nodes}: put the tp ranks of one "
                    f"(dp, pp) on consecutive GPUs (the tensor-parallel index varies fastest, as in Megatron-LM)")
    try:
        place(0, 1, 16, 1, 8)
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"tp=16 on 8-GPU nodes should raise ValueError, it raised {first_line(e)}") from e
    raise AssertionError("tp=16 on 8-GPU nodes cannot stay inside a node: raise ValueError when tp does not divide "
                         "gpus_per_node")
