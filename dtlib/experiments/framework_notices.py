"""Framework notices folded away in lesson 13 and exercise 13 (issue 38: noise that is not the point).

On a CPU machine DeepSpeed and Megatron-Core announce what they lack: DeepSpeed's async-io probe
compiles against libaio and lets the linker's ``ld: cannot find -laio`` / ``collect2: error`` reach
stderr, its logger prints ``[WARNING] ... Setting accelerator to CPU``, and Megatron-Core warns five
times that "Transformer Engine and Apex are not installed" (``megatron/core/optimizer/__init__.py``
and neighbours, 0.16.1). None of it changes what the lesson runs.

:func:`fold_notices` silences the warnings at their source (warning filters here and, through
``PYTHONWARNINGS``, in every rank the lesson starts) and, in a notebook, captures each cell's
stderr (the file descriptor too, so that ranks and compilers are caught): lines that match
:data:`NOTICES` are shown folded under one line saying how many there were; every other line is
written back unchanged, so a real error still shows.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
import warnings
from typing import Any

__all__ = ["NOTICES", "WARNING_PREFIXES", "split_notices", "fold_notices"]

# warnings.filterwarnings and PYTHONWARNINGS match a message's start
WARNING_PREFIXES = ("Transformer Engine and Apex are not installed", "Apex is not installed")
NOTICES = re.compile(r"ld: cannot find -laio|collect2: error|\[WARNING\]|/tmp/\S+\.c:|compilation terminated|"
                     r"Transformer Engine and Apex are not installed|Apex is not installed|^\s*warnings\.warn\(|"
                     r"HF assets path .* does not exist")


def split_notices(text: str) -> tuple[list[str], list[str]]:
    """``text``'s lines as (notices matching :data:`NOTICES`, every other non-empty line)."""
    notices, other = [], []
    for line in text.splitlines():
        if line.strip():
            (notices if NOTICES.search(line) else other).append(line)
    return notices, other


class _CellCapture:
    """stderr of one cell (``sys.stderr`` and file descriptor 2) into a temporary file."""

    def __init__(self) -> None:
        self.saved: tuple[Any, int, Any] | None = None

    def start(self, *_: Any) -> None:
        if self.saved is not None:
            return
        sys.stderr.flush()
        capture = tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace")
        self.saved = (sys.stderr, os.dup(2), capture)
        os.dup2(capture.fileno(), 2)
        sys.stderr = capture

    def stop(self, *_: Any) -> None:
        if self.saved is None:
            return
        stream, fd, capture = self.saved
        self.saved = None
        capture.flush()
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = stream
        capture.seek(0)
        notices, other = split_notices(capture.read())
        capture.close()
        if other:
            print(*other, sep="\n", file=sys.stderr)
        if notices:
            _show_folded(notices)


def _show_folded(lines: list[str]) -> None:
    from html import escape

    from IPython.display import HTML, display

    display(HTML(f"<details><summary>{len(lines)} framework notice(s) about libraries this CPU machine lacks "
                 f"(folded)</summary><pre>{escape(chr(10).join(lines))}</pre></details>"))


_CAPTURE = _CellCapture()


def fold_notices() -> None:
    """Silence the notices at their source and, inside IPython, fold what still reaches stderr,
    cell by cell. Calling it again changes nothing."""
    for prefix in WARNING_PREFIXES:
        warnings.filterwarnings("ignore", message=re.escape(prefix))
    kept = [w for w in os.environ.get("PYTHONWARNINGS", "").split(",") if w]
    os.environ["PYTHONWARNINGS"] = ",".join(dict.fromkeys(kept + [f"ignore:{p}" for p in WARNING_PREFIXES]))
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None or "ipykernel" not in type(shell).__module__:
        return
    events = shell.events
    if _CAPTURE.start not in events.callbacks["pre_run_cell"]:
        events.register("pre_run_cell", _CAPTURE.start)
        events.register("post_run_cell", _CAPTURE.stop)
