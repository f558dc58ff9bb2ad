"""Breakdown: where the time of each step went, read from a rank's Chrome trace.

The thread that ran the ``dtlib/step`` ranges is the host thread. Inside each step window time
is cut into disjoint parts, the first matching rule winning, so the parts add up to the step
exactly:

* ``data``: inside a ``dtlib/data`` range on the host thread (the input pipeline);
* ``optimizer``: inside ``dtlib/optimizer``;
* ``compute``: an operator runs - on CPU a ``cpu_op`` on the host thread, on a GPU a ``kernel`` on
  any stream - other than communication (NCCL kernels are communication);
* ``bubble``: the compute thread waits on a point-to-point send/receive (a pipeline stage waiting
  for its neighbour);
* ``exposed_comm``: a collective is in flight (``gloo:*``/``nccl:*`` events on any thread,
  ``c10d::*`` collectives and ``dtlib/comm`` ranges on the compute thread) and nothing above runs:
  communication the step waits for;
* ``other``: nothing of the above (Python between operators, sleeps, waiting with nothing in
  flight).

``overlapped_comm`` (collectives in flight while compute runs) and ``host_gaps`` (``other`` time
inside forward/backward: the launch overhead between operators) are reported beside the parts.
This is the temporal breakdown of Meta's Holistic Trace Analysis with the host thread as the
compute stream.
"""
from __future__ import annotations

import json
from statistics import mean
from typing import Any, Iterable

__all__ = ["PARTS", "Intervals", "parse_trace", "load_trace", "step_intervals"]

PARTS = ("compute", "exposed_comm", "bubble", "data", "optimizer", "other")
_P2P = {"c10d::send", "c10d::recv_", "c10d::recv_any_source_", "gloo:send", "gloo:recv",
        "nccl:send", "nccl:recv"}
_COMM_PREFIXES = ("gloo:", "nccl", "c10d::", "dtlib/comm")  # nccl: ranges and ncclDevKernel_*

Intervals = list[tuple[float, float]]


