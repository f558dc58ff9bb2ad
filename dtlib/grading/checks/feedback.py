"""What a check tells the learner: short, first line first."""
from __future__ import annotations

__all__ = ["first_line"]


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` of what a rank raised (the launcher's error
    carries the rank's own exception as ``__cause__``)."""
    cause = exc.__cause__ or exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"
