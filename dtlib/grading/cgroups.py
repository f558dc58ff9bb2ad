"""The cgroups of a learner's child: made, read and ended by the grader (root only; v1 or v2).

Each child of a submission joins (in :func:`dtlib.grading.sandbox.child_setup`) groups named after
the grader's pid, its row and the child, one per v1 hierarchy or one v2 group: a process cap
(``pids``), a CPU counter (``cpuacct``/``cpu.stat``, the CPU budget), a memory cap for all its
processes together, a CPU weight, and on v1 a freezer. :func:`end_groups` ends everything in them,
processes that left the child's session included; :func:`sweep_groups` removes what a batch
left. Where none can be made (not root) every function returns ``None`` or does nothing, and
:func:`dtlib.grading.sandbox.isolation` says so.
"""
from __future__ import annotations

import os
import signal
import time

__all__ = ["process_group_cap", "cpu_account", "memory_cap", "cpu_weight", "freezer", "child_groups",
           "cpu_seconds_used", "remove_group", "kill_group", "end_groups", "cleanup_method", "sweep_groups"]


_PIDS_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # cgroup v1's pids hierarchy, or v2's


def process_group_cap(name: str, processes: int) -> str | None:
    """A fresh ``pids`` cgroup allowing ``processes`` tasks, or ``None`` where none can be made.

    ``RLIMIT_NPROC`` does not bind root (the kernel exempts it), so a grader that cannot drop to
    an unprivileged user caps fork bombs with the cgroup's ``pids.max`` instead."""
    for root in _PIDS_ROOTS:
        if os.geteuid() != 0 or not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue
        if root == "/sys/fs/cgroup" and not os.path.exists(os.path.join(root, "cgroup.controllers")):
            continue
        path = os.path.join(root, name)
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(processes))
            return path
        except OSError:
            continue
    return None


_CPU_ROOTS = ("/sys/fs/cgroup/cpuacct", "/sys/fs/cgroup")  # v1's cpuacct hierarchy, or v2's
# (hierarchy, file, value): cgroup v1's own hierarchy for the controller first, then v2's single one
_WEIGHT_KNOBS = (("/sys/fs/cgroup/cpu", "cpu.shares", 1024), ("/sys/fs/cgroup", "cpu.weight", 100))  # defaults
_FREEZER_ROOT = "/sys/fs/cgroup/freezer"  # cgroup v1's freezer hierarchy


def _memory_knobs(memory_bytes: int) -> tuple[tuple[str, str, int | str], ...]:
    return (("/sys/fs/cgroup/memory", "memory.limit_in_bytes", memory_bytes),
            ("/sys/fs/cgroup", "memory.max", memory_bytes))


def _knob_group(name: str, knobs: tuple[tuple[str, str, int | str], ...]) -> str | None:
    """A cgroup ``name`` with its value written to the first of ``knobs`` that takes it, or ``None``."""
    for root, knob, value in knobs:
        if os.geteuid() != 0 or not os.path.exists(os.path.join(root, "cgroup.procs")):
            continue
        path = os.path.join(root, name)
        made = not os.path.isdir(path)  # on cgroup v2 the pids and cpu groups are this same folder
        try:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, knob), "w") as f:
                f.write(str(value))
            return path
        except OSError:
            if made:
                remove_group(path)
    return None


def memory_cap(name: str, memory_bytes: int) -> str | None:
    """A cgroup holding all of a child's processes to ``memory_bytes`` of memory together (v1
    ``memory.limit_in_bytes``, v2 ``memory.max``; tmpfs pages count), or ``None``. ``RLIMIT_AS`` is
    per process: one row of many processes once held 5.4 GiB."""
    return _knob_group(name, _memory_knobs(memory_bytes))


def cpu_weight(name: str) -> str | None:
    """A cgroup with the default CPU weight (v1 ``cpu.shares``, v2 ``cpu.weight``), or ``None``: the
    scheduler shares the CPU between such groups, not between processes, so a row of 48 busy
    processes gets no more of it than the honest row beside it."""
    return _knob_group(name, _WEIGHT_KNOBS)


def freezer(name: str) -> str | None:
    """A cgroup v1 ``freezer`` group (thawed), or ``None``: on v2 every group can be frozen and
    killed (``cgroup.freeze``, ``cgroup.kill``), so none is needed there."""
    return _knob_group(name, ((_FREEZER_ROOT, "freezer.state", "THAWED"),))


def child_groups(name: str, processes: int, memory_bytes: int) -> tuple[str, ...]:
    """The cgroups of one child, ``name`` in every hierarchy (on cgroup v2 one group): its
    process cap, CPU counter, memory cap, CPU weight and (v1) freezer; those that could be made."""
    made = (process_group_cap(name, processes), cpu_account(name), memory_cap(name, memory_bytes), cpu_weight(name),
            freezer(name))
    return tuple(dict.fromkeys(g for g in made if g))