def _union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, non-overlapping union of ``(start, end)`` intervals."""
    out: Intervals = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: Intervals, b: Intervals) -> Intervals:
    out = []
    for start, end in a:
        for bs, be in b:
            if be <= start or bs >= end:
                continue
            if bs > start:
                out.append((start, bs))
            start = max(start, be)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def _length(intervals: Intervals) -> float:
    return sum(end - start for start, end in intervals)


def _is_comm(name: str) -> bool:
    return name.startswith(_COMM_PREFIXES)


def _step_intervals(events: list[dict], main: Any, window: tuple[float, float]) -> dict[str, Intervals]:
    """The disjoint parts of one step window as intervals (microseconds), plus ``comm_in_flight``
    (collectives on any thread) and ``host_gaps``."""
    lo, hi = window
    inside = [e for e in events if e["ts"] < hi and e["ts"] + e["dur"] > lo]
    span = [(max(e["ts"], lo), min(e["ts"] + e["dur"], hi), e) for e in inside]
    on_main = [(s, t, e) for s, t, e in span if e["tid"] == main]

    def ranges(name: str) -> Intervals:
        return _union((s, t) for s, t, e in on_main if e["name"] == f"dtlib/{name}")

    data, optimizer = ranges("data"), ranges("optimizer")
    p2p = _union((s, t) for s, t, e in on_main if e["name"] in _P2P)
    main_comm = _union((s, t) for s, t, e in on_main if _is_comm(e["name"]) and e["name"] not in _P2P)
    other_threads = _union((s, t) for s, t, e in span if e["tid"] != main and _is_comm(e["name"])
                           and e["name"] not in _P2P)
    kernels = [(s, t, e) for s, t, e in span if e.get("cat") == "kernel"]
    device_ops = kernels or [(s, t, e) for s, t, e in on_main if e.get("cat") == "cpu_op"]
    ops = _union((s, t) for s, t, e in device_ops if not _is_comm(e["name"]))
    taken = _union(data + optimizer)
    compute = _subtract(_subtract(ops, taken), _union(main_comm + p2p))
    taken = _union(taken + compute)
    bubble = _subtract(p2p, taken)
    taken = _union(taken + bubble)
    exposed = _subtract(_union(main_comm + other_threads), taken)
    taken = _union(taken + exposed)
    idle = _subtract([(lo, hi)], taken)
    return {"compute": compute, "exposed_comm": exposed, "bubble": bubble, "data": data,
            "optimizer": optimizer, "other": idle, "comm_in_flight": _union(main_comm + other_threads),
            "overlapped_comm": _intersect(other_threads, compute),
            "host_gaps": _intersect(idle, _union(ranges("forward") + ranges("backward")))}


def _step_parts(events: list[dict], main: Any, window: tuple[float, float]) -> dict[str, float]:
    """The parts of one step window in seconds (and ``step``, its length)."""
    intervals = _step_intervals(events, main, window)
    out = {part: _length(intervals[part]) / 1e6
           for part in (*PARTS, "overlapped_comm", "host_gaps")}
    out["step"] = (window[1] - window[0]) / 1e6
    return out


def _events(trace: dict[str, Any]) -> tuple[list[dict], list[dict]]:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    # on a GPU each record_function range is also drawn on the stream ("gpu_user_annotation":
    # from its first kernel to its last); the step is the host's range, which waits for them
    step_events = sorted((e for e in events if e["name"] == "dtlib/step" and e.get("cat") != "gpu_user_annotation"),
                         key=lambda e: e["ts"])
    if not step_events:
        raise ValueError("no 'dtlib/step' range in the trace: nothing to break down")
    return events, step_events


def step_intervals(trace: dict[str, Any], index: int = 0) -> dict[str, list[tuple[float, float]]]:
    """Where each part of step ``index`` lies in time: ``{part: [(start, end), ...]}`` in seconds
    from the step's start, plus ``comm_in_flight`` (to draw a timeline from the trace)."""
    events, step_events = _events(trace)
    if not 0 <= index < len(step_events):
        raise ValueError(f"index must be in [0, {len(step_events)}), got {index}")
    step = step_events[index]
    start = step["ts"]
    intervals = _step_intervals(events, step_events[0]["tid"], (start, start + step["dur"]))
    return {part: [((s - start) / 1e6, (t - start) / 1e6) for s, t in iv]
            for part, iv in intervals.items()}


def parse_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """One rank's profile from its exported Chrome trace (a dict, as ``json.load`` reads it).

    Returns ``rank``, ``steps`` (the parts of each step), ``breakdown`` (mean seconds per step of
    each of :data:`PARTS`, plus ``overlapped_comm``, ``host_gaps`` and ``step``), ``wall`` (mean
    ``perf_counter`` seconds per step, measured outside the profiler), ``flops`` and
    ``peak_flops`` from the trace's ``dtlib`` metadata.
    """
    if not isinstance(trace, dict):
        raise ValueError(f"a Chrome trace is a JSON object with traceEvents, got a {type(trace).__name__}")
    meta = trace.get("dtlib")
    if isinstance(meta, str):
        meta = json.loads(meta)
    if not isinstance(meta, dict):
        raise ValueError("this trace has no 'dtlib' metadata: record it with "
                         "dtlib.profile.profile_steps")
    events, step_events = _events(trace)
    main = step_events[0]["tid"]
    steps = [_step_parts(events, main, (e["ts"], e["ts"] + e["dur"])) for e in step_events]
    breakdown = {key: mean(s[key] for s in steps) for key in steps[0]}
    return {"rank": meta["rank"], "steps": steps, "breakdown": breakdown,
            "wall": mean(meta["wall_seconds"]), "flops": meta["flops"],
            "peak_flops": meta["peak_flops"], "dtype": meta.get("dtype", "fp32"),
            "tokens": meta.get("tokens")}


def load_trace(path: str) -> dict[str, Any]:
    """:func:`parse_trace` of the trace file at ``path``; a file that is not one is a one-line
    ``ValueError`` naming it (a truncated or hand-edited trace, a JSON file of something else)."""
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc})") from None
    try:
        return parse_trace(trace)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ValueError(f"{path}: not a trace dtlib.profile wrote ({type(exc).__name__}: {exc})") from None
