"""Pipeline schedules as data, a validator and a simulator.

A schedule is one ordered list of :class:`Action` per pipeline rank. An action is a forward
(``"F"``), a backward (``"B"``: the input gradient, or the whole backward where the schedule does
not split it) or a weight-gradient (``"W"``) pass of one micro-batch through one model chunk.
With ``v`` chunks per rank the model has ``p * v`` stages, and stage ``chunk * p + rank`` lives on
``rank`` (Megatron-LM's round-robin assignment of virtual stages).

Schedules (``p`` ranks, ``m`` micro-batches):

* ``gpipe`` - all forwards, then all backwards (Huang et al. 2019, "GPipe", Sec. 2.2); every rank
  holds all ``m`` micro-batches' activations at the peak; bubble ``(p-1)/m`` of the ideal time.
* ``1f1b`` - PipeDream-Flush (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", Sec. 2.2.1): rank ``r`` runs ``p-r-1`` warm-up
  forwards, then alternates one forward and one backward; same bubble as GPipe, but rank ``r``
  holds at most ``min(p-r, m)`` micro-batches.
* ``interleaved`` - interleaved 1F1B (Narayanan et al. 2021, Sec. 2.2.2) with Megatron-LM's
  ordering (``forward_backward_pipelining_with_interleaving``): ``v`` chunks per rank shrink the
  bubble to ``(p-1)/(v m)``; warm-up ``(p-r-1)*2 + (v-1)*p`` chunk-forwards.
* ``zb-h1`` - Zero Bubble's ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1):
  1F1B with the backward split into ``B`` (input gradient, on the critical path) and ``W``
  (weight gradient, off it); rank ``r`` defers its first ``r`` W passes into the bubble
  (PyTorch's ``ScheduleInterleavedZeroBubble`` uses the same count). Bubble
  ``(p-1)(t_F + t_B - t_W)`` instead of 1F1B's ``(p-1)(t_F + t_B + t_W)``, peak memory no more
  than 1F1B's (``p`` micro-batches).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from dtlib.analytic.layout import check_layout

__all__ = ["Action", "SCHEDULE_NAMES", "schedule", "validate", "simulate", "Event", "Timeline",
           "stage_of", "KIND_NAMES", "fit_costs"]

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1")
KIND_NAMES = {"F": "forward", "B": "backward", "W": "weight-gradient"}


class Action(NamedTuple):
    """One pass of one micro-batch through one model chunk on a rank: ``kind`` is "F", "B" or "W"."""
    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def stage_of(rank: int, chunk: int, ranks: int) -> int:
    """Global stage index of ``chunk`` on ``rank`` (Megatron-LM's round-robin virtual stages)."""
    return chunk * ranks + rank


def schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """The action list of each of ``stages`` pipeline ranks for ``microbatches`` micro-batches.

    ``name`` is one of :data:`SCHEDULE_NAMES`; ``virtual_stages`` (chunks per rank) is for
    ``interleaved`` only. Invalid combinations raise ``ValueError`` through
    :data:`dtlib.analytic.layout.RULES` (interleaved needs ``virtual_stages >= 2``, ``stages >= 2`` and
    ``microbatches`` a multiple of ``stages``).
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"schedule name must be one of {SCHEDULE_NAMES}, got {name!r}")
    for arg, value in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg} must be an integer >= 1, got {value!r}")
    check_layout({"pp": stages, "num_microbatches": microbatches, "virtual_stages": virtual_stages},
                 schedule="interleaved" if name == "interleaved" else "1f1b")
    build = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "zb-h1": _zb_h1}[name]
    return [build(rank, stages, microbatches, virtual_stages) for rank in range(stages)]


def _gpipe(rank: int, p: int, m: int, v: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def _one_f_one_b(rank: int, p: int, m: int, v: int) -> list[Action]:
    warmup = min(p - rank - 1, m)
    ops = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        ops += [Action("F", warmup + i), Action("B", i)]
    ops += [Action("B", i) for i in range(m - warmup, m)]  # cool-down
    return ops


def _interleaved(rank: int, p: int, m: int, v: int) -> list[Action]:
    # Megatron-LM: virtual micro-batch k runs micro-batch (k // (p v)) p + k % p on chunk
    # (k // p) % v going forward, and on chunk v - 1 - (k // p) % v going backward.
    def forward(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    total = m * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [forward(warmup + k), backward(k)]
    ops += [backward(k) for k in range(total - warmup, total)]
    return ops


def _zb_h1(rank: int, p: int, m: int, v: int) -> list[Action]:
    # 1F1B order of F and B; the W of backward i follows it once rank r has deferred r of them,
    # and the deferred ones fill the cool-down (Qi et al. 2023, Fig. 3).
    ops: list[Action] = []
    weights_done = 0
    for op in _one_f_one_b(rank, p, m, v):
        ops.append(op)
        if op.kind == "B" and op.microbatch >= rank:
            ops.append(Action("W", weights_done))
            weights_done += 1
    ops += [Action("W", i) for i in range(weights_done, m)]
    return ops


# ---- validation -----------------------------------------------------------------------------------
def _describe(rank: int, action: Action) -> str:
    chunk = f" (chunk {action.chunk})" if action.chunk else ""
    return f"{KIND_NAMES.get(action.kind, action.kind)} of micro-batch {action.microbatch}{chunk}"


def _shape(actions: Sequence[Sequence[Action]]) -> tuple[int, int, int, bool]:
    """(ranks, chunks per rank, micro-batches, split backward?) read from a schedule."""
    p = len(actions)
    if p < 1:
        raise ValueError("a schedule needs at least one rank")
    every = [a for ops in actions for a in ops]
    if not every:
        raise ValueError("the schedule has no actions")
    for rank, ops in enumerate(actions):
        for a in ops:
            if not isinstance(a, Action) or a.kind not in KIND_NAMES:
                raise ValueError(f"rank {rank}: {a!r} is not an Action with kind 'F', 'B' or 'W'")
            if a.microbatch < 0 or a.chunk < 0:
                raise ValueError(f"rank {rank}: {a!r} has a negative micro-batch or chunk")
    v = 1 + max(a.chunk for a in every)
    m = 1 + max(a.microbatch for a in every)
    return p, v, m, any(a.kind == "W" for a in every)


def validate(actions: Sequence[Sequence[Action]]) -> None:
    """Raise ``ValueError`` naming the rank and the action if the schedule cannot run.

    Per rank: every (micro-batch, chunk) runs F, then B, then (if the schedule splits the backward)
    W, each exactly once. Across ranks: every receive has its send and nobody waits forever (the
    schedule is dry-run by :func:`simulate`, which reports a deadlock).
    """
    _check_ranks(actions)
    simulate(actions)


def _check_ranks(actions: Sequence[Sequence[Action]]) -> tuple[int, int, int, bool]:
    p, v, m, split = _shape(actions)
    needed = ("F", "B", "W") if split else ("F", "B")
    for rank, ops in enumerate(actions):
        done: set[Action] = set()
        for a in ops:
            if a in done:
                raise ValueError(f"rank {rank} runs {_describe(rank, a)} twice")
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and Action(before, a.microbatch, a.chunk) not in done:
                raise ValueError(f"rank {rank} runs {_describe(rank, a)} before its "
                                 f"{KIND_NAMES[before]}")
            done.add(a)
        for chunk in range(v):
            for mb in range(m):
                for kind in needed:
                    if Action(kind, mb, chunk) not in done:
                        raise ValueError(f"rank {rank} never runs {_describe(rank, Action(kind, mb, chunk))}"
                                         + (" (another rank splits the backward into B and W)"
                                            if kind == "W" else ""))
    return p, v, m, split


# ---- simulation -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Event:
    """One action on one rank: start and end times, and time spent waiting on its receive."""
    rank: int
    action: Action
    start: float
    end: float
    wait: float = 0.0


@dataclass
class Timeline:
    """Per-rank events of a simulated or measured pipeline step.

    ``held`` (optional) gives, per rank, ``(time, micro-batch chunks whose activations are held)``
    samples as an executor recorded them; without it they are derived from the events (a
    micro-batch is held from the start of its forward to the end of its last backward pass).
    Bubble as in Narayanan et al. 2021, Sec. 2.2: ``bubble_ratio`` = idle time / compute time,
    whose ideal value is ``(p-1)/m`` for GPipe and 1F1B; ``bubble_fraction`` = idle / total time.
    """
    events: list[list[Event]]
    held: list[list[tuple[float, int]]] | None = None

    @property
    def ranks(self) -> int:
        return len(self.events)

    @property
    def start(self) -> float:
        return min(e.start for ops in self.events for e in ops)

    @property
    def makespan(self) -> float:
        """Time from the first action's start to the last action's end, over all ranks."""
        return max(e.end for ops in self.events for e in ops) - self.start

    @property
    def busy(self) -> list[float]:
        """Compute time of each rank."""
        return [sum(e.end - e.start for e in ops) for ops in self.events]

    @property
    def idle(self) -> list[float]:
        """Time each rank is not computing within the makespan (bubble + waits)."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_ratio(self) -> float:
        return sum(self.idle) / sum(self.busy)

    @property
    def bubble_fraction(self) -> float:
        return sum(self.idle) / (self.ranks * self.makespan)

    def in_flight(self, rank: int) -> list[tuple[float, int]]:
        """``(time, held)`` after every change of the micro-batch chunks held on ``rank``."""
        if self.held is not None:
            return self.held[rank]
        ops = self.events[rank]
        last = "W" if any(e.action.kind == "W" for e in ops) else "B"
        out, held = [], 0
        for e in ops:  # a rank runs one action at a time, so list order is time order
            if e.action.kind == "F":
                held += 1
                out.append((e.start, held))
            elif e.action.kind == last:
                held -= 1
                out.append((e.end, held))
        return out

    @property
    def peak_in_flight(self) -> list[int]:
        """Most micro-batch chunks whose activations each rank holds at once."""
        return [max((h for _, h in self.in_flight(r)), default=0) for r in range(self.ranks)]


def _dependencies(a: Action, rank: int, p: int, v: int) -> list[tuple[int, Action]]:
    """(rank, action) pairs that must finish before ``a`` on ``rank`` starts."""
    s, last = stage_of(rank, a.chunk, p), p * v - 1
    if a.kind == "F":
        return [((s - 1) % p, Action("F", a.microbatch, (s - 1) // p))] if s > 0 else []
    if a.kind == "B":
        deps = [(rank, Action("F", a.microbatch, a.chunk))]
        if s < last:
            deps.append(((s + 1) % p, Action("B", a.microbatch, (s + 1) // p)))
        return deps
    return [(rank, Action("B", a.microbatch, a.chunk))]


def simulate(actions: Sequence[Sequence[Action]], t_forward: float = 1.0, t_backward: float = 2.0,
             t_weight: float = 0.0, t_p2p: float = 0.0) -> Timeline:
    """Run a schedule with fixed costs and return its :class:`Timeline`.

    Costs are per micro-batch for a rank's whole share of the layers; an action on one of ``v``
    chunks takes ``1/v`` of it. A "B" of a schedule that does not split the backward costs
    ``t_backward + t_weight`` (so schedules are compared on equal work). ``t_p2p`` delays an action
    whose input comes from another rank. Raises ``ValueError`` for a schedule that cannot run
    (see :func:`validate`), naming the ranks stuck at a deadlock.
    """
    for arg, value in (("t_forward", t_forward), ("t_backward", t_backward), ("t_weight", t_weight),
                       ("t_p2p", t_p2p)):
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"{arg} must be a finite time >= 0, got {value}")
    p, v, m, split = _check_ranks(actions)
    cost = {"F": t_forward / v, "B": (t_backward if split else t_backward + t_weight) / v,
            "W": t_weight / v}
    finished: dict[tuple[int, Action], float] = {}
    events: list[list[Event]] = [[] for _ in range(p)]
    free = [0.0] * p
    nxt = [0] * p
    progress = True
    while progress:
        progress = False
        for rank in range(p):
            while nxt[rank] < len(actions[rank]):
                a = actions[rank][nxt[rank]]
                deps = _dependencies(a, rank, p, v)
                if any(d not in finished for d in deps):
                    break
                ready = max([finished[d] + (t_p2p if d[0] != rank else 0.0) for d in deps], default=0.0)
                start = max(free[rank], ready)
                end = start + cost[a.kind]
                events[rank].append(Event(rank, a, start, end, wait=max(0.0, ready - free[rank])))
                finished[(rank, a)] = free[rank] = end
                nxt[rank] += 1
                progress = True
    stuck = [r for r in range(p) if nxt[r] < len(actions[r])]
    if stuck:
        waits = []
        for r in stuck:
            a = actions[r][nxt[r]]
            peer, dep = next(d for d in _dependencies(a, r, p, v) if d not in finished)
            what = "activation" if a.kind == "F" else "gradient"
            waits.append(f"rank {r} waits to receive the {what} for {_describe(r, a)} from rank "
                         f"{peer}, which has not run {_describe(peer, dep)}")
        raise ValueError("deadlock: " + "; ".join(waits))
    return Timeline(events)


def fit_costs(timeline: Timeline) -> dict[str, float]:
    """The :func:`simulate` arguments that describe a measured timeline: the mean time of each kind
    of action (scaled to a rank's whole share, as :func:`simulate` expects) and ``t_p2p``, the
    median delay between an action's end and the start of the action on another rank that was
    already waiting for it when it ended (transfer + wake-up)."""
    events = [e for ops in timeline.events for e in ops]
    v = 1 + max(e.action.chunk for e in events)
    p = timeline.ranks

    def mean(kind: str) -> float:
        times = [e.end - e.start for e in events if e.action.kind == kind]
        return v * sum(times) / len(times) if times else 0.0
    end = {(e.rank, e.action): e.end for e in events}
    hops = [e.start - end[d] for e in events
                  for d in _dependencies(e.action, e.rank, p, v)
                  if d[0] != e.rank and d in end and e.start - e.wait < end[d]]
    return {"t_forward": mean("F"), "t_backward": mean("B"), "t_weight": mean("W"),
            "t_p2p": max(0.0, statistics.median(hops)) if hops else 0.0}
