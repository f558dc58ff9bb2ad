"""A rank of the check's own among the learner's ranks: behaviour seen from outside the learner.

What a rank measures about its own run (bytes sent, collectives called) is read in the process
where the learner's code runs, so that code can forge it (issue 39). A *witness* is the last rank
of a launch: it runs only the check's code, takes part in the learner's communication as an
honest peer of the exercise would, and checks every message it gets. gloo matches a collective
only with the same collective of the same size, so what the learner's ranks call with it is
judged where they cannot reach. Its findings reach the check through a pipe only it holds (the
learner's ranks close their ends before any of their code runs), as JSON lines: the last one
says where it stopped and why. It cannot see what two of the learner's own ranks exchange, nor
channels other than the process group (shared memory, files).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

from dtlib.launcher import LaunchError, launch

__all__ = ["run_with_witness", "say", "Witnessed"]

_REPORT_LIMIT = 1 << 16


def say(fd: int, **record: Any) -> None:
    """The witness's word to the check: one JSON line (``waiting=``, ``problem=`` or ``done=``)."""
    os.write(fd, (json.dumps(record) + "\n").encode())


class Witnessed(AssertionError):
    """Raised by a witness after it has said its ``problem``: ends its rank, and so the launch."""


def _rank(rank: int, world_size: int, learner: Callable, witness: Callable, args: tuple,
          read_fd: int, write_fd: int) -> None:
    os.close(read_fd)
    if rank == world_size - 1:
        try:
            witness(rank, world_size, write_fd, *args)
        finally:
            os.close(write_fd)
        return None
    os.close(write_fd)  # before any learner code: only the witness can write the report
    learner(rank, world_size, *args)
    return None


def _last_record(read_fd: int) -> dict:
    data = b""
    while len(data) < _REPORT_LIMIT:
        part = os.read(read_fd, _REPORT_LIMIT)
        if not part:
            break
        data += part
    records = []
    for line in data.decode(errors="replace").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:  # cut at the size limit
            break
    return records[-1] if records else {}


def run_with_witness(learner: Callable, witness: Callable, world_size: int, args: tuple = (),
                     timeout: float = 20.0) -> tuple[dict, LaunchError | None]:
    """Launch ``learner(rank, world_size, *args)`` on ranks ``0 .. world_size - 2`` and
    ``witness(rank, world_size, fd, *args)`` on the last; return the witness's last record and
    the launch's failure (None if every rank returned). Linux, forked ranks (the pipe is
    inherited): the launcher's default with gloo."""
    read_fd, write_fd = os.pipe()
    failure = None
    try:
        launch(_rank, world_size, args=(learner, witness, tuple(args), read_fd, write_fd),
               timeout=timeout, output="none", start_method="fork")
    except LaunchError as e:
        failure = e
    finally:
        os.close(write_fd)  # every rank has ended (launch kills them): the pipe reads to its end
    try:
        return _last_record(read_fd), failure
    finally:
        os.close(read_fd)
