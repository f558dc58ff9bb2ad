"""The ``dtlib`` command: ``dtlib memory|flops|comm|plan|calibrate|train|checkpoint|profile|shards|course|grade ...`` (``--json`` for machines).

One module per subcommand, each a small ``add_*_command(subparsers)`` that registers its options
and a ``run(args) -> int``; :mod:`dtlib.cli.args` holds what they share. :data:`COMMANDS` lists
them, so more can be added without touching the rest. Bad input prints one line on stderr and
exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import dtlib
from dtlib import extras
from dtlib.analytic import validate
from dtlib.cli.args import Parser, flag_of, join_negative_values, parse_count, parse_size
from dtlib.cli.calibrate import add_calibrate_command
from dtlib.cli.checkpoint import add_checkpoint_command
from dtlib.cli.comm import add_comm_command
from dtlib.cli.course import add_course_command
from dtlib.cli.flops import add_flops_command
from dtlib.cli.grade import add_grade_command
from dtlib.cli.memory import add_memory_command
from dtlib.cli.plan import add_plan_command
from dtlib.cli.profile import add_profile_command
from dtlib.cli.shards import add_shards_command
from dtlib.cli.train import add_train_command

__all__ = ["main", "build_parser", "COMMANDS", "DESCRIPTION", "parse_size", "parse_count"]


DESCRIPTION = """Distributed training, planned, run and inspected:
  train       train TinyGPT on dp x tp x pp x cp ranks (torchrun), with checkpoints and drills
  plan        search the layouts of a model on a cluster: step time, MFU, memory, days, cost
  calibrate   measure this machine (GEMMs, attention, memory, collectives) for plan --calibration
  profile     re-read a run's per-rank traces: step breakdown, MFU/HFU, bottlenecks
  memory      memory per GPU of a model and layout
  flops       FLOPs per step, MFU and HFU
  comm        a collective's cost, or a model's communication volume per strategy
  checkpoint  inspect a checkpoint directory, or convert it to one file
  shards      write a text as token shards for train --data
  course      write the lessons and exercises into a folder and open lesson 0 in JupyterLab
  grade       grade a folder of submitted exercises into a CSV (the masters the install carries)
Each takes --help; most take --json."""

COMMANDS: list[Callable[[Any], None]] = [add_memory_command, add_flops_command, add_comm_command,
                                          add_plan_command, add_calibrate_command, add_train_command, add_checkpoint_command,
                                          add_profile_command, add_shards_command, add_course_command,
                                          add_grade_command]


def build_parser() -> argparse.ArgumentParser:
    """The ``dtlib`` parser with every subcommand in :data:`COMMANDS`."""
    parser = Parser(prog="dtlib", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dtlib {dtlib.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dtlib`` console script; returns the exit status."""
    args = None
    try:
        args = build_parser().parse_args(join_negative_values(sys.argv[1:] if argv is None else list(argv)))
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the try
        return code
    except ModuleNotFoundError as exc:  # an extra not installed: say which, in one line
        missing = extras.missing(exc, f"dtlib {getattr(args, 'command', '')}".strip())
        if missing is None:
            raise
        print(f"dtlib: error: {missing}", file=sys.stderr)
        return 2
    except validate.InvalidArgument as exc:  # a Python parameter: say its flag
        print(f"dtlib: error: {exc.renamed(flag_of(exc.name))}".replace("\n", " "), file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"dtlib: error: {exc}".replace("\n", " "), file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except BrokenPipeError:
        # the reader went away (``dtlib ... | head``): the Python docs' recipe (library/signal,
        # "Note on SIGPIPE"): point stdout at devnull so the flush at exit cannot fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1

