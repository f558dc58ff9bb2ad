"""Where a run will write, checked before it starts, and a file written whole or not at all: a directory flag must not name a file, a file
flag must not name a directory, and what does not exist yet must be creatable (its nearest existing
ancestor a writable directory). Otherwise the first rank to write would die with a traceback
(``FileExistsError`` from ``os.makedirs``, ``IsADirectoryError`` from ``open``) after every rank
had started. Pure Python: no torch."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_output_dir", "check_output_file", "write_atomically"]


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


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` (its missing folders made) through a temporary file in the same
    folder and ``os.replace``: an interrupted write leaves the old file or none, never half a one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(text)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
