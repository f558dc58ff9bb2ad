"""``dtlib profile DIR``: re-read the per-rank traces of a profiled run (:mod:`dtlib.profile`)."""
from __future__ import annotations

import argparse
import os
from typing import Any

from dtlib.cli.args import emit

__all__ = ["add_profile_command", "run_profile"]


def add_profile_command(sub: Any) -> None:
    p = sub.add_parser("profile", help="re-read saved per-rank traces: breakdown, MFU/HFU, findings",
                       description="Summarise the rank<k>.json Chrome traces that 'dtlib train "
                                   "--profile DIR' or dtlib.profile.profile_steps wrote.")
    p.add_argument("dir", help="folder holding rank0.json, rank1.json, ...")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    from dtlib.profile import Finding, format_summary, read_dir  # torch only when profiling

    if not os.path.isdir(args.dir):
        raise ValueError(f"DIR {args.dir!r} is not a folder of traces")
    profile = read_dir(args.dir)
    return emit(args, {"profile": profile},
                 format_summary(profile, [Finding(**f) for f in profile["findings"]]))
