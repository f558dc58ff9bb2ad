"""Where a run will write, checked before it starts: a directory flag must not name a file, a file
flag must not name a directory, and what does not exist yet must be creatable (its nearest existing
ancestor a writable directory). Otherwise the first rank to write would die with a traceback
(``FileExistsError`` from ``os.makedirs``, ``IsADirectoryError`` from ``open``) after every rank
had started. Pure Python: no torch."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_output_dir", "check_output_file"]


def _creatable(flag: str, path: Path) -> None:
    """``path`` does not exist: its nearest existing ancestor must be a directory we may write in."""
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {path}: cannot create it, {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot create it, {ancestor} is not writable")


def check_output_dir(flag: str, path: str | os.PathLike) -> None:
    """``path`` is a directory, or can be made one (``os.makedirs``); ``flag`` names it in the error."""
    path = Path(path)
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag} {path} is a file; give a directory (created if missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path} is not writable")
        return
    _creatable(flag, path)


def check_output_file(flag: str, path: str | os.PathLike) -> None:
    """``path`` is a file (appended to or replaced), or can be created; ``flag`` names it in the error."""
    path = Path(path)
    if path.exists():
        if path.is_dir():
            raise ValueError(f"{flag} {path} is a directory; give a file path")
        if not os.access(path, os.W_OK):
            raise ValueError(f"{flag} {path} is not writable")
        return
    _creatable(flag, path)
