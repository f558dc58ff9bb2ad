"""``grades.csv``: written where no learner can plant a link, all at once, and safe to open in a
spreadsheet.

* **Where**: a submission can read the grader's command line (``/proc/<pid>/cmdline``), so with
  ``--out`` in a folder other users can write (``/tmp``) it can plant a symlink at that name and
  have a root grader write over any file. :func:`check_out_path` refuses such a folder (any folder
  above it that others can write without the sticky bit, too: they could rename it).
* **How**: a temporary file in the same folder (``O_EXCL``, 0600), renamed over ``--out``
  (:func:`os.replace` replaces a link, never writes through it): a reader never sees half a file.
* **What**: text a learner chose (the file name, an ``error`` cell with their exception's
  message) starting with ``=``, ``+``, ``-``, ``@``, a tab or a carriage return is a formula to a
  spreadsheet (``=HYPERLINK(...)``); it gets a leading ``'`` (OWASP, "CSV Injection":
  https://owasp.org/www-community/attacks/CSV_Injection).
"""
from __future__ import annotations

import csv
import io
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["LEARNER_TEXT", "first_line", "check_out_path", "neutralise", "write"]

LEARNER_TEXT = ("submission", "error")  # the columns whose text a submission chooses
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def first_line(text: str, limit: int = 200) -> str:
    """The first non-blank line of ``text``, at most ``limit`` characters: a row's ``error`` cell."""
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def check_out_path(out_csv: str | os.PathLike) -> None:
    """``ValueError`` (one line, naming ``--out``) if ``out_csv``'s folder is missing or other
    users could write it or a folder above it (sticky or not for the folder itself)."""
    folder = Path(os.path.abspath(out_csv)).parent
    if not folder.is_dir():
        raise ValueError(f"--out {os.fspath(out_csv)!r}: folder {str(folder)!r} does not exist")
    here = folder
    while True:
        mode = os.stat(here).st_mode
        shared = mode & stat.S_IWOTH and (here == folder or not mode & stat.S_ISVTX)
        if shared:
            raise ValueError(f"--out {os.fspath(out_csv)!r}: other users can write {str(here)!r} "
                             "(a submission could plant a link there); write the grades in a folder only you can write")
        if here.parent == here:
            return
        here = here.parent


def neutralise(text: str) -> str:
    """``text`` with a leading ``'`` if a spreadsheet would read it as a formula."""
    return "'" + text if text.startswith(_FORMULA_START) else text


def write(rows: list[dict], out_csv: str | os.PathLike) -> None:
    """Write ``rows`` (first row's keys as the header) to ``out_csv`` atomically, learner text
    neutralised (:func:`neutralise`)."""
    check_out_path(out_csv)
    buf = io.StringIO(newline="")
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows({k: neutralise(v) if k in LEARNER_TEXT and isinstance(v, str) else v for k, v in row.items()}
                     for row in rows)
    folder = os.path.dirname(os.path.abspath(out_csv))
    fd, temporary = tempfile.mkstemp(prefix=".grades-", suffix=".csv.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(buf.getvalue())
        os.replace(temporary, out_csv)
    except BaseException:
        os.unlink(temporary)
        raise
