"""``dtlib checkpoint inspect|convert``: read a checkpoint directory (:mod:`dtlib.resilience.checkpoint`)."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any

from dtlib.cli.args import Parser, emit, table
from dtlib.outputs import check_output_file

__all__ = ["add_checkpoint_command"]


def add_checkpoint_command(sub: Any) -> None:
    p = sub.add_parser("checkpoint", help="inspect or convert a dtlib checkpoint directory",
                       description="A directory of step checkpoints (dtlib.resilience.checkpoint), or one of them.")
    actions = p.add_subparsers(dest="action", required=True, parser_class=Parser)
    inspect = actions.add_parser("inspect", help="steps, layout, parameters and files of the newest checkpoint")
    inspect.add_argument("directory")
    inspect.add_argument("--step", type=int, default=None, help="a step other than the newest")
    inspect.add_argument("--json", action="store_true")
    convert = actions.add_parser("convert", help="one torch.save file with the full parameters")
    convert.add_argument("directory")
    convert.add_argument("--to-torch", required=True, metavar="FILE.pt")
    convert.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_checkpoint)


def _run_checkpoint(args: argparse.Namespace) -> int:
    from dtlib.resilience.checkpoint import (CheckpointError, checkpoint_steps, read_manifest, to_torch,
                                             verify_files)
    steps = checkpoint_steps(args.directory)
    own = os.path.exists(os.path.join(args.directory, "manifest.json"))
    if not steps and not own:
        raise ValueError(f"no complete checkpoint in {args.directory} (no step*/manifest.json)")
    try:
        if args.action == "convert":
            check_output_file("--to-torch", args.to_torch)
            out = to_torch(args.directory, args.to_torch)
            data = {"file": args.to_torch, "step": out["step"], "tensors": len(out["model"])}
            return emit(args, data, f"wrote {args.to_torch}: step {out['step']}, {len(out['model'])} tensors")
        step = args.step if args.step is not None else (steps[-1] if steps else None)
        path = args.directory if own else os.path.join(args.directory, f"step{step:08d}")
        manifest = read_manifest(path)
        verify_files(path, manifest)
    except CheckpointError as exc:  # names the file: one line, exit 2
        raise ValueError(str(exc)) from None
    rows = [("checkpoints", ", ".join(f"step{s:08d}" for s in steps) or path),
            ("step", str(manifest["step"])), ("data position", json.dumps(manifest["data_position"])),
            ("layout", json.dumps(manifest["layout"])), ("written by", f"{manifest['world_size']} ranks")]
    rows += [(name, str(shape)) for name, shape in manifest["shapes"].items()]
    rows += [(f, f"{d['bytes']:,} bytes, sha256 {d['sha256'][:12]}") for f, d in manifest["files"].items()]
    return emit(args, {"steps": steps, "path": path, **manifest}, table(rows, f"checkpoint {path}"))
