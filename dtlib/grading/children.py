"""The two walled-off children of one submission, each forked from a pre-imported parent
(:mod:`dtlib.grading.prefork`): otter's execution of the notebook and the isolated verdict, run
at the same time, each stopped by a wall-clock limit and a budget of CPU seconds for all its
processes together (:class:`_Budget`), then ended with everything they started (:func:`_stop`).
Used by :mod:`dtlib.grading.batch`.
"""
from __future__ import annotations

import json
import math
import os
import select
import signal
import threading
import time
from pathlib import Path

from dtlib.grading import cgroups, prefork, rowfiles, sandbox
from dtlib.grading.grades_csv import first_line

__all__ = ["run_children"]

_MAX_REPORT = 1 << 20  # bytes of a child's JSON report read back


def _child_env(home: Path) -> dict[str, str]:
    """The environment of a walled-off child: the allow-list of ours (:func:`sandbox.minimal_env`),
    with a home and temp folder of its own."""
    env = sandbox.minimal_env()
    env.update(HOME=str(home), TMPDIR=str(home), JUPYTER_RUNTIME_DIR=str(home / ".jupyter"),
               MPLCONFIGDIR=str(home / ".mpl"), PYTHONDONTWRITEBYTECODE="1")
    return env


def _groups(home: Path, limits: sandbox.Limits) -> tuple[str, ...]:
    """The cgroups of one child (same name in every hierarchy: on cgroup v2 it is one group)."""
    return cgroups.child_groups(f"dtlib-grade-{os.getpid()}-{home.parent.name}-{home.name}", limits.processes,
                                limits.group_memory_bytes)


class _Budget:
    """When a child must stop: a wall-clock deadline and, where a CPU-accounting cgroup could be
    made, the CPU seconds its processes may use together (``None``: no such budget)."""

    def __init__(self, timeout: float, cpu_time: float | None, groups: tuple[str, ...]):
        self.timeout, self.cpu_time = timeout, cpu_time
        self.deadline = time.monotonic() + timeout
        self.counter = next((g for g in groups if _counts_cpu(g)), None) if cpu_time else None

    def spent(self) -> str:
        """Why the child must stop now, or ``""``."""
        if time.monotonic() >= self.deadline:
            return f"no result within {self.timeout:g} s"
        if self.counter and cgroups.cpu_seconds_used(self.counter) > self.cpu_time:
            return f"more than {self.cpu_time:g} s of CPU time used"
        return ""

    def wait(self) -> float:
        """How long to block before looking again."""
        return max(0.0, min(0.5, self.deadline - time.monotonic()))


def _counts_cpu(group: str) -> bool:
    try:
        cgroups.cpu_seconds_used(group)
        return True
    except (OSError, KeyError, ValueError):
        return False