def cpu_account(name: str) -> str | None:
    """A fresh cgroup that counts the CPU time of everything in it (v1 ``cpuacct``, v2
    ``cpu.stat``), or ``None`` where none can be made. The grader reads it with
    :func:`cpu_seconds_used` to stop a submission by the CPU time all its processes used, which
    machine load does not change (``RLIMIT_CPU`` is per process: a fork bomb's processes would
    each start from zero)."""
    for root, counter in zip(_CPU_ROOTS, ("cpuacct.usage", "cgroup.controllers")):
        if os.geteuid() != 0 or not os.path.exists(os.path.join(root, counter)):
            continue
        path = os.path.join(root, name)
        try:
            os.makedirs(path, exist_ok=True)
            cpu_seconds_used(path)
            return path
        except OSError:
            continue
    return None


def cpu_seconds_used(path: str) -> float:
    """CPU seconds (user + system) used so far by the processes of the cgroup ``path``."""
    if os.path.exists(os.path.join(path, "cpuacct.usage")):
        with open(os.path.join(path, "cpuacct.usage")) as f:
            return int(f.read()) / 1e9
    with open(os.path.join(path, "cpu.stat")) as f:
        usage = dict(line.split() for line in f if line.strip())
    return int(usage["usage_usec"]) / 1e6


def remove_group(path: str | None) -> None:
    """Remove a cgroup made by :func:`process_group_cap` (its processes must be gone)."""
    if path:
        try:
            os.rmdir(path)
        except OSError:
            pass


def sweep_groups(prefix: str, wait: float = 60.0) -> None:
    """Kill and remove every cgroup whose name starts with ``prefix`` (a batch's leftovers: a fork
    bomb's orphans may outlive its row's own cleanup on a loaded machine)."""
    deadline = time.monotonic() + wait
    roots = _PIDS_ROOTS + _CPU_ROOTS + tuple(r for r, _, _ in _memory_knobs(0) + _WEIGHT_KNOBS) + (_FREEZER_ROOT,)
    for root in dict.fromkeys(roots):
        for name in (os.listdir(root) if os.path.isdir(root) else []):
            path = os.path.join(root, name)
            while name.startswith(prefix) and os.path.isdir(path) and time.monotonic() < deadline:
                end_groups((path,))
                remove_group(path)
                time.sleep(0.1)


def kill_group(path: str | None) -> None:
    """SIGKILL every process in the cgroup ``path`` (what a submission left running)."""
    if not path:
        return
    for _ in range(5):  # a fork bomb may spawn between two rounds; pids.max bounds it
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(line) for line in f if line.strip()]
        except OSError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _write(path: str, value: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(value)
        return True
    except OSError:
        return False


def end_groups(groups: tuple[str, ...], wait: float = 2.0) -> None:
    """End every process in the cgroups ``groups`` (one child's: :func:`child_groups`), escapees
    of its session included, without knowing their pids or user: cgroup v2's ``cgroup.kill``
    (the kernel kills the whole group at once, Linux 5.14+); on v1, the freezer group frozen
    first (a fork bomb cannot add a process between reading ``cgroup.procs`` and the kills), every
    process killed, then thawed so the kills land; and every pid left in any group killed."""
    for group in groups:
        _write(os.path.join(group, "cgroup.kill"), "1")
    frozen = [g for g in groups if _write(os.path.join(g, "freezer.state"), "FROZEN")]
    deadline = time.monotonic() + wait
    for group in frozen:  # FREEZING until every task has stopped
        while time.monotonic() < deadline and _read(os.path.join(group, "freezer.state")) != "FROZEN":
            time.sleep(0.01)
    for group in groups:
        kill_group(group)
    for group in frozen:
        _write(os.path.join(group, "freezer.state"), "THAWED")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def cleanup_method(groups: tuple[str, ...]) -> str:
    """How :func:`end_groups` ends a child in ``groups`` (said in the ``isolation:`` line), or
    ``""`` where no cgroup could be made (the grader then falls back to :func:`kill_user`)."""
    if any(os.path.exists(os.path.join(g, "cgroup.kill")) for g in groups):
        return "cgroup.kill of its cgroup (v2)"
    if any(os.path.exists(os.path.join(g, "freezer.state")) for g in groups):
        return "its freezer cgroup frozen, every process in it killed, then thawed (cgroup v1)"
    if groups:
        return "every process in its cgroups killed until they are empty (cgroup v1, no freezer)"
    return ""
