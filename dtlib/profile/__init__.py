"""Profiling a distributed step: capture (torch.profiler, per-rank Chrome traces, FLOPs counted
with FlopCounterMode), the breakdown parsed from each trace, and the diagnosis (MFU/HFU and
findings ranked by time lost). See ``docs/profiling.md``."""
from typing import Any

from dtlib.profile.breakdown import PARTS, load_trace, parse_trace, step_intervals
from dtlib.profile.diagnose import (FIXES, KINDS, Finding, Thresholds, diagnose, format_summary,
                                    summarize)

__all__ = ["PARTS", "PHASES", "KINDS", "FIXES", "Finding", "Thresholds", "phase", "count_flops",
           "profile_steps", "trace_path", "parse_trace", "load_trace", "step_intervals", "summarize", "diagnose",
           "format_summary", "report", "read_dir"]


# Capturing runs torch.profiler; re-reading saved traces (``dtlib profile DIR``) needs numpy only,
# so the capture side loads on first use.
_CAPTURE = ("PHASES", "count_flops", "phase", "profile_steps", "trace_path")


def __getattr__(name: str) -> Any:
    if name in _CAPTURE:
        from dtlib.profile import capture
        return getattr(capture, name)
    raise AttributeError(f"module 'dtlib.profile' has no attribute {name!r}")


def report(ranks: list) -> dict:
    """The job's profile from the ranks' parsed profiles: :func:`summarize` plus its
    ``findings`` (:func:`diagnose`, as dicts), what ``dtlib train --profile`` and
    ``dtlib profile DIR`` print (``--json``: this object)."""
    profile = summarize(ranks)
    profile["findings"] = [f.as_dict() for f in diagnose(profile)]
    return profile


def read_dir(trace_dir: str) -> dict:
    """Re-read the traces ``profile_steps`` wrote into ``trace_dir``: the summarised profile with
    its ``findings`` (as dicts), what ``dtlib profile DIR`` prints."""
    import glob
    import os

    paths = sorted(glob.glob(os.path.join(trace_dir, "rank*.json")))
    if not paths:
        raise ValueError(f"no rank*.json trace in {trace_dir!r}: write them with "
                         "dtlib train --profile DIR or dtlib.profile.profile_steps(trace_dir=...)")
    return report([load_trace(p) for p in paths])