def _stop(pid: int, groups: tuple[str, ...], uid: int | None) -> None:
    """End a child and everything it started: its session, then its cgroups
    (:func:`cgroups.end_groups`), or, only where no cgroup could be made, every process of its user
    (``kill(-1)`` as that user)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if groups:
        cgroups.end_groups(groups)
    else:
        sandbox.kill_user(uid)
    for group in groups:
        for _ in range(300):  # orphans of a fork bomb take a while to be reaped
            cgroups.kill_group(group)
            cgroups.remove_group(group)
            if not os.path.exists(group):
                break
            time.sleep(0.1)


def _exchange(stdin: int, stdout: int, job: bytes, budget: _Budget) -> tuple[bytes | None, str]:
    """Write ``job`` to a verdict's stdin, then read its stdout to the end; or ``None`` and why
    it was stopped first."""
    out = job
    try:
        while out and not budget.spent():
            _, ready, _ = select.select([], [stdin], [], budget.wait())
            if ready:
                out = out[os.write(stdin, out[:1 << 16]):]
    except BrokenPipeError:
        out = b""  # it ended before reading the job: it will give no report
    finally:
        os.close(stdin)
    return _read_to_end(stdout, budget)


def _read_to_end(stdout: int, budget: _Budget) -> tuple[bytes | None, str]:
    """What a child writes to ``stdout`` until it closes it (at most about :data:`_MAX_REPORT`
    bytes), or ``None`` and why it was stopped first."""
    chunks, size = [], 0
    while size <= _MAX_REPORT:
        why = budget.spent()
        if why:
            return None, why
        ready, _, _ = select.select([stdout], [], [], budget.wait())
        if ready:
            chunk = os.read(stdout, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks), ""


def _run_verdict(forker: prefork.Starting, job: bytes, home: Path, uid: int | None, limits: sandbox.Limits,
                 mounts: sandbox.Mounts, timeout: float, cpu_time: float | None) -> tuple[dict | None, str]:
    """Fork a verdict process for ``job`` from ``forker``; its report, or ``None`` and why."""
    groups = _groups(home, limits)
    job_read, job_write = os.pipe()
    report_read, report_write = os.pipe()
    log_path = home.parent / "verdict.log"
    try:
        with rowfiles.open_private(log_path) as log:
            pid = forker.start([job_read, report_write, log.fileno()], forker.cwd, _child_env(home), limits, uid,
                               mounts, groups)
    finally:
        os.close(job_read)
        os.close(report_write)
    try:
        out, why = _exchange(job_write, report_read, job, _Budget(timeout, cpu_time, groups))
    finally:
        os.close(report_read)
        _stop(pid, groups, uid)
    if out is None:
        return None, why
    try:
        found = json.loads(out[:_MAX_REPORT])
    except ValueError:
        found = None
    if isinstance(found, dict):
        return found, ""
    lines = [s for s in rowfiles.read_tail(log_path, 20000).splitlines() if s.strip()]
    return None, "the verdict process ended without a report" + (f" ({first_line(lines[-1])})" if lines else "")


def run_children(autograder_zip: Path, notebook: Path, runner: prefork.Forker, forker: prefork.Starting | None,
                 cells: dict, timeout: float, cpu_time: float | None, workdir: Path,
                 uids: tuple[int | None, int | None],
                 mounts: sandbox.Mounts = sandbox.Mounts()) -> tuple[dict | None, str, str, dict | None, str]:
    """Execute ``notebook`` with otter (forked from ``runner``, the batch's execution parent) and,
    at the same time, compute its isolated verdict (forked from ``forker`` once that parent is
    ready).

    Returns otter's report (or ``None``), a status and why, then the verdict (or ``None``) and
    why it failed. Each child has its own user (``uids``) and folder, a session of its own (a
    timeout kills it and all it started), the limits of :class:`sandbox.Limits` and, with
    ``cpu_time``, a budget of CPU seconds for all its processes together.
    """
    # RLIMIT_CPU per process: a backstop behind the budget of the whole tree, which is polled
    limits = sandbox.Limits(cpu_seconds=max(1, math.ceil((cpu_time or timeout) + 5)))
    homes = workdir / "execute", workdir / "verdict"
    for home, uid in zip(homes, uids):
        home.mkdir(mode=0o700)
        sandbox.chown_tree(str(home), uid)
    target = homes[0] / notebook.name
    rowfiles.copy_private(notebook, target)
    zips = [home / autograder_zip.name for home in homes]
    for copy in zips:
        rowfiles.copy_private(autograder_zip, copy)
    for home, uid in zip(homes, uids):
        sandbox.chown_tree(str(home), uid)
    out_json, log_path = homes[0] / "report.json", workdir / "grader.log"
    groups = _groups(homes[0], limits)
    status_read, status_write = os.pipe()  # the execution writes "ok" there when it has written its report
    try:
        with rowfiles.open_private(log_path) as log, open(os.devnull, "rb") as null:
            executor = runner.start([null.fileno(), log.fileno(), log.fileno(), status_write], homes[0],
                                    _child_env(homes[0]), limits, uids[0], mounts, groups,
                                    argv=[str(zips[0]), str(target), str(out_json)])
    except BaseException:
        os.close(status_read)
        raise
    finally:
        os.close(status_write)
    budget = _Budget(timeout, cpu_time, groups)
    judged: dict = {"result": (None, "")}
    if forker is not None:  # its own thread, so both children are watched (and stopped) at once
        job = json.dumps({"autograder_zip": str(zips[1]), "cells": cells}).encode()

        def judge() -> None:
            try:
                judged["result"] = _run_verdict(forker, job, homes[1], uids[1], limits, mounts, timeout, cpu_time)
            except Exception as exc:  # noqa: BLE001 - the row says why; the batch goes on
                judged["result"] = None, f"the verdict could not start ({type(exc).__name__}: {exc})"
        watcher = threading.Thread(target=judge, daemon=True)
        watcher.start()
    try:
        status, why = _read_to_end(status_read, budget)
    finally:
        os.close(status_read)
        _stop(executor, groups, uids[0])
        if forker is not None:
            watcher.join()
    found, why_verdict = judged["result"]
    if forker is not None and isinstance(found, dict) and found.get("torch") is True:
        forker.load_torch()  # this master's verdicts need torch: the next ones get it from their parent
    if status is None:
        return None, "timed out", (f"{why} (a cell that never ends?); raise --timeout or --cpu-time "
                                   "if it is just slow"), found, why_verdict
    if status == b"ok":
        # the submission's own user wrote it, and may have put a link, a FIFO or anything there
        try:
            return json.loads(rowfiles.read_limited(out_json, _MAX_REPORT, uids[0])), "graded", "", found, why_verdict
        except (OSError, ValueError) as exc:
            return None, "grader failed", first_line(f"no readable report ({exc})"), found, why_verdict
    lines = [s for s in rowfiles.read_tail(log_path, 20000).splitlines() if s.strip()]
    why = first_line(lines[-1] if lines else "the grader ended without a report")
    return None, "grader failed", why, found, why_verdict
