"""``dtlib grade SUBMISSIONS --lesson NN ...``: ``python -m dtlib.grading grade`` under the ``dtlib``
command, with the masters the install carries (:func:`dtlib.grading.masters_dir`)."""
from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_grade_command"]


def add_grade_command(sub: Any) -> None:
    # The grader's own parser reads the options (and prints --help): no second copy of them here.
    # No prefix character can start an argument (NUL ends a C string), so every argument, "--help"
    # included, is handed on as it is.
    p = sub.add_parser("grade", add_help=False, prefix_chars="\0", help="grade a folder of submitted exercises "
                       "into a CSV", description="python -m dtlib.grading grade, with the same options")
    p.add_argument("options", nargs="*")
    p.set_defaults(run=_run_grade)


def _run_grade(args: argparse.Namespace) -> int:
    from dtlib.grading import main

    return main(["grade", *args.options], prog="dtlib")
