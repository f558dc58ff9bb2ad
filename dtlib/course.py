"""The course's files, wherever dtlib runs from, and a learner's copy of them (``dtlib course DIR``).

A wheel carries the repository's ``notebooks/``, ``exercises/`` and ``masters/`` in
``dtlib/course_files/`` (``setup.py`` copies them at build time: the top-level folders stay the
one source); a source checkout, or an editable install of one, reads those folders in place.

A learner's copy holds the lessons and the exercises, never the masters: they carry the solutions,
and only the grader reads them (``dtlib grade``, whose sandbox hides them from the code it grades).
The wheel still carries them so that an instructor's ``pip install`` can grade; the solutions are
public in the repository anyway, so shipping them hides nothing that was hidden.

Re-running ``dtlib course DIR`` never overwrites a learner's work: each file it writes is recorded
(sha256) in ``DIR/.dtlib-course.json``; a file whose content is no longer what was written (or an
unrecorded file that differs from the course's) is refused, by name, before anything is written.
Files the learner did not touch are brought up to date, missing ones written again.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

__all__ = ["FOLDERS", "LEARNER_FOLDERS", "FIRST_LESSON", "RECORD", "LearnerChanges", "course_root",
           "learner_files", "write_course", "lab_command"]

FOLDERS = ("notebooks", "exercises", "masters")  # what the wheel carries (setup.py's COURSE_FOLDERS)
LEARNER_FOLDERS = ("notebooks", "exercises")  # what a learner's copy holds
FIRST_LESSON = "notebooks/00_collectives.ipynb"
RECORD = ".dtlib-course.json"
_SKIPPED = {".ipynb_checkpoints", "__pycache__", ".OTTER_LOG"}  # editor, Python and otter leftovers of a run


class LearnerChanges(ValueError):
    """A file of the learner's copy holds their changes: ``dtlib course`` writes nothing."""


def course_root() -> Path:
    """The folder holding ``notebooks/``, ``exercises/`` and ``masters/``: the installed package's
    ``course_files/``, else the source checkout this dtlib runs from."""
    package = Path(__file__).resolve().parent
    for root in (package / "course_files", package.parent):
        if all((root / folder).is_dir() for folder in FOLDERS):
            return root
    raise ValueError(f"no course files next to {package}: this dtlib was installed without them "
                     "(build the wheel from the repository: pip install dtlib or pip wheel .)")


def learner_files(root: Path | None = None) -> list[str]:
    """The lessons and exercises (and the data the lessons read) as paths relative to the course root."""
    root = course_root() if root is None else root
    found = []
    for folder in LEARNER_FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and not _SKIPPED & set(path.relative_to(root).parts):
                found.append(path.relative_to(root).as_posix())
    return found


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_course(directory: str | os.PathLike) -> list[str]:
    """Copy the lessons and exercises into ``directory`` (made if missing); return the files written.

    Raises :class:`LearnerChanges`, naming the first file, if any would overwrite a learner's changes.
    """
    directory, root = Path(directory), course_root()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"DIR {str(directory)!r} is a file, not a folder")
    record_path = directory / RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    wanted = {name: _sha256(root / name) for name in learner_files(root)}
    changed = [name for name, digest in wanted.items()
               if (directory / name).is_file() and _sha256(directory / name) not in (digest, record.get(name))]
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise LearnerChanges(f"{directory / changed[0]} holds your changes{more}: not overwritten; move it "
                             "away to get the course's copy, or give another DIR")
    written = [name for name, digest in wanted.items()
               if not (directory / name).is_file() or _sha256(directory / name) != digest]
    for name in written:
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / name, directory / name)
    record_path.write_text(json.dumps(record | wanted, indent=1, sort_keys=True) + "\n")
    return written


def lab_command(directory: str | os.PathLike) -> list[str]:
    """JupyterLab on ``directory``, opening lesson 0 (as ``make lab`` does in a checkout)."""
    command = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={Path(directory).resolve()}",
               f"--LabApp.default_url=/lab/tree/{FIRST_LESSON}"]
    # Jupyter refuses to start as root (containers, cloud notebooks) unless told so
    return command + (["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])
