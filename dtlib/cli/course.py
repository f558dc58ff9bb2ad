"""``dtlib course [DIR]``: the lessons and exercises into DIR, then JupyterLab on lesson 0 (:mod:`dtlib.course`)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

__all__ = ["add_course_command"]


def add_course_command(sub: Any) -> None:
    p = sub.add_parser("course", help="write the lessons and exercises into a folder and open lesson 0",
                       description="Write the course's lessons (notebooks/) and exercises (exercises/) into DIR, "
                                   "then start JupyterLab there on lesson 0. Run it again to get new or updated "
                                   "lessons: a file you changed is never overwritten (it is named, and nothing is "
                                   "written). The lessons need dtlib[course].")
    p.add_argument("dir", nargs="?", default="dtlib-course", help="the folder to write (default: ./dtlib-course)")
    p.add_argument("--no-lab", action="store_true", help="print the command that opens the course, do not start it")
    p.set_defaults(run=_run_course)


def _run_course(args: argparse.Namespace) -> int:
    from dtlib.course import lab_command, write_course
    from dtlib.extras import require

    if not args.no_lab:  # before writing anything: the lab is what was asked for
        require("course", "jupyterlab", "torch", feature="dtlib course")
    written = write_course(args.dir)
    print(f"{args.dir}: {len(written)} files written" + ("" if written else " (the course was already there)"))
    command = lab_command(args.dir)
    if args.no_lab:
        print("open the course with:\n  " + shlex.join(command))
        return 0
    sys.stdout.flush()
    # JupyterLab takes this process's place: Ctrl-C reaches it alone (it asks before stopping)
    os.execv(command[0], command)
