"""A heartbeat that catches a hung rank before the collective timeout does, and names it.

A collective timeout only fires on the ranks that wait (after minutes, by default 10 for NCCL, 30
for gloo), and says nothing about who they waited for. Here each rank's training loop calls
:meth:`Heartbeat.beat(step, phase)` at each phase of a step (cheap: it only sets two fields); a
watchdog thread publishes the rank's (step, phase, number of beats) to the rendezvous store every
``interval`` seconds and reads everybody's. A rank whose beats stop changing for ``timeout``
seconds, while it is behind the others (fewest beats: they went on and now wait for it in a
collective), is the hung one: the first watchdog to see it writes an abort message to the store,
and every rank's watchdog prints it and exits with :data:`EXIT_CODE`. Under
``torchrun --max-restarts`` the group then restarts from the last checkpoint.

Detected: a rank stuck outside any collective (an infinite loop, a stuck data loader, a
deadlocked thread) while it keeps running Python, or a frozen process (its watchdog stops
publishing, which looks the same). When every rank stops at the same beat (a collective hang that
every rank is in), all are named. Staleness is measured on each watcher's own clock, so clocks of
different nodes need not agree.

As torchelastic's ``TimerServer`` / ``FileTimerServer`` (which kill a worker that does not renew
its timer) and TorchFT's heartbeats to a lighthouse; PyTorch's own NCCL watchdog
(``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``) watches the watchdog thread itself, not training progress.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Callable

import torch.distributed as dist

from dtlib.analytic import validate

__all__ = ["Heartbeat", "EXIT_CODE", "find_hung"]

EXIT_CODE = 75  # EX_TEMPFAIL: a failure worth a restart
_ABORT = "abort"


def find_hung(records: dict[int, dict[str, Any]], stalled_for: dict[int, float], timeout: float) -> list[int]:
    """The ranks to blame: stalled for ``timeout`` seconds and with the fewest beats of all live
    ranks (the others went further and wait for them). Pure: ``records`` maps rank ->
    ``{"step", "phase", "beats"}``; ranks whose phase is ``"done"`` finished and are ignored."""
    live = {r: rec for r, rec in records.items() if rec["phase"] != "done"}
    if not live:
        return []
    fewest = min(rec["beats"] for rec in live.values())
    return sorted(r for r, rec in live.items() if rec["beats"] == fewest and stalled_for.get(r, 0.0) >= timeout)


class Heartbeat:
    """Watch every rank's progress (every rank creates one, after ``init_process_group``).

    Args:
        timeout: seconds without a beat, while behind the others, before the job is aborted
            (well below the collective timeout, above the longest phase of a step).
        interval: seconds between the watchdog's rounds (publish, read, check).
        store: a ``torch.distributed.Store`` shared by the ranks (default: the process group's).
        on_hang: called with the message instead of aborting (tests, notebooks); the default
            prints it and ends the process with :data:`EXIT_CODE` on every rank.
    """

    def __init__(self, timeout: float = 60.0, interval: float = 1.0, store: Any = None,
                 on_hang: Callable[[str], None] | None = None):
        self.timeout = validate.number("timeout", timeout)
        self.interval = validate.number("interval", interval, maximum=timeout)
        if not dist.is_initialized():
            raise RuntimeError("Heartbeat needs torch.distributed initialised (inside dtlib.launch or torchrun)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # the default group's store (a private accessor: torch exposes no public one)
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore("dtlib/heartbeat/", base)
        self.on_hang = on_hang
        self.step, self.phase, self.beats = -1, "start", 0
        self.detected: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dtlib-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._publish()
        self._thread.start()
        return self

    def beat(self, step: int, phase: str) -> None:
        """This rank reached ``phase`` of ``step`` (called by the training loop)."""
        self.step, self.phase, self.beats = step, phase, self.beats + 1

    def stop(self) -> None:
        """Stop watching; this rank is reported as done (never blamed for the others' tail)."""
        self.phase = "done"
        self._stop.set()
        self._thread.join(timeout=10 * self.interval)
        self._publish()

    def _publish(self) -> None:
        record = {"step": self.step, "phase": self.phase, "beats": self.beats}
        self.store.set(f"rank{self.rank}", json.dumps(record))

    def _run(self) -> None:
        last: dict[int, tuple[int, float]] = {}  # rank -> (beats, when they last changed, my clock)
        keys = [f"rank{r}" for r in range(self.world_size)]
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                if self.store.check([_ABORT]):
                    return self._hang(self.store.get(_ABORT).decode())
                if not self.store.check(keys):
                    continue  # someone has not started yet
                records = {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}
            except Exception:  # the store went away: the job is ending, the collectives will say why
                return
            now = time.monotonic()
            for r, rec in records.items():
                if r not in last or last[r][0] != rec["beats"]:
                    last[r] = (rec["beats"], now)
            stalled = {r: now - since for r, (_, since) in last.items()}
            hung = find_hung(records, stalled, self.timeout)
            if hung:
                message = _message(hung, records, stalled)
                # the first watchdog to see it wins; the others read its message
                self.store.compare_set(_ABORT, "", message)
                return self._hang(self.store.get(_ABORT).decode())

    def _hang(self, message: str) -> None:
        self.detected = message
        if self.on_hang is not None:
            self.on_hang(message)
            return
        print(f"[rank {self.rank}] {message}", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)  # the main thread may be stuck: end the process from here


def _message(hung: list[int], records: dict[int, dict[str, Any]], stalled: dict[int, float]) -> str:
    who = ", ".join(f"rank {r} (last step {records[r]['step']}, phase {records[r]['phase']!r}, "
                    f"no progress for {stalled[r]:.1f} s)" for r in hung)
    waiting = [r for r in records if r not in hung and records[r]["phase"] != "done"]
    tail = ("; waiting for it: " + ", ".join(f"rank {r} in step {records[r]['step']}, phase {records[r]['phase']!r}"
                                             for r in waiting)) if waiting else ""
    return f"heartbeat: hung {who}{tail}. Aborting the job (exit {EXIT_CODE}) so it can restart from the last checkpoint."
