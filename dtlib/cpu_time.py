"""What a process tree has cost: CPU seconds of a process and all its descendants.

The notebook budget (the root ``conftest.py``) charges a lesson for the CPU its kernel and the
ranks it launches spent, not for wall time, which grows with whatever else the machine runs.
CPU time is what the kernel's scheduler accounts to each process (``/proc/<pid>/stat``,
``proc(5)``): ``utime + stime`` for the process itself and ``cutime + cstime`` for the children
it has waited for, which in turn hold the children *they* waited for. So a rank that has exited
and been joined is still counted, through its parent; a live one is counted by walking the tree.
"""
from __future__ import annotations

import psutil


def _own_and_reaped(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) spent by process ``pid`` and every descendant, exited ones
    included once their parent has waited for them (``proc(5)``: cutime, cstime).

    Each process is read before its children, so a child reaped between two reads is missed by
    this sample (its parent was read first) rather than counted twice; the next sample has it in
    the parent's cutime. Processes that left the tree without being waited for (re-parented to
    init) are not counted.
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError(f"pid must be a positive integer, got {pid!r}")
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        raise ValueError(f"pid {pid} is not a running process") from None
    total = 0.0
    stack = [root]
    while stack:
        proc = stack.pop()
        try:
            total += _own_and_reaped(proc)
            stack.extend(proc.children())
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # gone or reaped since it was listed: its parent's next sample holds it
    return total
